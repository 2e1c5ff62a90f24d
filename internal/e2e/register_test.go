package e2e

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// registerAs dials /instance and sends one register frame, returning the
// socket.
func (b *Broker) registerAs(t *testing.T, leaseID, secret string) *websocket.Conn {
	t.Helper()
	ws, _, err := websocket.DefaultDialer.Dial("ws://"+b.Addr+"/instance", nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ws.Close() })
	reg, _ := brokerframe.Encode(brokerframe.Frame{LeaseID: leaseID, Signal: brokerframe.SignalRegister, Secret: secret})
	if err := ws.WriteMessage(websocket.TextMessage, reg); err != nil {
		t.Fatal(err)
	}
	return ws
}

// registerBytes sends one register frame on a WebSocket of its own making
// (a fixed handshake key and mask, so that two dials send the same bytes)
// and returns every byte the gateway answered until it hung up: the
// upgrade and the close frame.
func (b *Broker) registerBytes(t *testing.T, leaseID, secret string) []byte {
	t.Helper()
	c, err := net.Dial("tcp", b.Addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	reg, _ := brokerframe.Encode(brokerframe.Frame{LeaseID: leaseID, Signal: brokerframe.SignalRegister, Secret: secret})
	mask := [4]byte{1, 2, 3, 4}
	frame := []byte{0x81} // FIN, text
	switch n := len(reg); {
	case n < 126:
		frame = append(frame, 0x80|byte(n))
	default:
		frame = append(frame, 0x80|126, byte(n>>8), byte(n))
	}
	frame = append(frame, mask[:]...)
	for i, c := range reg {
		frame = append(frame, c^mask[i%4])
	}
	req := "GET /instance HTTP/1.1\r\nHost: " + b.Addr + "\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n" +
		"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
	if _, err := io.WriteString(c, req); err != nil {
		t.Fatal(err)
	}
	// The frame goes once the upgrade is answered, as a client's would.
	r := bufio.NewReader(c)
	var data []byte
	for !bytes.HasSuffix(data, []byte("\r\n\r\n")) {
		line, err := r.ReadBytes('\n')
		data = append(data, line...)
		if err != nil {
			t.Fatalf("register as %s: the upgrade: %v after %q", leaseID, err, data)
		}
	}
	if _, err := c.Write(frame); err != nil {
		t.Fatal(err)
	}
	rest, err := io.ReadAll(r)
	if err != nil && !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("register as %s: %v after %q", leaseID, err, rest)
	}
	return append(data, rest...)
}

// sameRefusals registers as each case (a lease id and a secret) and fails
// unless the gateway answered every one with the same bytes: the upgrade,
// then close 1008 "unknown lease".
func (b *Broker) sameRefusals(t *testing.T, cases map[string][2]string) {
	t.Helper()
	var first []byte
	var firstName string
	for name, c := range cases {
		got := b.registerBytes(t, c[0], c[1])
		if !bytes.HasPrefix(got, []byte("HTTP/1.1 101 ")) || !bytes.HasSuffix(got, append([]byte{0x88, byte(2 + len("unknown lease")), 0x03, 0xf0}, "unknown lease"...)) {
			t.Fatalf("%s: the gateway answered %q, want the upgrade, then close 1008 \"unknown lease\"", name, got)
		}
		if first == nil {
			first, firstName = got, name
		} else if !bytes.Equal(got, first) {
			t.Fatalf("%s answered %q, %s %q: a dialer tells them apart", name, got, firstName, first)
		}
	}
}

// TestRefusedRegistrationsAreByteIdentical: a wrong secret for a live lease,
// no secret, and a lease id nobody holds (of the same length, and of
// another) get the same bytes from the gateway, while its log tells them
// apart. The gateway checks the secret against the verifier spawnd handed
// it at Spawn, so the answers stay the same with spawnd frozen: no
// registration waits for it.
func TestRefusedRegistrationsAreByteIdentical(t *testing.T) {
	b := startBroker(t, Options{})
	live := b.claim(brokerclient.ClaimRequest{}).LeaseID
	wrong := strings.Repeat("0", 64)
	cases := map[string][2]string{
		"wrong secret":                   {live, wrong},
		"no secret":                      {live, ""},
		"unknown lease":                  {strings.Repeat("x", len(live)), wrong},
		"unknown lease, shorter id":      {"never-minted", wrong},
		"unknown lease, the live's tail": {live[:len(live)-1] + "0", wrong},
	}
	b.sameRefusals(t, cases)
	for _, want := range []string{
		`msg="rejecting instance registration: its register frame carried the WRONG spawn secret. This broker did not spawn the process that dialed back" lease_id=` + live,
		`msg="rejecting instance registration: its register frame carried NO spawn secret`,
		`msg="rejecting instance registration" lease_id=never-minted remote=\S+ error="unknown lease: no live lease has this id`,
	} {
		b.GatewayLog.wait(t, regexp.MustCompile(want), 5*time.Second)
	}

	spawnd := b.spawnd.cmd.Process.Pid
	signal(t, spawnd, syscall.SIGSTOP)
	t.Cleanup(func() { _ = syscall.Kill(spawnd, syscall.SIGCONT) })
	b.sameRefusals(t, cases)
}

