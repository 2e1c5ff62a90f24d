package ingress

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/a2a"
	"github.com/nexus-broker/nexus-broker/internal/gateway"
	"github.com/nexus-broker/nexus-broker/internal/httpapi"
)

// statusEvent is an event that names n, and is final when final is set.
func statusEvent(n int, final bool) a2a.Event {
	state := a2a.StateWorking
	if final {
		state = a2a.StateCompleted
	}
	return a2a.Event{StatusUpdate: &a2a.StatusUpdate{TaskID: fmt.Sprint(n), Status: a2a.Status{State: state}}}
}

func eventFrame(ev a2a.Event) []byte {
	data, _ := json.Marshal(ev)
	return data
}

// smallBuffers accepts connections whose send buffer is as small as the
// kernel allows, so that a client that stops reading fills it soon. (The
// client's receive buffer keeps its size: a window below one segment
// stalls loopback TCP on its own.)
type smallBuffers struct{ net.Listener }

func (l smallBuffers) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		_ = c.(*net.TCPConn).SetWriteBuffer(1)
	}
	return c, err
}

// serveStream serves s on a real socket through the gateway's own server
// and listener, and returns a connection that has sent the request and
// read the response's head.
func serveStream(t *testing.T, s *a2a.Stream, small bool) (*bufio.Reader, net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var inner net.Listener = ln
	if small {
		inner = smallBuffers{ln}
	}
	srv := httpapi.Server(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { streamTo(w, r, s, eventFrame) }))
	go func() { _ = srv.Serve(gateway.Listener(inner)) }()
	t.Cleanup(func() { _ = srv.Close() })
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	if _, err := fmt.Fprint(c, "GET /stream HTTP/1.1\r\nHost: test\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Fatalf("Content-Type %q", ct)
	}
	return bufio.NewReader(resp.Body), c
}

// readEvents reads data lines until the body ends and returns the task ids
// they name, in order.
func readEvents(t *testing.T, body *bufio.Reader) []string {
	t.Helper()
	var got []string
	for {
		line, err := body.ReadString('\n')
		if err != nil {
			return got
		}
		data, ok := strings.CutPrefix(strings.TrimSuffix(line, "\n"), "data: ")
		if !ok {
			continue
		}
		var ev a2a.Event
		if err := json.Unmarshal([]byte(data), &ev); err != nil || ev.StatusUpdate == nil {
			t.Fatalf("data line %q is not a status update: %v", data, err)
		}
		got = append(got, ev.StatusUpdate.TaskID)
	}
}

// TestStreamKeepsOrderAcrossWriters: events queued from another goroutine
// and written by it (writeDirect) or by the handler (signal) reach the
// client once each, in the order they were queued, and the final one ends
// the response. (As many as a stream holds: more, published faster than
// they are written, would end it as too far behind.)
func TestStreamKeepsOrderAcrossWriters(t *testing.T) {
	const events = a2a.SubscriberBuffer
	s := a2a.NewStream(statusEvent(0, false))
	body, _ := serveStream(t, s, false)
	go func() {
		for n := 1; n < events; n++ {
			s.Push([]a2a.Event{statusEvent(n, n == events-1)})
			if n%3 == 0 {
				s.Signal()
			} else {
				s.WriteDirect()
			}
		}
	}()
	got := readEvents(t, body)
	if len(got) != events {
		t.Fatalf("read %d events, want %d: %v", len(got), events, got)
	}
	for n, id := range got {
		if id != fmt.Sprint(n) {
			t.Fatalf("event %d names %s: %v", n, id, got)
		}
	}
}

// TestStreamDirectWriteNeverBlocks: a client that stops reading never
// stalls the goroutine that publishes (an instance's read pump): what its
// socket cannot take is left to the request's own goroutine, and reaches
// the client, in order, once it reads again.
func TestStreamDirectWriteNeverBlocks(t *testing.T) {
	const events = 40
	s := a2a.NewStream(statusEvent(0, false))
	body, _ := serveStream(t, s, true)
	big := strings.Repeat("x", 64<<10) // 40 of them: far beyond both socket buffers
	published := make(chan struct{})
	go func() {
		defer close(published)
		for n := 1; n < events; n++ {
			ev := statusEvent(n, n == events-1)
			ev.StatusUpdate.ContextID = big
			s.Push([]a2a.Event{ev})
			s.WriteDirect()
		}
	}()
	select {
	case <-published:
	case <-time.After(20 * time.Second):
		t.Fatal("publishing blocked on a client that does not read")
	}
	got := readEvents(t, body)
	if len(got) != events {
		t.Fatalf("read %d events, want %d", len(got), events)
	}
	for n, id := range got {
		if id != fmt.Sprint(n) {
			t.Fatalf("event %d names %s", n, id)
		}
	}
}

// TestStreamTooFarBehindEnds: a stream that falls subscriberBuffer events
// behind ends after the ones it holds, rather than growing.
func TestStreamTooFarBehindEnds(t *testing.T) {
	s := a2a.NewStream(statusEvent(0, false))
	for n := 1; n < a2a.SubscriberBuffer; n++ {
		if !s.Push([]a2a.Event{statusEvent(n, false)}) {
			t.Fatalf("push %d refused", n)
		}
	}
	if s.Push([]a2a.Event{statusEvent(a2a.SubscriberBuffer, false)}) {
		t.Fatal("a stream holding subscriberBuffer events took one more")
	}
	body, _ := serveStream(t, s, false)
	if got := readEvents(t, body); len(got) != a2a.SubscriberBuffer {
		t.Fatalf("read %d events, want the %d held", len(got), a2a.SubscriberBuffer)
	}
}
