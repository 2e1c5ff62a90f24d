package e2e

import (
	"fmt"
	"regexp"
	"syscall"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// BenchmarkGatewayRestartReattach: kill -9 the gateway holding K live leases,
// start it again, and time from the new gateway listening until every lease
// is reattached by its instance. The baseline, measured in the same run, is
// the same restart with one lease: the ratio shows what 100 instances
// redialing at once cost over one (both are bounded below by nexus-echo's
// first redial backoff, 250 ms, as upstream's plugin's).
func BenchmarkGatewayRestartReattach(b *testing.B) {
	benchPreflight(b)
	measure := func(k int) time.Duration {
		br := startBroker(b, Options{YAML: "max_concurrent: 0\n"})
		for i := 0; i < k; i++ {
			br.claim(brokerclient.ClaimRequest{})
		}
		br.KillGateway(syscall.SIGKILL)
		br.StartGateway()
		start := time.Now()
		br.GatewayLog.wait(b, regexp.MustCompile(fmt.Sprintf(`(?s)(restored lease reattached by its instance.*){%d}`, k)), 60*time.Second)
		return time.Since(start)
	}
	var hundred, one []time.Duration
	for b.Loop() {
		one = append(one, measure(1))
		hundred = append(hundred, measure(100))
	}
	h, o := pct(hundred, 0.5), pct(one, 0.5)
	b.ReportMetric(float64(h.Microseconds())/1000, "reattach-100-p50-ms")
	b.ReportMetric(float64(o.Microseconds())/1000, "reattach-1-p50-ms")
	b.ReportMetric(float64(h)/float64(o), "ratio-p50")
	b.Logf("gateway restart → 100 leases reattached: p50 %s (one lease: %s, %.2f×; %d runs)", h, o, float64(h)/float64(o), len(hundred))
}
