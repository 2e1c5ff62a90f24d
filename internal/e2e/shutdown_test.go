package e2e

import (
	"path/filepath"
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

// TestASpawndKilledHoldingNoLeaseLeavesNoTempDir: the empty temp-config
// directory a spawnd killed with -9 leaves is removed by the next one.
func TestASpawndKilledHoldingNoLeaseLeavesNoTempDir(t *testing.T) {
	b := startBroker(t, Options{StateDir: true})
	b.KillSpawnd(syscall.SIGKILL)
	before, _ := filepath.Glob(filepath.Join(b.Tmp, "nexus-spawnd-*"))
	if len(before) != 1 {
		t.Fatalf("temp directories after kill -9: %v", before)
	}
	b.StartSpawnd()
	after, _ := filepath.Glob(filepath.Join(b.Tmp, "nexus-spawnd-*"))
	if len(after) != 1 || after[0] == before[0] {
		t.Fatalf("temp directories: %v before the restart, %v after; want only the new spawnd's", before, after)
	}
}
