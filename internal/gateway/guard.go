package gateway

import (
	"net/http"
	"strings"

	"github.com/nexus-broker/nexus-broker/internal/auth"
	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/capacity"
	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/wire"
	"github.com/nexus-broker/nexus-broker/internal/gateway/reply"
)

// Credential kinds, as the connection log names them.
const (
	credentialAnonymous = "anonymous"
	credentialBearer    = "bearer"
	credentialTicket    = "ticket"
)

// authenticate is Authenticate; with admin, a caller without
// auth.admin_scope is refused 403 insufficient scope, audited as denied
// only, as upstream's validator chain refuses a missing scope.
func (g *Gateway) authenticate(w http.ResponseWriter, r *http.Request, admin bool) (auth.Principal, bool) {
	p, forwarded := forwardedPrincipal(r.Context()) // another broker authenticated it (cluster mode)
	var ref *auth.Refusal
	if !forwarded {
		p, ref = g.auth.Authenticate(r)
	}
	if ref == nil && admin && !g.auth.IsAdmin(p) {
		ref = auth.NotAdmin
	}
	if ref != nil {
		g.refuse(w, r, p, ref)
		return p, false
	}
	if g.auth.Enabled() && !forwarded {
		g.log.Info("auth allowed", auditAttrs(r, p.ID)...)
	}
	return p, true
}

// owned finds a live lease the principal owns. A lease that is not yours is
// the same answer as none at all, and is audited as a refusal; on false the
// caller answers the 404 itself (see writeUnknownLease).
func (g *Gateway) owned(r *http.Request, id string, p auth.Principal) *lease {
	l := g.lookup(id)
	if l == nil || !l.ownedBy(p.ID) {
		g.leaseDenied(r, p, id)
		return nil
	}
	if l.currentState() == stateDraining {
		return nil
	}
	return l
}

func writeUnknownLease(w http.ResponseWriter) {
	reply.Error(w, http.StatusNotFound, errUnknownLease)
}

// The audit trail is upstream's records (never a token, a ticket or a
// secret in any): "auth allowed" for each authenticated request, "auth
// denied" for each authentication refusal, "lease access denied" for each
// lease a caller may not act on, unknown or another's alike, so the log no
// more tells the two apart than the answer does. The refusals upstream
// has no record for (a per-principal cap, the console's loopback rule) are
// "request refused". Each carries the peer besides.

// ticketDenial is why a ticket was refused, in the record only: the caller
// is told credential rejected, whatever the cause.
const ticketDenial = "ticket unknown, expired, spent or for another lease"

// auditAttrs are the keys every audit record starts with: the route as the
// mux matched it, the principal (empty when unknown), the lease when the
// route names one.
func auditAttrs(r *http.Request, principal string) []any {
	route := r.Pattern
	if route == "" {
		route = r.Method + " " + r.URL.Path
	}
	attrs := []any{"route", route, "principal_id", principal}
	if id := r.PathValue("lease_id"); id != "" {
		attrs = append(attrs, "lease_id", id)
	}
	return attrs
}

// auditKey is the subject an audit record is bounded by (logbound): one
// peer, as one principal, on one route, refused for one reason.
func auditKey(r *http.Request, principal, reason string) string {
	return strings.Join([]string{wire.PeerHost(r.RemoteAddr), principal, r.Pattern, reason}, " ")
}

// refuse answers an authentication refusal and audits it, naming p when
// it is known (a caller without the admin scope).
func (g *Gateway) refuse(w http.ResponseWriter, r *http.Request, p auth.Principal, ref *auth.Refusal) {
	g.denied(r, p.ID, ref.Status, ref.Text, ref.Reason)
	ref.Write(w)
}

// denied writes an "auth denied" record: reason is what the caller was
// told, denial why.
func (g *Gateway) denied(r *http.Request, principal string, status int, reason, denial string) {
	g.quiet.Warn(auditKey(r, principal, denial), "auth denied", append(auditAttrs(r, principal), "reason", reason, "status", status, "denial", denial, "peer", r.RemoteAddr)...)
}

// leaseDenied writes a "lease access denied" record.
func (g *Gateway) leaseDenied(r *http.Request, p auth.Principal, id string) {
	attrs := auditAttrs(r, p.ID)
	if r.PathValue("lease_id") == "" {
		attrs = append(attrs, "lease_id", id)
	}
	g.quiet.Warn(auditKey(r, p.ID, ""), "lease access denied", append(attrs, "reason", "unknown lease or not owned by this principal", "peer", r.RemoteAddr)...)
}

// audit writes a "request refused" record, attrs before the peer.
func (g *Gateway) audit(r *http.Request, p auth.Principal, status int, reason string, attrs ...any) {
	rec := append(auditAttrs(r, p.ID), "status", status, "reason", reason)
	g.quiet.Warn(auditKey(r, p.ID, reason), "request refused", append(append(rec, attrs...), "peer", r.RemoteAddr)...)
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
			g.refuse(w, r, p, &auth.Refusal{Status: http.StatusUnauthorized, Text: auth.TextRejected, Reason: ticketDenial})
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
	if g.rt != nil {
		elsewhere = g.rt.PeerLeaseCount(principal)
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
func (g *Gateway) queueQuota(principal string) capacity.Quota[queuedOffer] {
	if !g.capped(principal) {
		return capacity.Quota[queuedOffer]{}
	}
	return capacity.Quota[queuedOffer]{Principal: principal, Max: g.boot.MaxQueuedPerPrincipal}
}
