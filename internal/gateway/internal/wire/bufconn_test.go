package wire

import (
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/nexus-broker/nexus-broker/internal/rawsock"
)

// countingListener counts the write(2)s made on the connections it accepts.
type countingListener struct {
	net.Listener
	writes *atomic.Int64
}

func (l countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return countingConn{rawsock.Wrap(c), l.writes}, nil
}

type countingConn struct {
	net.Conn
	writes *atomic.Int64
}

func (c countingConn) Write(p []byte) (int, error) {
	c.writes.Add(1)
	return c.Conn.Write(p)
}

// SyscallConn and ReadPooled are the socket's, as on the gateway's own
// connections.
func (c countingConn) SyscallConn() (syscall.RawConn, error) {
	return c.Conn.(syscall.Conn).SyscallConn()
}

func (c countingConn) ReadPooled(pool *sync.Pool) (*[]byte, int, error) {
	return c.Conn.(pooledReader).ReadPooled(pool)
}

// combinePair is a gateway-side Conn behind Listener and the gorilla
// client talking to it, plus the count of the gateway side's writes.
func combinePair(t testing.TB) (*Conn, *websocket.Conn, *atomic.Int64) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	writes := new(atomic.Int64)
	server := make(chan *Conn, 1)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c, err := Upgrader.Upgrade(w, r, nil)
		if err != nil {
			t.Error(err)
			return
		}
		server <- NewConn(c, slog.New(slog.NewTextHandler(io.Discard, nil)), "client", "L")
	})}
	go func() { _ = srv.Serve(Listener(countingListener{ln, writes})) }()
	t.Cleanup(func() { _ = srv.Close() })
	client, _, err := websocket.DefaultDialer.Dial("ws://"+ln.Addr().String()+"/", nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.Close() })
	ws := <-server
	if ws.bc == nil {
		t.Fatal("the upgraded connection is not a bufConn")
	}
	t.Cleanup(func() { ws.CloseNow(websocket.CloseNormalClosure, "") })
	return ws, client, writes
}

func readText(t *testing.T, c *websocket.Conn) string {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	kind, data, err := c.ReadMessage()
	if err != nil || kind != websocket.TextMessage {
		t.Fatalf("read: kind %d, %v", kind, err)
	}
	return string(data)
}

// TestHeldFramesLeaveInOneWrite: frames sent with hold wait in the buffer
// and the flush writes them all with one write(2), in order, whatever
// their sizes (all three header lengths).
func TestHeldFramesLeaveInOneWrite(t *testing.T) {
	ws, client, writes := combinePair(t)
	msgs := []string{"one", strings.Repeat("b", 300), strings.Repeat("c", 20000)}
	before := writes.Load()
	for _, m := range msgs {
		if _, err := ws.Send([]byte(m), true); err != nil {
			t.Fatal(err)
		}
	}
	if n := writes.Load() - before; n != 0 {
		t.Fatalf("%d writes before the flush; held frames must wait for it", n)
	}
	if _, err := ws.Flush(); err != nil {
		t.Fatal(err)
	}
	if n := writes.Load() - before; n != 1 {
		t.Fatalf("the flush took %d writes, want 1", n)
	}
	// Past combineLimit a frame leaves at once, hold or not.
	big := strings.Repeat("d", combineLimit+1)
	if _, err := ws.Send([]byte(big), true); err != nil {
		t.Fatal(err)
	}
	for _, want := range append(msgs, big) {
		if got := readText(t, client); got != want {
			t.Fatalf("got a message of %d bytes, want %d", len(got), len(want))
		}
	}
}

