// Package console is the broker's operator page (GET /console) and its
// event stream (GET /console/events): a reader of the lease core. It keeps
// the recent lease events the core publishes and renders the core's
// listings; it never changes a lease (the page's release button calls the
// core's own POST /release route).
//
// It reaches the core only through Core, the few methods of the core's
// exported face it reads, and imports of internal/gateway only that face's
// types and its reply helpers: nothing of the core's internals, the A2A
// door, the cluster router, the HTTP layer or spawnd's client. Nothing of
// the gateway's imports it but the composition in internal/brokerd.
package console

import (
	"bytes"
	_ "embed"
	"encoding/json"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/auth"
	"github.com/nexus-broker/nexus-broker/internal/config"
	"github.com/nexus-broker/nexus-broker/internal/gateway"
	"github.com/nexus-broker/nexus-broker/internal/gateway/reply"
)

// consolePage is GET /console: one self-contained file, no build step and
// nothing fetched from elsewhere.
//
//go:embed console.html
var consolePage []byte

const (
	// consoleEvents is how many recent events the page shows.
	consoleEvents = 50
	// consoleRefresh is the slowest a change the gateway does not announce
	// (last activity, queue depth) takes to reach an open page, and the
	// fastest the stream is re-sent: at most once a second.
	consoleRefresh = time.Second
	// consoleCoalesce gathers the changes of one event into one send.
	consoleCoalesce = 50 * time.Millisecond
	// textConsoleLoopback refuses a remote caller of an unauthenticated
	// broker's console.
	textConsoleLoopback = "the console is served only to loopback without an auth: block; set console.allow_remote to serve it to others"
)

// consoleEvent is one line of the page's event list.
type consoleEvent struct {
	At        time.Time         `json:"at"`
	Kind      gateway.EventKind `json:"kind"`
	LeaseID   string            `json:"lease_id"`
	Principal string            `json:"principal"`
	Binary    string            `json:"binary"`
	Detail    string            `json:"detail,omitempty"`
}

// consoleHub keeps the recent events and wakes open pages on a change.
type consoleHub struct {
	mu      sync.Mutex
	events  []consoleEvent // oldest first, at most consoleEvents
	changed chan struct{}  // closed and replaced on every change
}

func newConsoleHub() *consoleHub { return &consoleHub{changed: make(chan struct{})} }

// Core is what the console needs of the lease core (*gateway.Gateway): its
// lease events, its listings and its admission, and a place for its routes.
type Core interface {
	// Subscribe and Mount are called once, in Attach.
	Subscribe(func(gateway.Event))
	Mount(func(*http.ServeMux))
	Leases(owner string, all bool) []gateway.LeaseInfo
	Binaries() []gateway.BinaryInfo
	Pools() []gateway.PoolInfo
	Capacity() gateway.Capacity
	Config() *config.Config
	Done() <-chan struct{}
	Admit(w http.ResponseWriter, r *http.Request, admin bool) (auth.Principal, bool)
	Audit(r *http.Request, p auth.Principal, status int, reason string, attrs ...any)
	AuthEnabled() bool
}

// Attach subscribes a console to g's lease events and mounts its routes.
// Call it before g.Start and the HTTP face (httpapi.Handler).
func Attach(g Core) {
	c := &console{g: g, hub: newConsoleHub()}
	g.Subscribe(c.hub.observe)
	g.Mount(func(mux *http.ServeMux) {
		mux.HandleFunc("GET /console", c.handleConsole)
		mux.HandleFunc("GET /console/events", c.handleConsoleEvents)
	})
}

// console serves the page over one gateway.
type console struct {
	g   Core
	hub *consoleHub
}

// observe takes one lease event: a client's coming or going only wakes the
// pages; the rest is listed.
func (h *consoleHub) observe(ev gateway.Event) {
	if ev.Kind == gateway.EventClient {
		h.wake()
		return
	}
	h.record(ev)
}

// wake tells every open page something changed.
func (h *consoleHub) wake() {
	h.mu.Lock()
	close(h.changed)
	h.changed = make(chan struct{})
	h.mu.Unlock()
}

// record appends an event and wakes the pages.
func (h *consoleHub) record(ev gateway.Event) {
	h.mu.Lock()
	h.events = append(h.events, consoleEvent{At: ev.At, Kind: ev.Kind, LeaseID: ev.LeaseID, Principal: ev.Principal, Binary: ev.Binary, Detail: ev.Detail})
	if n := len(h.events); n > consoleEvents {
		h.events = append([]consoleEvent(nil), h.events[n-consoleEvents:]...)
	}
	close(h.changed)
	h.changed = make(chan struct{})
	h.mu.Unlock()
}

// watch returns the recent events, newest first, and the channel the next
// change closes.
func (h *consoleHub) watch() ([]consoleEvent, <-chan struct{}) {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make([]consoleEvent, len(h.events))
	for i, e := range h.events {
		out[len(out)-1-i] = e
	}
	return out, h.changed
}

