package e2e

import (
	"errors"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// TestAnIdleLeaseIsPingedOnTimeAndItsCloseArrives: the gateway holds data
// frames for a combined write but never a control frame. An idle client
// gets every liveness ping on its interval, after a burst as before it,
// and a release's close frame reaches it with its code and reason.
func TestAnIdleLeaseIsPingedOnTimeAndItsCloseArrives(t *testing.T) {
	const interval = 200 * time.Millisecond
	b := startBroker(t, Options{GatewayEnv: []string{"NEXUS_BROKER_TEST_LIVENESS=200ms,10s"}})
	claim := b.claim(brokerclient.ClaimRequest{})
	conn := b.dial(claim, brokerclient.DialOptions{})
	// A burst first: its frames go out combined, and the pings after it
	// must not wait behind anything.
	for i := range 3 {
		if got := say(t, conn, "burst"); got == "" {
			t.Fatalf("answer %d is empty", i)
		}
	}
	const want = 5
	pings := make(chan time.Time, want)
	conn.Underlying().SetPingHandler(func(string) error {
		select {
		case pings <- time.Now():
		default:
		}
		return nil
	})
	// Pings are handled inside reads: read until the socket ends.
	ended := make(chan error, 1)
	go func() {
		_ = conn.Underlying().SetReadDeadline(time.Now().Add(60 * time.Second))
		for {
			if _, err := conn.Next(); err != nil {
				ended <- err
				return
			}
		}
	}()
	timeout := time.After(30 * time.Second)
	var last time.Time
	for i := range want {
		select {
		case at := <-pings:
			// The interval plus a wide margin for a loaded machine: a
			// ping held behind data until the next flush would wait for
			// traffic that an idle lease never has.
			if i > 0 && at.Sub(last) > interval+time.Second {
				t.Fatalf("ping %d came %s after the one before, want about %s", i, at.Sub(last), interval)
			}
			last = at
		case err := <-ended:
			t.Fatalf("the socket ended after %d pings: %v", i, err)
		case <-timeout:
			t.Fatalf("%d pings in 30 s on a %s interval", i, interval)
		}
	}
	if code, _ := b.do("POST", "/release/"+claim.LeaseID, ""); code != 200 {
		t.Fatalf("release: %d", code)
	}
	select {
	case err := <-ended:
		var ce *websocket.CloseError
		if !errors.As(err, &ce) || ce.Code != 1001 || ce.Text != "lease closed" {
			t.Fatalf("the socket ended with %v, want close 1001 \"lease closed\"", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("no close frame within 30 s of the release")
	}
}
