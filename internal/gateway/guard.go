package gateway

import (
	"net/http"

	"github.com/nexus-broker/nexus-broker/internal/auth"
)

// Credential kinds, as the connection log names them.
const (
	credentialAnonymous = "anonymous"
	credentialBearer    = "bearer"
	credentialTicket    = "ticket"
)

// Authenticate verifies r's credential against the auth: block and returns
// the caller's principal. On a refusal it has already answered r (401, or
// 503 with Retry-After) and written the audit line, and returns false.
// Without an auth: block every caller is the anonymous principal.
func (g *Gateway) Authenticate(w http.ResponseWriter, r *http.Request) (auth.Principal, bool) {
	if p, ok := forwardedPrincipal(r.Context()); ok {
		return p, true // another broker authenticated it (cluster mode)
	}
	p, ref := g.auth.Authenticate(r)
	if ref != nil {
		g.refuse(w, r, p, ref)
		return p, false
	}
	return p, true
}

// owned finds a live lease the principal owns. A lease that is not yours is
// the same answer as none at all, and is audited as a refusal; on false the
// caller answers the 404 itself (see writeUnknownLease).
func (g *Gateway) owned(r *http.Request, id string, p auth.Principal) *lease {
	l := g.lookup(id)
	switch {
	case l == nil:
		return nil
	case l.principal != p.ID:
		g.audit(r, p, http.StatusNotFound, "lease owned by another principal")
		return nil
	case l.currentState() == stateDraining:
		return nil
	}
	return l
}

// OwnsLease reports whether p owns the live lease id: the ownership check
// of release, connect and ticket, for routes outside this file. false is
// answered with writeUnknownLease, byte for byte what an unknown lease
// gets.
func (g *Gateway) OwnsLease(r *http.Request, id string, p auth.Principal) bool {
	return g.owned(r, id, p) != nil
}

func writeUnknownLease(w http.ResponseWriter) {
	writeError(w, http.StatusNotFound, errUnknownLease)
}

// refuse answers an authentication refusal and audits it.
func (g *Gateway) refuse(w http.ResponseWriter, r *http.Request, p auth.Principal, ref *auth.Refusal) {
	g.audit(r, p, ref.Status, ref.Reason)
	ref.Write(w)
}

// audit writes the one log line of a refusal: the route, the principal when
// known, the reason. Never a token, a ticket or a secret.
func (g *Gateway) audit(r *http.Request, p auth.Principal, status int, reason string) {
	attrs := []any{"route", r.Method + " " + r.URL.Path, "status", status, "reason", reason, "peer", r.RemoteAddr}
	if !p.Anonymous() {
		attrs = append(attrs, "principal_id", p.ID)
	}
	g.log.Warn("request refused", attrs...)
}

// guarded wraps a handler in authentication.
func (g *Gateway) guarded(h func(http.ResponseWriter, *http.Request, auth.Principal)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if p, ok := g.Authenticate(w, r); ok {
			h(w, r, p)
		}
	}
}

// clientPrincipal authenticates WS /lease/{id}: a non-empty ?ticket= wins
// exclusively (a failure never falls back to the Authorization header),
// else the route's ordinary credential.
func (g *Gateway) clientPrincipal(w http.ResponseWriter, r *http.Request, id string) (auth.Principal, string, bool) {
	if !g.auth.Enabled() {
		return auth.Principal{}, credentialAnonymous, true
	}
	if c := auth.Extract(r, true); c.Ticket != "" {
		p, ok := g.tickets.Redeem(c.Ticket, id)
		if !ok {
			g.refuse(w, r, p, &auth.Refusal{Status: http.StatusUnauthorized, Text: auth.TextRejected, Reason: "ticket unknown, expired, spent or for another lease"})
			return p, credentialTicket, false
		}
		return p, credentialTicket, true
	}
	p, ok := g.Authenticate(w, r)
	return p, credentialBearer, ok
}

// capped reports whether per-principal caps apply to principal: only with
// an auth: block, and never to the anonymous principal, for whom a cap
// would be a second, lower max_concurrent.
func (g *Gateway) capped(principal string) bool {
	return g.auth.Enabled() && principal != ""
}

// admitPrincipal books one claim against max_leases_per_principal, counting
// the principal's live leases and its claims still in flight (in cluster
// mode on every broker, peerLeaseCount); false is the 429. Undo with
// unadmitPrincipal unless the claim's lease was inserted.
func (g *Gateway) admitPrincipal(principal string) bool {
	max := g.boot.MaxLeasesPerPrincipal
	if max <= 0 || !g.capped(principal) {
		return true
	}
	elsewhere := 0
	if g.node != nil {
		elsewhere = g.peerLeaseCount(principal)
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if elsewhere+g.localCountLocked(principal) >= max {
		return false
	}
	g.claiming[principal]++
	return true
}

func (g *Gateway) unadmitPrincipal(principal string) {
	g.mu.Lock()
	g.unadmitLocked(principal)
	g.mu.Unlock()
}

func (g *Gateway) unadmitLocked(principal string) {
	if n, ok := g.claiming[principal]; ok {
		if n <= 1 {
			delete(g.claiming, principal)
		} else {
			g.claiming[principal] = n - 1
		}
	}
}

// queueQuota is principal's max_queued_per_principal, if it applies.
func (g *Gateway) queueQuota(principal string) queueQuota {
	if !g.capped(principal) {
		return queueQuota{}
	}
	return queueQuota{principal: principal, max: g.boot.MaxQueuedPerPrincipal}
}
