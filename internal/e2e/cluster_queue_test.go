package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// queuedClaim is a claim on a broker whose answer arrives later.
type queuedClaim struct {
	claim *brokerclient.Claim
	err   error
	at    time.Time
}

func claimLater(b *Broker) chan queuedClaim {
	out := make(chan queuedClaim, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		c, err := b.Client.Claim(ctx, brokerclient.ClaimRequest{Config: "engine:\n  name: example\n"})
		out <- queuedClaim{claim: c, err: err, at: time.Now()}
	}()
	return out
}

// waitQueued waits for b's capacity queue to hold n claims.
func (b *Broker) waitQueued(n int) {
	b.t.Helper()
	eventually(b.t, 20*time.Second, func() string { return "queue depth on " + b.Base }, func() bool {
		return b.metrics()["nexus_broker_queue_depth"] == float64(n)
	})
}

func ownerOf(leaseID string) string { return leaseID[strings.LastIndexByte(leaseID, '-')+1:] }

// TestClusterQueuedClaimGoesToAPeerThatFreesASlot: with A, B and C full,
// two claims wait in A's queue; a lease released on C has the oldest
// spawned by C at once, answering through A, while the other keeps
// waiting, and a lease released on B then serves it. Exactly one broker
// spawns each.
func TestClusterQueuedClaimGoesToAPeerThatFreesASlot(t *testing.T) {
	const wait = 30 * time.Second
	_, bs := startCluster(t, "max_concurrent: 1\nqueue_wait_timeout: 30s\n", "", "a", "b", "c")
	a, b, c := bs["a"], bs["b"], bs["c"]
	a.claim(brokerclient.ClaimRequest{})
	onB := b.claim(brokerclient.ClaimRequest{})
	onC := c.claim(brokerclient.ClaimRequest{})
	first := claimLater(a)
	a.waitQueued(1)
	second := claimLater(a)
	a.waitQueued(2)

	released := time.Now()
	if st, body := a.do("POST", "/release/"+onC.LeaseID, ""); st != 200 {
		t.Fatalf("release of C's lease through A = %d %s", st, body)
	}
	got := <-first
	if got.err != nil {
		t.Fatalf("the oldest queued claim after C freed a slot: %v", got.err)
	}
	if took := got.at.Sub(released); ownerOf(got.claim.LeaseID) != "c" || took > wait/3 {
		t.Fatalf("the oldest queued claim was served by %q %s after C's release; want c, well before queue_wait_timeout (%s)",
			ownerOf(got.claim.LeaseID), took, wait)
	}
	conn := dialVia(t, a, got.claim.LeaseID, brokerclient.DialOptions{})
	if reply := say(t, conn, "requeued"); reply != "echo #1: requeued" {
		t.Fatalf("the re-offered claim through A answered %q", reply)
	}
	select {
	case g := <-second:
		t.Fatalf("the second queued claim was answered (%v, %+v) before any other slot freed", g.err, g.claim)
	default:
	}
	a.waitQueued(1)
	if n := [3]int{len(a.Instances()), len(b.Instances()), len(c.Instances())}; n != [3]int{1, 1, 1} {
		t.Fatalf("instances on a, b, c = %v, want one each", n)
	}

	if st, body := c.do("POST", "/release/"+onB.LeaseID, ""); st != 200 {
		t.Fatalf("release of B's lease through C = %d %s", st, body)
	}
	got = <-second
	if got.err != nil || ownerOf(got.claim.LeaseID) != "b" {
		t.Fatalf("the second queued claim after B freed a slot: %v %+v, want a lease on b", got.err, got.claim)
	}
	a.waitQueued(0)
	if n := [3]int{len(a.Instances()), len(b.Instances()), len(c.Instances())}; n != [3]int{1, 1, 1} {
		t.Fatalf("instances on a, b, c = %v, want one each", n)
	}
}
