package e2e

import (
	"errors"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gorilla/websocket"

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

// TestEveryRegistrationIsVerifiedBySpawnd: the gateway asks spawnd about a
// register frame for a lease it has never heard of too, so refusing an
// unknown lease takes the path a wrong secret takes. With spawnd gone, that
// shows as the registration failing to be verified rather than being
// refused at once as unknown.
func TestEveryRegistrationIsVerifiedBySpawnd(t *testing.T) {
	b := startBroker(t, Options{})
	b.KillSpawnd(syscall.SIGKILL)
	b.registerAs(t, "never-minted", strings.Repeat("0", 64))
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="could not verify an instance registration with nexus-spawnd" lease_id=never-minted`), 30*time.Second)
	if strings.Contains(b.GatewayLog.String(), `lease_id=never-minted remote=`+"\\S+"+` error="unknown lease`) {
		t.Fatal("the unknown lease was refused without asking spawnd")
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
