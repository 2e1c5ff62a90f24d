package pool

import (
	"fmt"
	"io"
)

// WriteMetrics writes the warm pools' /metrics families (the broker's own,
// each name after prefix ns) in the Prometheus text format: every pool of
// stats at 0 from the first scrape, labelled by its name; with no pool in
// force, nothing.
func WriteMetrics(w io.Writer, ns string, stats []Stat) {
	family := func(name, typ, help string, series func(s Stat)) {
		fmt.Fprintf(w, "# HELP %s%s %s\n# TYPE %s%s %s\n", ns, name, help, ns, name, typ)
		for _, s := range stats {
			series(s)
		}
	}
	if len(stats) == 0 {
		return
	}
	family("pool_idle", "gauge", "Warm instances ready and unclaimed, by pool.", func(s Stat) {
		fmt.Fprintf(w, "%spool_idle{pool=%q} %d\n", ns, s.Name, s.Idle)
	})
	family("pool_claims_total", "counter", "Claims naming a pool's binary and config, served warm (hit) or cold (miss), by pool.", func(s Stat) {
		fmt.Fprintf(w, "%spool_claims_total{pool=%q,outcome=\"hit\"} %d\n%spool_claims_total{pool=%q,outcome=\"miss\"} %d\n", ns, s.Name, s.Hits, ns, s.Name, s.Misses)
	})
	family("pool_refill_failures_total", "counter", "Warm instances that failed to boot, by pool.", func(s Stat) {
		fmt.Fprintf(w, "%spool_refill_failures_total{pool=%q} %d\n", ns, s.Name, s.RefillFailures)
	})
}
