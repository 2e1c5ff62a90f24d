package gateway

import (
	"io"

	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/metric"
	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/pool"
)

// leaseStates are the states nexus_broker_leases has a series for.
var leaseStates = []string{stateSpawning, stateActive, stateDraining}

// WriteMetrics writes GET /metrics in the Prometheus text format: the
// counters, and the gauges read from live state now.
func (g *Gateway) WriteMetrics(w io.Writer) {
	max, inUse, depth, maxDepth := g.cap.Snapshot()
	gg := metric.Gauges{SlotsInUse: inUse, MaxConcurrent: max, QueueDepth: depth, MaxQueueDepth: maxDepth,
		TicketsOutstanding: g.tickets.Outstanding(), Leases: map[string]int{}, LeaseStates: leaseStates}
	for _, l := range g.Leases("", true) {
		gg.Leases[l.State]++
	}
	if g.rt != nil {
		c := g.rt.Gauges()
		gg.Cluster = &c
	}
	g.m.Write(w, gg)
	pool.WriteMetrics(w, metric.NS, g.pools.m.Stats())
}
