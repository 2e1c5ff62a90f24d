package metric

import (
	"fmt"
	"io"
	"sync/atomic"
)

// Label values of the wire contract's fixed sets. A series exists for every
// value from the first scrape, so an alert can be written before the event
// it watches for has ever happened.
var (
	claimOutcomes = []string{"accepted", "rejected", "no_capacity", "queue_timeout", "queue_full",
		"principal_lease_limit", "principal_queue_limit", "cancelled", "spawn_failed", "ready_timeout", "internal", "journal_unavailable", "broker_draining"}
	spawnFailureReasons = []string{"exec", "exited_before_ready", "ready_timeout"}
	// client_control is ours: a client-sent control signal (shutdown,
	// register, …) is dropped rather than forwarded to the instance.
	dropReasons = []string{"undecodable", "lease_mismatch", "no_instance", "instance_buffer_full",
		"client_buffer_full", "lease_gone", "client_control"}
	gapReasons      = []string{"evicted", "restarted"}
	reloadOutcomes  = []string{"applied", "rejected"}
	restoreOutcomes = []string{"restored", "reattached", "reaped"}
)

// claimBuckets are the claim_duration_seconds upper bounds: a claim is a
// process boot, so milliseconds to the ready_timeout scale.
var claimBuckets = []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}

// Set holds every counter of GET /metrics; gauges are read from live
// state at scrape time so they cannot drift from it.
type Set struct {
	Claims          *CounterVec
	ClaimDuration   Histogram
	SpawnFailures   *CounterVec
	FramesDropped   *CounterVec
	ReplayGaps      *CounterVec
	ClientEvictions atomic.Uint64
	ConfigReloads   *CounterVec
	RestoredLeases  *CounterVec
}

// NewSet is a Set with every series at 0.
func NewSet() *Set {
	return &Set{
		Claims:         NewCounterVec("outcome", claimOutcomes),
		SpawnFailures:  NewCounterVec("reason", spawnFailureReasons),
		FramesDropped:  NewCounterVec("reason", dropReasons),
		ReplayGaps:     NewCounterVec("reason", gapReasons),
		ConfigReloads:  NewCounterVec("outcome", reloadOutcomes),
		RestoredLeases: NewCounterVec("outcome", restoreOutcomes),
		ClaimDuration:  Histogram{Buckets: claimBuckets},
	}
}

// Gauges are the scrape-time values.
type Gauges struct {
	SlotsInUse, MaxConcurrent, QueueDepth, MaxQueueDepth, TicketsOutstanding int
	// Leases counts the live leases by state, in the order of LeaseStates,
	// every operator-facing state (a series each, 0 included).
	Leases      map[string]int
	LeaseStates []string
	// Cluster is nil in single-broker mode, whose /metrics stays as it was.
	Cluster *Cluster
}

// Cluster is what /metrics says of the cluster.
type Cluster struct {
	PeersReachable, NATSFailures int
	// Refused counts the cluster messages refused, by reason, in the
	// order /metrics lists them.
	Refused []RefusedCount
}

// RefusedCount is one reason's count of refused cluster messages.
type RefusedCount struct {
	Reason string
	N      uint64
}

// NS prefixes every family's name.
const NS = "nexus_broker_"

// Write writes GET /metrics in the Prometheus text format, but for the
// pools' families (pool.WriteMetrics, after it): the counters and g.
func (m *Set) Write(w io.Writer, g Gauges) {
	gauge := func(name, help string, val int) {
		Header(w, NS+name, "gauge", help)
		fmt.Fprintf(w, "%s%s %d\n", NS, name, val)
	}
	m.Claims.Write(w, NS, "claims_total", "Instance claims handled by the shared spawn spine, by outcome. Covers POST /claim and the A2A ingress.")
	m.ClaimDuration.Write(w, NS, "claim_duration_seconds", "Wall time of an ACCEPTED claim, from request to a ready instance.")
	m.SpawnFailures.Write(w, NS, "spawn_failures_total", "Instance spawns that produced no ready instance, by reason.")
	m.FramesDropped.Write(w, NS, "frames_dropped_total", "Broker frames discarded rather than relayed, by reason.")
	m.ReplayGaps.Write(w, NS, "replay_gaps_total", "Stream-gap notices served to a resuming client, by reason.")
	Header(w, NS+"client_evictions_total", "counter", "Client WebSockets displaced by a newer connection on the same lease.")
	fmt.Fprintf(w, "%sclient_evictions_total %d\n", NS, m.ClientEvictions.Load())
	m.ConfigReloads.Write(w, NS, "config_reloads_total", "SIGHUP configuration reloads, by outcome.")
	m.RestoredLeases.Write(w, NS, "restored_leases_total", "Leases adopted from the journal at boot, and what became of them.")
	gauge("slots_in_use", "Capacity slots currently held: one per live lease.", g.SlotsInUse)
	gauge("max_concurrent", "Configured max_concurrent ceiling. 0 means unlimited.", g.MaxConcurrent)
	gauge("queue_depth", "Claims currently parked in the FIFO capacity queue.", g.QueueDepth)
	gauge("max_queue_depth", "Configured max_queue_depth ceiling on parked claims. 0 means unlimited.", g.MaxQueueDepth)
	Header(w, NS+"leases", "gauge", "Live leases by operator-facing state.")
	for _, s := range g.LeaseStates {
		fmt.Fprintf(w, "%sleases{state=%q} %d\n", NS, s, g.Leases[s])
	}
	gauge("tickets_outstanding", "Issued, unredeemed WebSocket tickets the broker still holds.", g.TicketsOutstanding)
	if c := g.Cluster; c != nil {
		gauge("cluster_peers_reachable", "Other brokers whose heartbeat is current.", c.PeersReachable)
		gauge("cluster_nats_failures", "Consecutive failed NATS connection attempts (3 or more: an ERROR line).", c.NATSFailures)
		name := "cluster_messages_refused_total"
		Header(w, NS+name, "counter", "Cluster messages refused: not sealed with the cluster secret (seal), stale, replayed, or arrived after its caller's deadline (late).")
		for _, r := range c.Refused {
			fmt.Fprintf(w, "%s%s{reason=%q} %d\n", NS, name, r.Reason, r.N)
		}
	}
}
