package e2e

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// BenchmarkClusterRelay: one lease on broker a, its WebSocket opened on a
// (direct to the owner) and, for a second lease, on b (relayed over NATS),
// measured in the same run: round trip, and pipelined throughput. With
// NEXUS_BENCH_BASE_BIN the base build's pair of brokers runs beside, on a
// nats-server of its own, and its round trips (base-…) are measured in the
// same loop, turn about: sealing-added-p50-ms is this build's non-owner
// p50 less the base build's.
func BenchmarkClusterRelay(b *testing.B) {
	benchPreflight(b)
	type pair struct{ direct, relayed *brokerclient.Conn }
	start := func(binDir string) pair {
		ns := startNATS(b, 0, nil)
		bs := startMembers(b, openMember(ns.ClientURL()), Options{YAML: "idle_timeout: 0s\n", BinDir: binDir}, "a", "b")
		owner, entry := bs["a"], bs["b"]
		return pair{dialBench(b, wsVia(owner, owner.claim(brokerclient.ClaimRequest{Config: benchConfig}).LeaseID)),
			dialBench(b, wsVia(entry, owner.claim(brokerclient.ClaimRequest{Config: benchConfig}).LeaseID))}
	}
	pairs := map[string]pair{"": start("")}
	if dir := os.Getenv(BaseBinEnv); dir != "" {
		pairs["base-"] = start(dir)
	}
	d, r := map[string][]time.Duration{}, map[string][]time.Duration{}
	for n := 0; b.Loop(); n++ {
		for prefix, p := range pairs {
			dt, err := clientRoundTrip(p.direct, n)
			if err != nil {
				b.Fatalf("%sdirect to the owner: %v", prefix, err)
			}
			rt, err := clientRoundTrip(p.relayed, n)
			if err != nil {
				b.Fatalf("%sthrough a non-owner: %v", prefix, err)
			}
			d[prefix], r[prefix] = append(d[prefix], dt), append(r[prefix], rt)
		}
	}
	for prefix := range pairs {
		b.ReportMetric(ms(pct(d[prefix], 50)), prefix+"owner-p50-ms")
		b.ReportMetric(ms(pct(r[prefix], 50)), prefix+"non-owner-p50-ms")
		b.ReportMetric(ms(pct(r[prefix], 99)), prefix+"non-owner-p99-ms")
		b.ReportMetric(float64(pct(r[prefix], 50))/float64(pct(d[prefix], 50)), prefix+"rtt-ratio")
	}
	if _, ok := pairs["base-"]; ok {
		b.ReportMetric(ms(pct(r[""], 50)-pct(r["base-"], 50)), "sealing-added-p50-ms")
	}

	const frames = 2000
	for prefix, p := range pairs {
		td := pump(b, []*brokerclient.Conn{p.direct}, frames)
		tr := pump(b, []*brokerclient.Conn{p.relayed}, frames)
		b.ReportMetric(frames/td.Seconds(), prefix+"owner-frames/s")
		b.ReportMetric(frames/tr.Seconds(), prefix+"non-owner-frames/s")
		b.ReportMetric(td.Seconds()/tr.Seconds(), prefix+"throughput-ratio")
	}
}

// BenchmarkClusterSpilledClaim: claim latency on a broker with a free slot
// next to a claim on a full broker that a peer spawns, in the same run;
// the target is spilled-minus-local-p50-ms at most 2.
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
	// The target: a spilled claim within 2 ms of a local one.
	b.ReportMetric(ms(pct(spilled, 50)-pct(local, 50)), "spilled-minus-local-p50-ms")
}
