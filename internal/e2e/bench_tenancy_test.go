package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// BenchmarkSandboxedClaim is what sandbox: strict adds to a claim: two
// brokers with tenancy:, one with sandbox: none (its baseline: the same
// uid drop and home, no bubblewrap) and one with strict, claimed and
// released alternately by one principal in one run.
func BenchmarkSandboxedClaim(b *testing.B) {
	benchPreflight(b)
	hosts := []struct {
		name string
		h    *tenantHost
	}{
		{"none-", startTenantHost(b, "none", uidRange(40, 49))},
		{"strict-", startTenantHost(b, "strict", uidRange(50, 59))},
	}
	ctx := context.Background()
	claimOnce := func(h *tenantHost) time.Duration {
		cl := h.as(tokAlice)
		start := time.Now()
		c, err := cl.Claim(ctx, brokerclient.ClaimRequest{Config: benchConfig})
		d := time.Since(start)
		if err != nil {
			b.Fatalf("claim: %v", err)
		}
		if err := cl.Release(ctx, c.LeaseID); err != nil {
			b.Fatalf("release: %v", err)
		}
		return d
	}
	for _, x := range hosts { // the first claim allocates alice's uid and home
		claimOnce(x.h)
	}
	claims := make([][]time.Duration, len(hosts))
	for i := 0; b.Loop(); i++ {
		for k := range hosts {
			k := (i + k) % len(hosts) // neither always first
			claims[k] = append(claims[k], claimOnce(hosts[k].h))
		}
	}
	for k, x := range hosts {
		b.ReportMetric(ms(pct(claims[k], 50)), x.name+"p50-ms")
		b.ReportMetric(ms(pct(claims[k], 99)), x.name+"p99-ms")
	}
	over := pct(claims[1], 50) - pct(claims[0], 50)
	b.ReportMetric(ms(over), "strict-overhead-p50-ms")
	verdict(b, "a claim under sandbox: strict costs ≤ 15 ms more than without, at p50", over <= 15*time.Millisecond,
		"strict p50 %.3f ms − none p50 %.3f ms = %.3f ms; %d samples each", ms(pct(claims[1], 50)), ms(pct(claims[0], 50)), ms(over), len(claims[0]))
}
