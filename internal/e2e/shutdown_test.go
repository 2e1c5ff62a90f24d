package e2e

import (
	"regexp"
	"syscall"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// TestAGatewaySIGTERMSaysTheLeaseLivesOn: a gateway stopping on SIGTERM
// closes its clients with 1001, not saying the lease closed (it lives on)
// but telling them to reconnect with from_seq; they do, to the lease.
func TestAGatewaySIGTERMSaysTheLeaseLivesOn(t *testing.T) {
	b := startBroker(t, Options{StateDir: true})
	claim := b.claim(brokerclient.ClaimRequest{})
	conn := b.dial(claim, brokerclient.DialOptions{})
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="client connected" lease_id=`+claim.LeaseID), 10*time.Second)
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		b.KillGateway(syscall.SIGTERM)
	}()
	code, text := closeCode(t, conn)
	<-stopped
	if code != 1001 || text != "broker restarting; reconnect with from_seq" {
		t.Fatalf("a client of a lease that lives on closed with %d %q at SIGTERM, want 1001 \"broker restarting; reconnect with from_seq\"", code, text)
	}
	b.StartGateway()
	b.waitStates([]string{claim.LeaseID}, "active", 20*time.Second)
	from := conn.LastSeq
	if got := say(t, b.dial(claim, brokerclient.DialOptions{FromSeq: &from}), "back"); got == "" {
		t.Fatal("no answer after reconnecting")
	}
}
