package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// BenchmarkClusterRelay: one lease on broker a, its WebSocket opened on a
// (direct to the owner) and, for a second lease, on b (relayed over NATS),
// measured in the same run: round trip, and pipelined throughput.
func BenchmarkClusterRelay(b *testing.B) {
	benchPreflight(b)
	_, bs := startCluster(b, "idle_timeout: 0s\n", "", "a", "b")
	owner, entry := bs["a"], bs["b"]
	direct := dialBench(b, wsVia(owner, owner.claim(brokerclient.ClaimRequest{Config: benchConfig}).LeaseID))
	relayed := dialBench(b, wsVia(entry, owner.claim(brokerclient.ClaimRequest{Config: benchConfig}).LeaseID))
	var d, r []time.Duration
	for n := 0; b.Loop(); n++ {
		dt, err := clientRoundTrip(direct, n)
		if err != nil {
			b.Fatalf("direct to the owner: %v", err)
		}
		rt, err := clientRoundTrip(relayed, n)
		if err != nil {
			b.Fatalf("through a non-owner: %v", err)
		}
		d, r = append(d, dt), append(r, rt)
	}
	b.ReportMetric(ms(pct(d, 50)), "owner-p50-ms")
	b.ReportMetric(ms(pct(r, 50)), "non-owner-p50-ms")
	b.ReportMetric(ms(pct(r, 99)), "non-owner-p99-ms")
	b.ReportMetric(float64(pct(r, 50))/float64(pct(d, 50)), "rtt-ratio")

	const frames = 2000
	td := pump(b, []*brokerclient.Conn{direct}, frames)
	tr := pump(b, []*brokerclient.Conn{relayed}, frames)
	b.ReportMetric(frames/td.Seconds(), "owner-frames/s")
	b.ReportMetric(frames/tr.Seconds(), "non-owner-frames/s")
	b.ReportMetric(td.Seconds()/tr.Seconds(), "throughput-ratio")
}

// BenchmarkClusterSpilledClaim: claim latency on a broker with a free slot
// next to a claim on a full broker that a peer spawns, in the same run.
func BenchmarkClusterSpilledClaim(b *testing.B) {
	benchPreflight(b)
	_, bs := startCluster(b, "max_concurrent: 1\nidle_timeout: 0s\nrelease_grace: 1s\n", "", "a", "b")
	full, free := bs["a"], bs["b"]
	full.claim(brokerclient.ClaimRequest{Config: benchConfig})
	timed := func(on *Broker) time.Duration {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		start := time.Now()
		c, err := on.Client.Claim(ctx, brokerclient.ClaimRequest{Config: benchConfig})
		d := time.Since(start)
		if err != nil {
			b.Fatalf("claim on %s: %v", on.Base, err)
		}
		if err := on.Client.Release(ctx, c.LeaseID); err != nil {
			b.Fatal(err)
		}
		eventually(b, 30*time.Second, func() string { return "the released slot back" }, func() bool { return free.metrics()["nexus_broker_slots_in_use"] == 0 })
		return d
	}
	var local, spilled []time.Duration
	for b.Loop() {
		local = append(local, timed(free))
		spilled = append(spilled, timed(full))
	}
	b.ReportMetric(ms(pct(local, 50)), "local-claim-p50-ms")
	b.ReportMetric(ms(pct(spilled, 50)), "spilled-claim-p50-ms")
	b.ReportMetric(float64(pct(spilled, 50))/float64(pct(local, 50)), "spilled-ratio")
}
