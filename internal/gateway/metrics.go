package gateway

import (
	"fmt"
	"io"
	"math"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/pool"
)

// Label values of the wire contract's fixed sets. A series exists for every
// value from the first scrape, so an alert can be written before the event
// it watches for has ever happened.
var (
	claimOutcomes = []string{"accepted", "rejected", "no_capacity", "queue_timeout", "queue_full",
		"principal_lease_limit", "principal_queue_limit", "cancelled", "spawn_failed", "ready_timeout", "internal", "journal_unavailable", outcomeBrokerDraining}
	spawnFailureReasons = []string{"exec", "exited_before_ready", "ready_timeout"}
	// client_control is ours: a client-sent control signal (shutdown,
	// register, …) is dropped rather than forwarded to the instance.
	dropReasons = []string{"undecodable", "lease_mismatch", "no_instance", "instance_buffer_full",
		"client_buffer_full", "lease_gone", "client_control"}
	gapReasons      = []string{"evicted", "restarted"}
	reloadOutcomes  = []string{"applied", "rejected"}
	restoreOutcomes = []string{"restored", "reattached", "reaped"}
	leaseStates     = []string{stateSpawning, stateActive, stateDraining}
)

// claimBuckets are the claim_duration_seconds upper bounds: a claim is a
// process boot, so milliseconds to the ready_timeout scale.
var claimBuckets = []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}

// counterVec is a counter per label value of one fixed set.
type counterVec struct {
	label  string
	values map[string]*atomic.Uint64
	order  []string
}

func newCounterVec(label string, values []string) *counterVec {
	v := &counterVec{label: label, values: map[string]*atomic.Uint64{}, order: values}
	for _, s := range values {
		v.values[s] = new(atomic.Uint64)
	}
	return v
}

// inc counts one event; a value outside the set is a programming error and
// panics in tests rather than silently growing the series set.
func (v *counterVec) inc(value string) {
	v.add(value, 1)
}

func (v *counterVec) add(value string, n uint64) {
	c, ok := v.values[value]
	if !ok {
		panic(fmt.Sprintf("metrics: %q is not a %s value", value, v.label))
	}
	c.Add(n)
}

func (v *counterVec) get(value string) uint64 { return v.values[value].Load() }

// histogram is a fixed-bucket histogram.
type histogram struct {
	mu     sync.Mutex
	counts []uint64 // per bucket, plus +Inf
	sum    float64
	n      uint64
}

func (h *histogram) observe(d time.Duration) {
	s := d.Seconds()
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.counts == nil {
		h.counts = make([]uint64, len(claimBuckets)+1)
	}
	i := sort.SearchFloat64s(claimBuckets, s)
	h.counts[i]++
	h.sum += s
	h.n++
}

// metrics holds every counter of GET /metrics; gauges are read from live
// state at scrape time so they cannot drift from it.
type metrics struct {
	claims          *counterVec
	claimDuration   histogram
	spawnFailures   *counterVec
	framesDropped   *counterVec
	replayGaps      *counterVec
	clientEvictions atomic.Uint64
	configReloads   *counterVec
	restoredLeases  *counterVec
}

func newMetrics() *metrics {
	return &metrics{
		claims:         newCounterVec("outcome", claimOutcomes),
		spawnFailures:  newCounterVec("reason", spawnFailureReasons),
		framesDropped:  newCounterVec("reason", dropReasons),
		replayGaps:     newCounterVec("reason", gapReasons),
		configReloads:  newCounterVec("outcome", reloadOutcomes),
		restoredLeases: newCounterVec("outcome", restoreOutcomes),
	}
}

// gauges are the scrape-time values.
type gauges struct {
	slotsInUse, maxConcurrent, queueDepth, maxQueueDepth, ticketsOutstanding int
	leases                                                                   map[string]int
	// cluster is nil in single-broker mode, whose /metrics stays as it was.
	cluster *ClusterGauges
	// pools are the pools in force; none, and no pool family is written.
	pools []pool.Stat
}

const ns = "nexus_broker_"

// WriteMetrics writes GET /metrics in the Prometheus text format: the
// counters, and the gauges read from live state now.
func (g *Gateway) WriteMetrics(w io.Writer) {
	max, inUse, depth, maxDepth := g.cap.Snapshot()
	gg := gauges{slotsInUse: inUse, maxConcurrent: max, queueDepth: depth, maxQueueDepth: maxDepth,
		ticketsOutstanding: g.tickets.Outstanding(), leases: map[string]int{}}
	for _, l := range g.Leases("", true) {
		gg.leases[l.State]++
	}
	if g.rt != nil {
		c := g.rt.Gauges()
		gg.cluster = &c
	}
	gg.pools = g.pools.m.Stats()
	g.m.write(w, gg)
}

