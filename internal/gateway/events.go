package gateway

import (
	"net/http"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/auth"
	"github.com/nexus-broker/nexus-broker/internal/config"
)

// This file is the core's face to the layers above it that read leases
// rather than run them (the console): lease events, the capacity figures,
// the caller's admission, and where their routes go.

// EventKind names what happened to a lease.
type EventKind string

// The lease events.
const (
	EventClaimed  EventKind = "claimed"
	EventReleased EventKind = "released"
	EventCrashed  EventKind = "crashed"
	EventReaped   EventKind = "reaped"
	EventEvicted  EventKind = "evicted"
	// EventClient is a client attaching to or leaving a lease.
	EventClient EventKind = "client"
)

// Event is one thing that happened to a lease.
type Event struct {
	At                         time.Time
	Kind                       EventKind
	LeaseID, Principal, Binary string
	// Detail is the teardown reason, or why a client was evicted.
	Detail string
}

// Subscribe has f called with every lease event, in order, on the
// goroutine the event happened on: f must return at once. Subscribe before
// Start.
func (g *Gateway) Subscribe(f func(Event)) { g.subs = append(g.subs, f) }

func (g *Gateway) publish(kind EventKind, l *lease, detail string) {
	if len(g.subs) == 0 {
		return
	}
	ev := Event{At: time.Now().UTC(), Kind: kind, LeaseID: l.id, Principal: l.principal, Binary: l.entry, Detail: detail}
	for _, f := range g.subs {
		f(ev)
	}
}

// teardownEvent names a teardown reason's event kind.
func teardownEvent(reason string) EventKind {
	switch reason {
	case reasonRelease:
		return EventReleased
	case reasonCrashed:
		return EventCrashed
	}
	return EventReaped
}

// Mount adds routes of a layer above the core to Handler's mux. Mount
// before Handler.
func (g *Gateway) Mount(routes func(*http.ServeMux)) { g.mounts = append(g.mounts, routes) }

// Capacity is the admission figures: slots, the FIFO queue, and how long
// its front has waited.
type Capacity struct {
	Max, InUse, Depth, MaxDepth int
	OldestWait                  time.Duration
}

// Capacity is the admission figures now.
func (g *Gateway) Capacity() Capacity {
	var c Capacity
	c.Max, c.InUse, c.Depth, c.MaxDepth = g.cap.Snapshot()
	c.OldestWait = g.cap.OldestWait()
	return c
}

// Admit authenticates r, as an operator (auth.admin_scope) when admin is
// set. On false it has answered.
func (g *Gateway) Admit(w http.ResponseWriter, r *http.Request, admin bool) (auth.Principal, bool) {
	return g.authenticate(w, r, admin)
}

// Audit logs a refusal of r to p as every route's refusals are logged.
func (g *Gateway) Audit(r *http.Request, p auth.Principal, status int, reason string) {
	g.audit(r, p, status, reason)
}

// AuthEnabled says whether the broker authenticates its callers.
func (g *Gateway) AuthEnabled() bool { return g.auth.Enabled() }

// Config is the configuration in force.
func (g *Gateway) Config() *config.Config { return g.cfg.Load() }

// Done is closed when the gateway shuts down.
func (g *Gateway) Done() <-chan struct{} { return g.ctx.Done() }

// StateDraining is the state LeaseInfo names a lease whose teardown began.
const StateDraining = stateDraining