// TestControlFramesAreNotHeld: a ping goes out at once, behind the frames
// held before it, and a close reaches the peer the same way; after the
// close no data frame is written.
func TestControlFramesAreNotHeld(t *testing.T) {
	ws, client, _ := combinePair(t)
	pinged := make(chan struct{}, 1)
	client.SetPingHandler(func(string) error { pinged <- struct{}{}; return nil })
	if _, err := ws.Send([]byte("held"), true); err != nil {
		t.Fatal(err)
	}
	ws.Probe() // the liveness ping, as the timer sends it
	if got := readText(t, client); got != "held" {
		t.Fatalf("got %q, want the held frame first", got)
	}
	// The ping is handled inside the next read, which the close ends.
	ws.CloseGraceful(CodeSuperseded, CloseSuperseded)
	_ = client.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, _, err := client.ReadMessage()
	var ce *websocket.CloseError
	if !errors.As(err, &ce) || ce.Code != CodeSuperseded || ce.Text != CloseSuperseded {
		t.Fatalf("read ended with %v, want close %d %q", err, CodeSuperseded, CloseSuperseded)
	}
	select {
	case <-pinged:
	default:
		t.Fatal("the ping did not reach the peer before the close")
	}
	if _, err := ws.Send([]byte("late"), false); !errors.Is(err, websocket.ErrCloseSent) {
		t.Fatalf("a data frame after the close: %v, want ErrCloseSent", err)
	}
}

// TestReadsLendTheirBuffer: frames of every header length, sent in one
// burst so that reads split them anywhere, arrive whole and in order; once
// every byte received has been read the connection holds no read buffer;
// a read deadline still ends a read that waits, as a timeout; and the
// peer's close ends the next one.
func TestReadsLendTheirBuffer(t *testing.T) {
	ws, client, _ := combinePair(t)
	if ws.bc.pooled == nil {
		t.Fatal("the connection does not borrow its read buffers")
	}
	var msgs []string
	for i, n := range []int{1, 125, 126, readBufferSize, readChunk - 1, readChunk, 3 * readChunk, 70000} {
		msgs = append(msgs, strings.Repeat(string(rune('a'+i)), n))
	}
	msgs = append(msgs, msgs...)
	var burst []byte
	for _, m := range msgs {
		// Masked, as a client must; a zero key leaves the payload as is.
		burst = append(burst, finalBit|websocket.TextMessage)
		switch n := len(m); {
		case n < 126:
			burst = append(burst, 0x80|byte(n))
		case n <= 0xffff:
			burst = binary.BigEndian.AppendUint16(append(burst, 0x80|126), uint16(n))
		default:
			burst = binary.BigEndian.AppendUint64(append(burst, 0x80|127), uint64(n))
		}
		burst = append(append(burst, 0, 0, 0, 0), m...)
	}
	if _, err := client.UnderlyingConn().Write(burst); err != nil {
		t.Fatal(err)
	}
	for i, want := range msgs {
		_ = ws.c.SetReadDeadline(time.Now().Add(10 * time.Second))
		got, err := ws.Read()
		if err != nil || string(got) != want {
			t.Fatalf("message %d: %d bytes, %v; want %d bytes", i, len(got), err, len(want))
		}
	}
	if ws.bc.rbuf != nil {
		t.Fatalf("every byte is read, yet the connection holds a read buffer (%d bytes unread)", ws.bc.rlen-ws.bc.roff)
	}
	_ = ws.c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	_, _, err := ws.c.ReadMessage()
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("a read past its deadline ended with %v, want a timeout", err)
	}
	if ws.bc.rbuf != nil {
		t.Fatal("a read waiting for the socket held a read buffer")
	}
}

// TestReadsSeeThePeerGo: a peer's close ends the read with it, and a peer
// that drops the connection ends the read with an error.
func TestReadsSeeThePeerGo(t *testing.T) {
	ws, client, _ := combinePair(t)
	_ = client.WriteMessage(websocket.CloseMessage, websocket.FormatCloseMessage(websocket.CloseNormalClosure, "bye"))
	_ = ws.c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := ws.Read(); !websocket.IsCloseError(err, websocket.CloseNormalClosure) {
		t.Fatalf("read ended with %v, want the peer's close", err)
	}
	ws, client, _ = combinePair(t)
	_ = client.UnderlyingConn().Close()
	_ = ws.c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := ws.Read(); err == nil {
		t.Fatal("a read from a dropped connection succeeded")
	} else if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatalf("a read from a dropped connection timed out (%v) rather than seeing it go", err)
	}
}

