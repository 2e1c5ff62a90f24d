package gateway

import (
	"bytes"
	"errors"
	"fmt"
	"net/http"

	"github.com/nexus-broker/nexus-broker/internal/auth"
	"github.com/nexus-broker/nexus-broker/internal/gateway/reply"
)

const errUnknownLease = "unknown lease"

// writeJSON answers v with status.
var writeJSON = reply.JSON

// writeError answers the broker's {"error":"…"} envelope.
var writeError = reply.Error

func (g *Gateway) handleHealthz(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}

// spawnerDown is why spawnd cannot serve a request now, nil while it can.
func (g *Gateway) spawnerDown() error {
	if g.ready == nil {
		return nil
	}
	return g.ready()
}

// errDraining is /readyz's word on a draining broker.
var errDraining = errors.New("draining: nexus-broker -drain; it takes no new claims (nexus-broker -undrain ends it)")

// SetDraining starts (true) or ends an operator's drain: new claims and
// offers are refused while the leases here keep working, /readyz is 503,
// and (cluster mode) the heartbeats say so, so peers offer nothing here.
func (g *Gateway) SetDraining(on bool) {
	if g.draining.Swap(on) != on {
		g.log.Info("drain", "draining", on)
	}
	if g.rt != nil {
		g.rt.SetDraining(on)
	}
}

// notReady is why a load balancer should steer traffic elsewhere: spawnd
// down, its lease journal failed (claims are refused until it is
// rewritten), a drain, or (cluster mode) this broker's link to NATS down.
func (g *Gateway) notReady() error {
	if g.draining.Load() {
		return errDraining
	}
	if err := g.spawnerDown(); err != nil {
		return err
	}
	if g.journal != nil {
		if err := g.journal(); err != nil {
			return fmt.Errorf("journal: %w", err)
		}
	}
	if g.rt != nil {
		return g.rt.Ready()
	}
	return nil
}

