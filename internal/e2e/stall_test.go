package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// TestAStalledClientReadsWholeFramesThenTheEnd: a client that stops reading
// in the middle of a from_seq=0 replay (a receive buffer of 4 KiB, nothing
// read for longer than the gateway's write wait) later reads whole frames,
// then a close frame or the end of the connection: never a byte of one frame
// inside another, and never a connection left open with nothing more coming.
// The bytes are read off the socket and parsed here, so that nothing a
// WebSocket library forgives hides a torn frame.
func TestAStalledClientReadsWholeFramesThenTheEnd(t *testing.T) {
	// Longer than the product's 10 s write wait, so that a gateway without
	// the test knob stalls on this client too.
	const stall = 11 * time.Second
	b := startBroker(t, Options{YAML: "client_replay_buffer_bytes: 8388608\n",
		GatewayEnv: []string{"NEXUS_BROKER_TEST_WRITE_WAIT=500ms"}})
	claim := b.claim(brokerclient.ClaimRequest{})
	conn := b.dial(claim, brokerclient.DialOptions{})
	if err := conn.Send(brokerframe.IO{Type: "input", Content: "/big 30000"}); err != nil {
		t.Fatal(err)
	}
	seqs, _ := readTurn(t, conn) // ~3 MB of deltas in the replay log
	conn.Close()

	sock := dialStalling(t, claim.WSURL+"?from_seq=0")
	defer sock.Close()
	time.Sleep(stall) // the fault itself: a client that reads nothing for 11 s

	_ = sock.SetReadDeadline(time.Now().Add(30 * time.Second))
	data, readErr := io.ReadAll(sock)
	total := len(data)
	var n int
	var prev uint64
	for len(data) > 0 {
		op, payload, rest, ok := nextServerFrame(data)
		if !ok {
			t.Fatalf("after %d whole frames the stream ends inside a frame (%d bytes left: %q…)", n, len(data), head(data))
		}
		switch op {
		case 1: // text
			f, err := brokerframe.Decode(payload)
			if err != nil {
				t.Fatalf("frame %d is not a broker frame (%v): %q…", n, err, head(payload))
			}
			if f.Seq != 0 && f.Seq <= prev {
				t.Fatalf("frame %d: seq %d after %d", n, f.Seq, prev)
			}
			prev = max(prev, f.Seq)
		case 8: // close: nothing may follow it
			if len(rest) != 0 {
				t.Fatalf("%d bytes after the close frame", len(rest))
			}
		case 9, 10: // ping, pong
		default:
			t.Fatalf("frame %d has opcode %d: bytes of one frame inside another (%q…)", n, op, head(data))
		}
		n++
		data = rest
	}
	if readErr != nil && !errors.Is(readErr, syscall.ECONNRESET) {
		t.Fatalf("after %d whole frames (%d bytes) the connection neither ended nor closed: %v", n, total, readErr)
	}
	if n == 0 || prev > seqs[len(seqs)-1] {
		t.Fatalf("%d frames, last seq %d of %d", n, prev, seqs[len(seqs)-1])
	}
}

// dialStalling opens a WebSocket by hand on a socket with a 4 KiB receive
// buffer and returns it right after the 101, with no byte of a frame read.
func dialStalling(t *testing.T, wsURL string) net.Conn {
	t.Helper()
	u, err := url.Parse(wsURL)
	if err != nil {
		t.Fatal(err)
	}
	d := net.Dialer{Control: smallReceiveBuffer}
	sock, err := d.Dial("tcp", u.Host)
	if err != nil {
		t.Fatal(err)
	}
	req := fmt.Sprintf("GET %s HTTP/1.1\r\nHost: %s\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"+
		"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n", u.RequestURI(), u.Host)
	if _, err := sock.Write([]byte(req)); err != nil {
		t.Fatal(err)
	}
	// One byte at a time up to the blank line: no frame byte is consumed.
	var resp bytes.Buffer
	one := make([]byte, 1)
	_ = sock.SetReadDeadline(time.Now().Add(10 * time.Second))
	for !bytes.HasSuffix(resp.Bytes(), []byte("\r\n\r\n")) {
		if _, err := sock.Read(one); err != nil {
			t.Fatalf("reading the handshake answer %q: %v", resp.String(), err)
		}
		resp.WriteByte(one[0])
	}
	r, err := http.ReadResponse(bufio.NewReader(&resp), nil)
	if err != nil || r.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("handshake answer %q: %v", resp.String(), err)
	}
	return sock
}

// nextServerFrame splits one unmasked, unfragmented frame off data.
func nextServerFrame(data []byte) (op byte, payload, rest []byte, ok bool) {
	if len(data) < 2 || data[0]&0x80 == 0 || data[1]&0x80 != 0 {
		return 0, nil, nil, false // short, fragmented or masked: not a server's whole frame
	}
	op, n, off := data[0]&0x0f, uint64(data[1]&0x7f), 2
	switch n {
	case 126:
		if len(data) < 4 {
			return 0, nil, nil, false
		}
		n, off = uint64(binary.BigEndian.Uint16(data[2:])), 4
	case 127:
		if len(data) < 10 {
			return 0, nil, nil, false
		}
		n, off = binary.BigEndian.Uint64(data[2:]), 10
	}
	if uint64(len(data)-off) < n {
		return 0, nil, nil, false
	}
	end := off + int(n)
	return op, data[off:end], data[end:], true
}

func head(b []byte) []byte { return b[:min(len(b), 80)] }

// smallReceiveBuffer is a net.Dialer Control giving the socket a 4 KiB
// receive buffer, too small to hide that its client reads nothing.
func smallReceiveBuffer(_, _ string, c syscall.RawConn) error {
	var serr error
	if err := c.Control(func(fd uintptr) {
		serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096)
	}); err != nil {
		return err
	}
	return serr
}

// dialSmallBuffer opens a client WebSocket whose socket has a 4 KiB receive
// buffer; the test's cleanup closes it.
func dialSmallBuffer(t *testing.T, wsURL string) *websocket.Conn {
	t.Helper()
	d := websocket.Dialer{NetDialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		nd := net.Dialer{Control: smallReceiveBuffer}
		return nd.DialContext(ctx, network, addr)
	}}
	ws, _, err := d.Dial(wsURL, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ws.Close() })
	return ws
}

// writeInput sends an input payload on a raw client WebSocket.
func writeInput(t *testing.T, ws *websocket.Conn, leaseID, content string) {
	t.Helper()
	in, err := brokerframe.Encode(brokerframe.Frame{LeaseID: leaseID, Signal: brokerframe.SignalIO,
		Payload: json.RawMessage(`{"type":"input","content":` + strconv.Quote(content) + `}`)})
	if err != nil {
		t.Fatal(err)
	}
	if err := ws.WriteMessage(websocket.TextMessage, in); err != nil {
		t.Fatal(err)
	}
}
