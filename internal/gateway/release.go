package gateway

import (
	"errors"
	"fmt"
	"net/http"

	"github.com/nexus-broker/nexus-broker/internal/auth"
)

const errUnknownLease = "unknown lease"

// spawnerDown is why spawnd cannot serve a request now, nil while it can.
func (g *Gateway) spawnerDown() error {
	if g.ready == nil {
		return nil
	}
	return g.ready()
}

// ErrDraining is /readyz's word on a draining broker.
var ErrDraining = errors.New("draining: nexus-broker -drain; it takes no new claims (nexus-broker -undrain ends it)")

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

// NotReady is why a load balancer should steer traffic elsewhere (GET
// /readyz), nil while it need not: spawnd down, its lease journal failed
// (claims are refused until it is rewritten), a drain (ErrDraining), or
// (cluster mode) this broker's link to NATS down.
func (g *Gateway) NotReady() error {
	if g.draining.Load() {
		return ErrDraining
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

// ticket is POST /ticket/{lease_id} on the lease's owner, where the
// ticket is redeemed: a fresh ticket for the lease's owner. With no auth:
// block it is inert: 200 with the ticket key omitted, and the lease socket
// needs none.
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

// release is POST /release/{lease_id} on the lease's owner, for a caller
// here or one another broker carried. Ownership is checked before anything
// happens: a refused release sends no shutdown frame.
func (g *Gateway) release(r *http.Request, id string, p auth.Principal) (int, any) {
	l := g.lookup(id)
	if l == nil || !l.ownedBy(p.ID) {
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