// TestWriteFrameAllocatesNothing: the per-frame path, hold and flush, is
// allocation-free in steady state.
func TestWriteFrameAllocatesNothing(t *testing.T) {
	ws, client, _ := combinePair(t)
	// The raw bytes, so the reader's own allocations are not counted.
	go func() { _, _ = io.Copy(io.Discard, client.UnderlyingConn()) }()
	frame := []byte(`{"version":1,"lease_id":"L","seq":7,"signal":"io","payload":{"type":"echo","n":1}}`)
	allocs := testing.AllocsPerRun(1000, func() {
		_, _ = ws.Send(frame, true)
		_, _ = ws.Send(frame, true)
		_, _ = ws.Flush()
	})
	if allocs != 0 {
		t.Fatalf("%.1f allocations per two frames and a flush, want 0", allocs)
	}
}

// BenchmarkWriteFrame is the per-frame cost of the combining writer: eight
// frames held, then one flush, per iteration of eight frames.
func BenchmarkWriteFrame(b *testing.B) {
	ws, client, _ := combinePair(b)
	// The raw bytes, so the reader's own allocations are not counted.
	go func() { _, _ = io.Copy(io.Discard, client.UnderlyingConn()) }()
	frame := []byte(`{"version":1,"lease_id":"L","seq":7,"signal":"io","payload":{"type":"echo","n":1}}`)
	b.ReportAllocs()
	for b.Loop() {
		for range 8 {
			_, _ = ws.Send(frame, true)
		}
		_, _ = ws.Flush()
	}
}

// tornConn writes half of what it is given, then fails: a write cut short by
// its deadline.
type tornConn struct {
	net.Conn
	writes *atomic.Int64
}

var errTorn = errors.New("write cut short")

func (c tornConn) Write(p []byte) (int, error) {
	c.writes.Add(1)
	n, _ := c.Conn.Write(p[:len(p)/2])
	return n, errTorn
}

// TestAWriteErrorIsFinal: after a write that stopped part-way through a
// frame, every later write — data, gorilla's ping and its close — returns
// that error and reaches nothing, and the socket is closed, so the peer
// reads the torn frame's start and then the end of the connection.
func TestAWriteErrorIsFinal(t *testing.T) {
	ws, client, _ := combinePair(t)
	torn := new(atomic.Int64)
	ws.bc.mu.Lock()
	ws.bc.Conn = tornConn{ws.bc.Conn, torn}
	ws.bc.mu.Unlock()
	if _, err := ws.Send([]byte(strings.Repeat("a", 1000)), false); !errors.Is(err, errTorn) {
		t.Fatalf("the torn write: %v", err)
	}
	if _, err := ws.Send([]byte("after"), true); !errors.Is(err, errTorn) {
		t.Fatalf("a held frame after the failure: %v, want the failure", err)
	}
	if _, err := ws.Flush(); !errors.Is(err, errTorn) {
		t.Fatalf("a flush after the failure: %v, want the failure", err)
	}
	if err := ws.c.WriteControl(websocket.PingMessage, nil, time.Now().Add(time.Second)); err == nil {
		t.Fatal("a ping after the failure was written")
	}
	ws.Probe()
	ws.CloseNow(websocket.CloseGoingAway, closeUnresponsive)
	if n := torn.Load(); n != 1 {
		t.Fatalf("%d writes reached the socket, want only the torn one", n)
	}
	raw := client.UnderlyingConn()
	_ = raw.SetReadDeadline(time.Now().Add(10 * time.Second))
	got, err := io.ReadAll(raw)
	if err != nil {
		t.Fatalf("the peer's read ended with %v after %d bytes, want the connection's end", err, len(got))
	}
	if len(got) != (1000+4)/2 {
		t.Fatalf("the peer read %d bytes, want the torn write's %d and nothing after", len(got), (1000+4)/2)
	}
}
