package httpapi

import (
	"bytes"
	"errors"
	"net/http"

	"github.com/nexus-broker/nexus-broker/internal/auth"
	"github.com/nexus-broker/nexus-broker/internal/gateway"
)

func handleHealthz(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}

// handleReadyz is GET /readyz, for load balancers: 200 while spawnd is
// attached and answering (and, in cluster mode, NATS has not failed three
// times in a row), else 503 naming why. /healthz keeps the spec's
// answer: the gateway itself is up.
func (a *api) handleReadyz(w http.ResponseWriter, _ *http.Request) {
	if err := a.core.NotReady(); err != nil {
		status := "unavailable"
		if errors.Is(err, gateway.ErrDraining) {
			status = "draining"
		}
		writeJSON(w, http.StatusServiceUnavailable, map[string]string{"status": status, "error": err.Error()})
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ready"})
}

// handleBinaries is GET /binaries: names and presentational strings only,
// sorted by name; never a path, argv or environment.
func (a *api) handleBinaries(w http.ResponseWriter, _ *http.Request, _ auth.Principal) {
	writeJSON(w, http.StatusOK, map[string]any{"binaries": a.core.Binaries()})
}

// handleLeases is GET /leases. An operator (auth.admin_scope, or every
// caller without auth) sees every lease and the aggregates; anyone else
// only their own leases, the aggregates absent rather than zeroed.
func (a *api) handleLeases(w http.ResponseWriter, r *http.Request, p auth.Principal) {
	if rt := a.peers(); rt != nil {
		writeJSON(w, http.StatusOK, rt.Leases(r.Context(), p, a.core.LocalLeases(p)))
		return
	}
	writeJSON(w, http.StatusOK, a.core.LocalLeases(p))
}

// handleCluster is GET /cluster (auth.admin_scope): every broker on this
// one's membership list, this one first.
func (a *api) handleCluster(w http.ResponseWriter, _ *http.Request, _ auth.Principal) {
	rt := a.peers()
	if rt == nil {
		writeError(w, http.StatusNotFound, "cluster mode is off: this broker has no cluster: block")
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"brokers": rt.Brokers()})
}

// handleMetrics is GET /metrics in the Prometheus text format. Every
// number is a whole-registry aggregate, so it needs auth.admin_scope.
func (a *api) handleMetrics(w http.ResponseWriter, _ *http.Request, _ auth.Principal) {
	var buf bytes.Buffer
	a.core.WriteMetrics(&buf)
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	_, _ = w.Write(buf.Bytes())
}

// The lease routes the router forwards.
const (
	routeRelease = "release"
	routeTicket  = "ticket"
)

// ownerAnswer is a lease route as its owner answers it: status and body.
type ownerAnswer func(r *http.Request, id string, p auth.Principal) (int, any)

// ownerRoute serves a lease route here when this broker owns the lease (or
// in single-broker mode), else has the router forward it to the owner.
// POST /release/{lease_id} and /ticket/{lease_id}: ownership is checked
// before anything happens, so a refused release sends no shutdown frame.
func (a *api) ownerRoute(route string, local ownerAnswer) func(http.ResponseWriter, *http.Request, auth.Principal) {
	return func(w http.ResponseWriter, r *http.Request, p auth.Principal) {
		id := r.PathValue("lease_id")
		if rt := a.peers(); rt != nil {
			if owner := rt.RemoteOwner(id); owner != "" {
				rt.ForwardLease(w, r, owner, route, p)
				return
			}
		}
		st, v := local(r, id, p)
		writeJSON(w, st, v)
	}
}