// consoleLease is one row of the page: never a session id, a ticket or a
// secret, whoever the lease belongs to.
type consoleLease struct {
	LeaseID        string    `json:"lease_id"`
	Principal      string    `json:"principal"`
	Binary         string    `json:"binary"`
	State          string    `json:"state"`
	Reason         string    `json:"reason,omitempty"`
	CreatedAt      time.Time `json:"created_at"`
	LastActivity   time.Time `json:"last_activity"`
	ClientAttached bool      `json:"client_attached"`
	PID            int64     `json:"pid"`
	// Pool is a warm lease's, nobody's until claimed.
	Pool string `json:"pool,omitempty"`
	// Releasable: the viewer owns it. There is no operator bypass on
	// release, so the page offers the button only where it would work.
	Releasable bool `json:"releasable"`
}

type consoleSnapshot struct {
	Now      time.Time `json:"now"`
	Viewer   string    `json:"viewer"`
	Capacity struct {
		SlotsInUse    int     `json:"slots_in_use"`
		MaxConcurrent int     `json:"max_concurrent"`
		QueueDepth    int     `json:"queue_depth"`
		MaxQueueDepth int     `json:"max_queue_depth"`
		OldestWaitSec float64 `json:"oldest_wait_seconds"`
	} `json:"capacity"`
	Binaries []gateway.BinaryInfo `json:"binaries"`
	Pools    []gateway.PoolInfo   `json:"pools"`
	Leases   []consoleLease       `json:"leases"`
	Events   []consoleEvent       `json:"events"`
	changed  <-chan struct{}      // when this snapshot is stale
}

func (c *console) consoleSnapshot(viewer auth.Principal) *consoleSnapshot {
	s := &consoleSnapshot{Now: time.Now().UTC(), Viewer: viewer.ID, Binaries: c.g.Binaries(), Pools: c.g.Pools(), Leases: []consoleLease{}}
	s.Events, s.changed = c.hub.watch()
	k, capa := &s.Capacity, c.g.Capacity()
	k.MaxConcurrent, k.SlotsInUse, k.QueueDepth, k.MaxQueueDepth = capa.Max, capa.InUse, capa.Depth, capa.MaxDepth
	k.OldestWaitSec = capa.OldestWait.Seconds()
	for _, l := range c.g.Leases("", true) {
		s.Leases = append(s.Leases, consoleLease{
			LeaseID: l.LeaseID, Principal: l.Principal, Binary: l.Binary, State: l.State, Reason: l.Reason,
			CreatedAt: l.CreatedAt, LastActivity: l.LastActivity, ClientAttached: l.ClientAttached, PID: l.PID, Pool: l.Pool,
			Releasable: l.Pool == "" && l.Principal == viewer.ID && l.State != gateway.StateDraining,
		})
	}
	return s
}

// consoleViewer admits a caller of the console: an operator (auth.admin_scope)
// with an auth: block; without one, loopback callers, or anyone when
// console.allow_remote is set. On false it has answered.
func (c *console) consoleViewer(w http.ResponseWriter, r *http.Request) (auth.Principal, bool) {
	p, ok := c.g.Admit(w, r, true)
	if !ok {
		return p, false
	}
	if !c.g.AuthEnabled() && !c.g.Config().Console.AllowRemote && !fromLoopback(r) {
		c.g.Audit(r, p, http.StatusForbidden, "console from a remote peer without auth")
		reply.Error(w, http.StatusForbidden, textConsoleLoopback)
		return p, false
	}
	return p, true
}

// fromLoopback: the TCP peer, never a forwarding header.
func fromLoopback(r *http.Request) bool {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	ip := net.ParseIP(host)
	return err == nil && ip != nil && ip.IsLoopback()
}

// handleConsole is GET /console.
func (c *console) handleConsole(w http.ResponseWriter, r *http.Request) {
	if _, ok := c.consoleViewer(w, r); !ok {
		return
	}
	h := w.Header()
	h.Set("Content-Type", "text/html; charset=utf-8")
	h.Set("Cache-Control", "no-store")
	// The page loads nothing from anywhere else and talks only to this origin.
	h.Set("Content-Security-Policy", "default-src 'none'; script-src 'self' 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
	h.Set("X-Content-Type-Options", "nosniff")
	_, _ = w.Write(consolePage)
}

// handleConsoleEvents is GET /console/events: server-sent events, one
// "snapshot" event with the whole view whenever it changed, woken by the
// gateway's own changes and re-checked every consoleRefresh.
func (c *console) handleConsoleEvents(w http.ResponseWriter, r *http.Request) {
	p, ok := c.consoleViewer(w, r)
	if !ok {
		return
	}
	flusher, ok := w.(http.Flusher)
	if !ok {
		reply.Error(w, http.StatusInternalServerError, "streaming unsupported")
		return
	}
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write([]byte("retry: 2000\n\n"))
	flusher.Flush()
	tick := time.NewTicker(consoleRefresh)
	defer tick.Stop()
	var last []byte
	for {
		s := c.consoleSnapshot(p)
		// Now changes every time; compare the view without it.
		now := s.Now
		s.Now = time.Time{}
		view, _ := json.Marshal(s)
		if !bytes.Equal(view, last) {
			last = view
			s.Now = now
			data, _ := json.Marshal(s)
			if _, err := w.Write([]byte("event: snapshot\ndata: " + string(data) + "\n\n")); err != nil {
				return
			}
			flusher.Flush()
		}
		select {
		case <-r.Context().Done():
			return
		case <-c.g.Done():
			return
		case <-s.changed:
			// A burst of changes (a release takes a lease, a slot and a
			// client at once) is one send.
			time.Sleep(consoleCoalesce)
		case <-tick.C:
		}
	}
}
