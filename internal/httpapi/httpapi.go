// Package httpapi is nexus-broker's HTTP face over the lease core: the
// routes of the broker's API (claim, release, ticket, leases, binaries,
// metrics, cluster, the probes, the OpenAPI description it serves), the
// auth guard every route but the probes goes through, the bounds on a
// request's body (max_claim_body, and the HTTP server's read and idle
// timeouts), and the host guard of a broker without auth:. It mounts the
// core's own WebSockets and the routes of the layers above it (the A2A
// door, the console) on the same mux, and hands that mux to the core for
// the requests other brokers carry here.
//
// It reaches the lease core only through the core's exported face
// (internal/gateway, as Core here) and the cluster router only through the
// part of gateway.Router Peers names: it holds no pointer to the gateway
// and shares no lock with it. It may not import the core's internals
// (internal/gateway/internal/..., which the compiler refuses anyway),
// internal/gateway/spawner, the cluster router or internal/cluster, the
// console, the A2A door, internal/brokerd, internal/spawnclient or
// pkg/spawnrpc (internal/gateway/layers_test.go checks it).
package httpapi

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/auth"
	"github.com/nexus-broker/nexus-broker/internal/config"
	"github.com/nexus-broker/nexus-broker/internal/gateway"
	"github.com/nexus-broker/nexus-broker/internal/gateway/reply"
	"github.com/nexus-broker/nexus-broker/internal/hostguard"
)

// Core is the lease core as the HTTP face uses it: a part of its API.
type Core interface {
	// Authenticate is the guard every route goes through; Admit the same,
	// as an operator (auth.admin_scope) when admin is set. On false they
	// have answered.
	Authenticate(w http.ResponseWriter, r *http.Request) (auth.Principal, bool)
	Admit(w http.ResponseWriter, r *http.Request, admin bool) (auth.Principal, bool)
	// Audit logs a refusal as every route's refusals are logged.
	Audit(r *http.Request, p auth.Principal, status int, reason string, attrs ...any)
	AuthEnabled() bool
	// Config is the configuration in force.
	Config() *config.Config
	// ClaimRequest is POST /claim's claim of a body read whole; CountClaim
	// counts it, or a claim refused before it.
	ClaimRequest(r *http.Request, p auth.Principal, body []byte) (*gateway.ClaimAnswer, *gateway.ClaimError)
	CountClaim(start time.Time, e *gateway.ClaimError)
	// Release and Ticket are POST /release/{id} and /ticket/{id} on the
	// lease's owner: the ownership check and the act, the status and body
	// to answer.
	Release(r *http.Request, id string, p auth.Principal) (int, any)
	Ticket(r *http.Request, id string, p auth.Principal) (int, any)
	// LocalLeases is this broker's part of GET /leases for p.
	LocalLeases(p auth.Principal) gateway.LeaseList
	Binaries() []gateway.BinaryInfo
	// NotReady is why GET /readyz is 503, nil while it is 200.
	NotReady() error
	// WriteMetrics writes GET /metrics.
	WriteMetrics(w io.Writer)
	// Routes adds the core's WebSockets and the mounted layers' routes.
	Routes(mux *http.ServeMux)
	// ServeCarried serves the requests other brokers carry here with mux.
	ServeCarried(mux *http.ServeMux)
	// Cluster is the cluster router, nil in single-broker mode.
	Cluster() gateway.Router
}

// Peers is the cluster router as the HTTP face asks it: a part of
// gateway.Router.
type Peers interface {
	// RemoteOwner is the broker owning lease id when that is not this one.
	RemoteOwner(id string) string
	// ForwardLease answers a lease route for a lease owner owns.
	ForwardLease(w http.ResponseWriter, r *http.Request, owner, route string, p auth.Principal)
	// Leases is GET /leases over every broker, local being this one's.
	Leases(ctx context.Context, p auth.Principal, local gateway.LeaseList) gateway.LeaseList
	// Brokers is GET /cluster.
	Brokers() []gateway.BrokerInfo
}

// api serves the routes over one core.
type api struct {
	core Core
	log  *slog.Logger
}

// Handler returns the broker's routes over core, logging to log (the
// core's logger). Call it once the core started.
func Handler(core Core, log *slog.Logger) http.Handler {
	a := &api{core: core, log: log}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /claim", a.handleClaim)
	mux.HandleFunc("POST /release/{lease_id}", a.guarded(a.ownerRoute(routeRelease, core.Release)))
	mux.HandleFunc("POST /ticket/{lease_id}", a.guarded(a.ownerRoute(routeTicket, core.Ticket)))
	mux.HandleFunc("GET /leases", a.guarded(a.handleLeases))
	mux.HandleFunc("GET /binaries", a.guarded(a.handleBinaries))
	mux.HandleFunc("GET /metrics", a.guard(true, a.handleMetrics))
	mux.HandleFunc("GET /cluster", a.guard(true, a.handleCluster))
	mux.HandleFunc("GET /openapi.json", a.guarded(handleOpenAPI))
	// Never under auth: health for probes (and the core's instance
	// dial-back, which proves itself with its spawn secret).
	mux.HandleFunc("GET /healthz", handleHealthz)
	mux.HandleFunc("GET /readyz", a.handleReadyz)
	core.Routes(mux)
	core.ServeCarried(mux)
	if core.AuthEnabled() {
		return mux
	}
	// Without credentials, a Host that names no address of this broker is
	// a DNS-rebinding page's request: 421 (a carried request, the bare
	// mux, came from a peer broker, not a browser).
	// And an Origin of another site is a cross-site page's request (a form,
	// a fetch, a WebSocket): 403.
	boot := core.Config()
	return hostguard.New(boot.ListenAddr, boot.AdvertiseAddr).Wrap(mux, func(r *http.Request, status int, reason string) {
		core.Audit(r, auth.Principal{}, status, reason, "host", r.Host, "origin", r.Header.Get("Origin"))
	})
}

// writeJSON answers v with status.
var writeJSON = reply.JSON

// writeError answers the broker's {"error":"…"} envelope.
var writeError = reply.Error

// guarded wraps a handler in authentication.
func (a *api) guarded(h func(http.ResponseWriter, *http.Request, auth.Principal)) http.HandlerFunc {
	return a.guard(false, h)
}

// guard wraps a handler in authentication, with admin requiring
// auth.admin_scope.
func (a *api) guard(admin bool, h func(http.ResponseWriter, *http.Request, auth.Principal)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if p, ok := a.core.Admit(w, r, admin); ok {
			h(w, r, p)
		}
	}
}

// peers is the cluster router, nil in single-broker mode.
func (a *api) peers() Peers {
	if rt := a.core.Cluster(); rt != nil {
		return rt
	}
	return nil
}