func (m *metrics) write(w io.Writer, g gauges) {
	vec := func(name, help string, v *counterVec) {
		fmt.Fprintf(w, "# HELP %s%s %s\n# TYPE %s%s counter\n", ns, name, help, ns, name)
		for _, val := range v.order {
			fmt.Fprintf(w, "%s%s{%s=%q} %d\n", ns, name, v.label, val, v.get(val))
		}
	}
	gauge := func(name, help string, val int) {
		fmt.Fprintf(w, "# HELP %s%s %s\n# TYPE %s%s gauge\n%s%s %d\n", ns, name, help, ns, name, ns, name, val)
	}
	vec("claims_total", "Instance claims handled by the shared spawn spine, by outcome. Covers POST /claim and the A2A ingress.", m.claims)

	m.claimDuration.mu.Lock()
	counts := append([]uint64(nil), m.claimDuration.counts...)
	if counts == nil {
		counts = make([]uint64, len(claimBuckets)+1)
	}
	sum, n := m.claimDuration.sum, m.claimDuration.n
	m.claimDuration.mu.Unlock()
	fmt.Fprintf(w, "# HELP %sclaim_duration_seconds Wall time of an ACCEPTED claim, from request to a ready instance.\n# TYPE %sclaim_duration_seconds histogram\n", ns, ns)
	var cum uint64
	for i, le := range claimBuckets {
		cum += counts[i]
		fmt.Fprintf(w, "%sclaim_duration_seconds_bucket{le=%q} %d\n", ns, formatFloat(le), cum)
	}
	cum += counts[len(claimBuckets)]
	fmt.Fprintf(w, "%sclaim_duration_seconds_bucket{le=\"+Inf\"} %d\n", ns, cum)
	fmt.Fprintf(w, "%sclaim_duration_seconds_sum %s\n%sclaim_duration_seconds_count %d\n", ns, formatFloat(sum), ns, n)

	vec("spawn_failures_total", "Instance spawns that produced no ready instance, by reason.", m.spawnFailures)
	vec("frames_dropped_total", "Broker frames discarded rather than relayed, by reason.", m.framesDropped)
	vec("replay_gaps_total", "Stream-gap notices served to a resuming client, by reason.", m.replayGaps)
	fmt.Fprintf(w, "# HELP %sclient_evictions_total Client WebSockets displaced by a newer connection on the same lease.\n# TYPE %sclient_evictions_total counter\n%sclient_evictions_total %d\n", ns, ns, ns, m.clientEvictions.Load())
	vec("config_reloads_total", "SIGHUP configuration reloads, by outcome.", m.configReloads)
	vec("restored_leases_total", "Leases adopted from the journal at boot, and what became of them.", m.restoredLeases)
	gauge("slots_in_use", "Capacity slots currently held: one per live lease.", g.slotsInUse)
	gauge("max_concurrent", "Configured max_concurrent ceiling. 0 means unlimited.", g.maxConcurrent)
	gauge("queue_depth", "Claims currently parked in the FIFO capacity queue.", g.queueDepth)
	gauge("max_queue_depth", "Configured max_queue_depth ceiling on parked claims. 0 means unlimited.", g.maxQueueDepth)
	fmt.Fprintf(w, "# HELP %sleases Live leases by operator-facing state.\n# TYPE %sleases gauge\n", ns, ns)
	for _, s := range leaseStates {
		fmt.Fprintf(w, "%sleases{state=%q} %d\n", ns, s, g.leases[s])
	}
	gauge("tickets_outstanding", "Issued, unredeemed WebSocket tickets the broker still holds.", g.ticketsOutstanding)
	if c := g.cluster; c != nil {
		gauge("cluster_peers_reachable", "Other brokers whose heartbeat is current.", c.PeersReachable)
		gauge("cluster_nats_failures", "Consecutive failed NATS connection attempts (3 or more: an ERROR line).", c.NATSFailures)
		name := "cluster_messages_refused_total"
		fmt.Fprintf(w, "# HELP %s%s Cluster messages refused: not sealed with the cluster secret (seal), stale, replayed, or arrived after its caller's deadline (late).\n# TYPE %s%s counter\n", ns, name, ns, name)
		for _, r := range c.Refused {
			fmt.Fprintf(w, "%s%s{reason=%q} %d\n", ns, name, r.Reason, r.N)
		}
	}
	pool.WriteMetrics(w, ns, g.pools)
}

func formatFloat(f float64) string {
	if f == math.Trunc(f) && math.Abs(f) < 1e15 {
		return fmt.Sprintf("%.0f", f)
	}
	return fmt.Sprintf("%g", f)
}
