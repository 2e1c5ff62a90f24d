package e2e

import (
	"context"
	"regexp"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// BenchmarkSlotHandoff measures, with max_concurrent: 1 and one claim
// queued behind the holder, the time from POST /release of the holder
// being sent to the queued claim's instance being spawned (the gateway's
// "instance spawned" line reaching this process). It splits that at the
// holder's "lease released" line, which the gateway writes right after it
// frees the slot:
//
//   - teardown: release sent → slot freed. The release waits for the
//     holder's instance to exit, so this is mostly nexus-echo shutting down.
//   - freed-to-spawned: slot freed → queued instance spawned: the handoff
//     itself, minting the lease, and spawnd's Spawn (fork/exec).
//
// As the end-to-end cost of the handoff it also reports how much longer the
// queued claim took to answer once its slot was freed than an uncontended
// claim takes (one uncontended claim per iteration, same broker): any
// excess is what waiting in the queue added. internal/gateway's
// BenchmarkCapacityHandoff measures the bare release → waiter wake-up.
func BenchmarkSlotHandoff(b *testing.B) {
	benchPreflight(b)
	br := startBroker(b, Options{YAML: "max_concurrent: 1\nqueue_wait_timeout: 60s\nidle_timeout: 0s\n"})
	tail := tailLog(b, br.GatewayLog)
	ctx := context.Background()
	claimOne := func() (*brokerclient.Claim, time.Time) {
		c, err := br.Client.Claim(ctx, brokerclient.ClaimRequest{Config: benchConfig})
		if err != nil {
			b.Fatalf("claim: %v", err)
		}
		return c, time.Now()
	}
	release := func(c *brokerclient.Claim) {
		if err := br.Client.Release(ctx, c.LeaseID); err != nil {
			b.Fatalf("release: %v", err)
		}
	}
	type answer struct {
		claim *brokerclient.Claim
		at    time.Time
		err   error
	}

	holder, _ := claimOne() // also the warm-up: see BenchmarkClaim
	var handoff, teardown, freedToSpawned, freedToAnswer, uncontended []time.Duration
	for b.Loop() {
		mark := tail.mark()
		queued := make(chan answer, 1)
		go func() {
			c, err := br.Client.Claim(ctx, brokerclient.ClaimRequest{Config: benchConfig})
			queued <- answer{c, time.Now(), err}
		}()
		br.waitQueueDepth(1, rttDeadline)

		sent := time.Now()
		release(holder)
		var got answer
		select {
		case got = <-queued:
			if got.err != nil {
				b.Fatalf("queued claim: %v", got.err)
			}
		case <-time.After(rttDeadline):
			b.Fatalf("the queued claim was not answered within %s of the release", rttDeadline)
		}
		freed := tail.await(b, mark, regexp.MustCompile(`msg="lease released" lease_id=`+holder.LeaseID))
		spawned := tail.await(b, mark, regexp.MustCompile(`msg="instance spawned" lease_id=`+got.claim.LeaseID))
		handoff = append(handoff, spawned.Sub(sent))
		teardown = append(teardown, freed.Sub(sent))
		freedToSpawned = append(freedToSpawned, spawned.Sub(freed))
		freedToAnswer = append(freedToAnswer, got.at.Sub(freed))

		// The same claim with no queue, as the baseline of freedToAnswer.
		release(got.claim)
		start := time.Now()
		c, at := claimOne()
		uncontended = append(uncontended, at.Sub(start))
		holder = c
	}
	release(holder)

	h50, h99 := pct(handoff, 50), pct(handoff, 99)
	s50, s99 := pct(freedToSpawned, 50), pct(freedToSpawned, 99)
	excess := pct(freedToAnswer, 50) - pct(uncontended, 50)
	b.ReportMetric(ms(h50), "p50-ms")
	b.ReportMetric(ms(h99), "p99-ms")
	b.ReportMetric(ms(pct(teardown, 50)), "teardown-p50-ms")
	b.ReportMetric(ms(s50), "freed-to-spawned-p50-ms")
	b.ReportMetric(ms(s99), "freed-to-spawned-p99-ms")
	b.ReportMetric(ms(pct(freedToAnswer, 50)), "queued-answer-p50-ms")
	b.ReportMetric(ms(pct(uncontended, 50)), "claim-p50-ms")
	b.ReportMetric(ms(excess), "queue-excess-p50-ms")
	verdict(b, "slot handoff < 1 ms (end to end: queued claim's answer after the slot is freed, minus an uncontended claim)", excess < time.Millisecond,
		"excess p50 %.3f ms = %.3f − %.3f ms; release sent → queued instance spawned p50 %.3f ms (p99 %.3f), of which teardown %.3f ms and slot freed → spawned %.3f ms (p99 %.3f); %d samples",
		ms(excess), ms(pct(freedToAnswer, 50)), ms(pct(uncontended, 50)), ms(h50), ms(h99), ms(pct(teardown, 50)), ms(s50), ms(s99), len(handoff))
}