// TestRestoredLeaseRegistrationsAreChecked: after a kill -9 of the gateway,
// the next one restores the lease with the verifier List answers, so the
// lease's own instance reattaches (with spawnd frozen by then: the check is
// the gateway's alone), and a wrong secret for the restored lease gets the
// bytes a lease id nobody holds gets.
func TestRestoredLeaseRegistrationsAreChecked(t *testing.T) {
	b := startBroker(t, Options{StateDir: true})
	c := b.claim(brokerclient.ClaimRequest{})
	pids := b.Instances()
	if len(pids) != 1 {
		t.Fatalf("instances %v, want one", pids)
	}
	// Frozen, the instance cannot redial before spawnd is frozen too.
	signal(t, pids[0], syscall.SIGSTOP)
	t.Cleanup(func() { _ = syscall.Kill(pids[0], syscall.SIGCONT) })
	b.KillGateway(syscall.SIGKILL)
	b.StartGateway()
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="restored lease from the journal; awaiting instance reattach" lease_id=`+c.LeaseID), 10*time.Second)
	spawnd := b.spawnd.cmd.Process.Pid
	signal(t, spawnd, syscall.SIGSTOP)
	t.Cleanup(func() { _ = syscall.Kill(spawnd, syscall.SIGCONT) })

	wrong := strings.Repeat("0", 64)
	b.sameRefusals(t, map[string][2]string{
		"wrong secret for the restored lease": {c.LeaseID, wrong},
		"unknown lease":                       {strings.Repeat("x", len(c.LeaseID)), wrong},
	})
	signal(t, pids[0], syscall.SIGCONT)
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="restored lease reattached by its instance" lease_id=`+c.LeaseID), 20*time.Second)
	signal(t, spawnd, syscall.SIGCONT)
	conn := b.dial(c, brokerclient.DialOptions{})
	if got := say(t, conn, "after"); !strings.HasPrefix(got, "echo #1: after") {
		t.Fatalf("the reattached instance answered %q", got)
	}
}

// TestOversizeRegisterFrameIsRefusedEarly: until its secret is verified a
// dialer may send one small frame; a 16 MiB one is refused from its header
// (close 1009) instead of being read and buffered whole.
func TestOversizeRegisterFrameIsRefusedEarly(t *testing.T) {
	b := startBroker(t, Options{})
	ws, _, err := websocket.DefaultDialer.Dial("ws://"+b.Addr+"/instance", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer ws.Close()
	go func() { _ = ws.WriteMessage(websocket.TextMessage, make([]byte, 16<<20)) }()
	_, _, err = ws.ReadMessage()
	var ce *websocket.CloseError
	if !errors.As(err, &ce) || ce.Code != websocket.CloseMessageTooBig {
		t.Fatalf("a 16 MiB register frame got %v, want close 1009 (message too big)", err)
	}
}

// TestMalformedDialBacksAreClosedAndLogged: a dial-back whose first frame is
// not a register frame is closed with 1008 and the reason the wire-facts
// name, and the broker's WARN says what it got.
func TestMalformedDialBacksAreClosedAndLogged(t *testing.T) {
	b := startBroker(t, Options{})
	ready, _ := brokerframe.Encode(brokerframe.Frame{LeaseID: "x", Signal: brokerframe.SignalReady})
	for _, c := range []struct {
		first       []byte
		close, warn string
	}{
		{[]byte("not a frame"), "invalid register frame", `level=WARN msg="instance sent undecodable first frame" remote=\S+ error=`},
		{ready, "expected register frame", `level=WARN msg="instance first frame was not register" remote=\S+ signal=ready`},
	} {
		ws, _, err := websocket.DefaultDialer.Dial("ws://"+b.Addr+"/instance", nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := ws.WriteMessage(websocket.TextMessage, c.first); err != nil {
			t.Fatal(err)
		}
		_, _, err = ws.ReadMessage()
		var ce *websocket.CloseError
		if !errors.As(err, &ce) || ce.Code != websocket.ClosePolicyViolation || ce.Text != c.close {
			t.Errorf("first frame %q: got %v, want close 1008 %q", c.first, err, c.close)
		}
		ws.Close()
		b.GatewayLog.wait(t, regexp.MustCompile(c.warn), 5*time.Second)
	}
	// A dialer that hangs up before registering.
	ws, _, err := websocket.DefaultDialer.Dial("ws://"+b.Addr+"/instance", nil)
	if err != nil {
		t.Fatal(err)
	}
	ws.Close()
	b.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="instance closed before register frame" remote=\S+ error=`), 5*time.Second)
}