// handleReadyz is GET /readyz, for load balancers: 200 while spawnd is
// attached and answering (and, in cluster mode, NATS has not failed three
// times in a row), else 503 naming why. /healthz keeps the spec's
// answer: the gateway itself is up.
func (g *Gateway) handleReadyz(w http.ResponseWriter, _ *http.Request) {
	if err := g.notReady(); err != nil {
		status := "unavailable"
		if errors.Is(err, errDraining) {
			status = "draining"
		}
		writeJSON(w, http.StatusServiceUnavailable, map[string]string{"status": status, "error": err.Error()})
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ready"})
}

// handleTicket is POST /ticket/{lease_id}: a fresh ticket for the lease's
// owner. With no auth: block it is inert: 200 with the ticket key omitted,
// and the lease socket needs none.
// ticket mints on the lease's owner, where the ticket is redeemed.
func (g *Gateway) ticket(r *http.Request, id string, p auth.Principal) (int, any) {
	l := g.owned(r, id, p)
	if l == nil {
		return http.StatusNotFound, map[string]string{"error": errUnknownLease}
	}
	out := map[string]string{"lease_id": l.id}
	if g.auth.Enabled() {
		tok, err := g.tickets.Mint(l.id, p)
		if err != nil {
			g.log.Warn("lease ticket refused", "lease_id", l.id, "principal_id", p.ID, "error", err)
			return ticketRefusal(err), map[string]string{"error": err.Error()}
		}
		out["ticket"] = tok
	}
	// Never the value: a ticket is a bearer credential.
	g.log.Info("issued lease ticket", "route", "POST /ticket/{lease_id}", "lease_id", l.id, "principal_id", p.ID, "issued", out["ticket"] != "")
	return http.StatusOK, out
}

// ticketRefusal is the status of a refused mint: the principal's limit is
// 429, a full store 503.
func ticketRefusal(err error) int {
	if errors.Is(err, auth.ErrPrincipalTickets) {
		return http.StatusTooManyRequests
	}
	return http.StatusServiceUnavailable
}

// handleBinaries is GET /binaries: names and presentational strings only,
// sorted by name; never a path, argv or environment.
func (g *Gateway) handleBinaries(w http.ResponseWriter, _ *http.Request, _ auth.Principal) {
	writeJSON(w, http.StatusOK, map[string]any{"binaries": g.Binaries()})
}

type leasesJSON struct {
	MaxConcurrent *int        `json:"max_concurrent,omitempty"`
	SlotsInUse    *int        `json:"slots_in_use,omitempty"`
	QueueDepth    *int        `json:"queue_depth,omitempty"`
	MaxQueueDepth *int        `json:"max_queue_depth,omitempty"`
	Leases        []LeaseInfo `json:"leases"`
	// UnreachableBrokers (cluster mode only) names the brokers that did not
	// answer: their leases and aggregates are missing from the rest.
	UnreachableBrokers *[]string `json:"unreachable_brokers,omitempty"`
}

// handleLeases is GET /leases. An operator (auth.admin_scope, or every
// caller without auth) sees every lease and the aggregates; anyone else
// only their own leases, the aggregates absent rather than zeroed.
func (g *Gateway) handleLeases(w http.ResponseWriter, r *http.Request, p auth.Principal) {
	if g.rt != nil {
		writeJSON(w, http.StatusOK, g.rt.Leases(r.Context(), p, g.localLeases(p)))
		return
	}
	writeJSON(w, http.StatusOK, g.localLeases(p))
}

// localLeases is this broker's part of GET /leases for p.
func (g *Gateway) localLeases(p auth.Principal) leasesJSON {
	if !g.auth.IsAdmin(p) {
		return leasesJSON{Leases: g.Leases(p.ID, false)}
	}
	max, inUse, depth, maxDepth := g.cap.Snapshot()
	return leasesJSON{
		MaxConcurrent: &max, SlotsInUse: &inUse, QueueDepth: &depth, MaxQueueDepth: &maxDepth,
		Leases: g.Leases("", true),
	}
}

// handleCluster is GET /cluster (auth.admin_scope): every broker on this
// one's membership list, this one first.
func (g *Gateway) handleCluster(w http.ResponseWriter, _ *http.Request, _ auth.Principal) {
	if g.rt == nil {
		writeError(w, http.StatusNotFound, "cluster mode is off: this broker has no cluster: block")
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"brokers": g.rt.Brokers()})
}

// handleMetrics is GET /metrics in the Prometheus text format. Every
// number is a whole-registry aggregate, so it needs auth.admin_scope.
func (g *Gateway) handleMetrics(w http.ResponseWriter, r *http.Request, _ auth.Principal) {
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
	var buf bytes.Buffer
	g.m.write(&buf, gg)
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	_, _ = w.Write(buf.Bytes())
}

// handleRelease is POST /release/{lease_id}. Ownership is checked before
// anything happens: a refused release sends no shutdown frame.
// release is POST /release/{id} on the lease's owner, for a caller here or
// one another broker carried.
func (g *Gateway) release(r *http.Request, id string, p auth.Principal) (int, any) {
	l := g.lookup(id)
	if l == nil || l.principal != p.ID {
		g.leaseDenied(r, p, id)
		return http.StatusNotFound, map[string]string{"error": errUnknownLease}
	}
	if g.spawnerDown() != nil {
		// spawnd cannot confirm the exit now: answer at once, and leave the
		// lease draining, holding its slot, until it does. Draining before
		// the answer, so GET /leases never shows the released lease active.
		l.mu.Lock()
		if l.state != stateDraining {
			l.state, l.reason = stateDraining, reasonRelease
		}
		l.mu.Unlock()
		// Answered, the release must be done even if this gateway stops
		// before spawnd answers again.
		if err := g.sp.HandOver(l.id); err != nil {
			g.log.Warn("handing the release to nexus-spawnd failed; it is carried out only if this gateway runs until spawnd answers", "lease_id", l.id, "error", err)
		}
		go l.teardown(reasonRelease, teardownGraceful)
	} else {
		l.teardown(reasonRelease, teardownGraceful)
	}
	return http.StatusOK, map[string]string{"status": "released", "lease_id": l.id}
}
