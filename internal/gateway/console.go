package gateway

import (
	"bytes"
	_ "embed"
	"encoding/json"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/auth"
)

// consolePage is GET /console: one self-contained file, no build step and
// nothing fetched from elsewhere.
//
//go:embed console.html
var consolePage []byte

// Console event kinds, as the page lists them.
const (
	eventClaimed  = "claimed"
	eventReleased = "released"
	eventCrashed  = "crashed"
	eventReaped   = "reaped"
	eventEvicted  = "evicted"
)

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
	At        time.Time `json:"at"`
	Kind      string    `json:"kind"`
	LeaseID   string    `json:"lease_id"`
	Principal string    `json:"principal"`
	Binary    string    `json:"binary"`
	Detail    string    `json:"detail,omitempty"`
}

// consoleHub keeps the recent events and wakes open pages on a change.
type consoleHub struct {
	mu      sync.Mutex
	events  []consoleEvent // oldest first, at most consoleEvents
	changed chan struct{}  // closed and replaced on every change
}

func newConsoleHub() *consoleHub { return &consoleHub{changed: make(chan struct{})} }

// wake tells every open page something changed.
func (h *consoleHub) wake() {
	h.mu.Lock()
	close(h.changed)
	h.changed = make(chan struct{})
	h.mu.Unlock()
}

// record appends an event about l and wakes the pages.
func (h *consoleHub) record(kind string, l *lease, detail string) {
	h.mu.Lock()
	h.events = append(h.events, consoleEvent{At: time.Now().UTC(), Kind: kind, LeaseID: l.id, Principal: l.principal, Binary: l.entry, Detail: detail})
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

// teardownEvent names a teardown reason's event kind.
func teardownEvent(reason string) string {
	switch reason {
	case reasonRelease:
		return eventReleased
	case reasonCrashed:
		return eventCrashed
	}
	return eventReaped
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
	Binaries []binaryJSON    `json:"binaries"`
	Leases   []consoleLease  `json:"leases"`
	Events   []consoleEvent  `json:"events"`
	changed  <-chan struct{} // when this snapshot is stale
}

func (g *Gateway) consoleSnapshot(viewer auth.Principal) *consoleSnapshot {
	s := &consoleSnapshot{Now: time.Now().UTC(), Viewer: viewer.ID, Binaries: g.binaryList(), Leases: []consoleLease{}}
	s.Events, s.changed = g.console.watch()
	c := &s.Capacity
	c.MaxConcurrent, c.SlotsInUse, c.QueueDepth, c.MaxQueueDepth = g.cap.snapshot()
	c.OldestWaitSec = g.cap.oldestWait().Seconds()
	for _, l := range g.snapshotLeases("", true) {
		s.Leases = append(s.Leases, consoleLease{
			LeaseID: l.LeaseID, Principal: l.principal, Binary: l.Binary, State: l.State, Reason: l.Reason,
			CreatedAt: l.CreatedAt, LastActivity: l.LastActivity, ClientAttached: l.clientAttached, PID: l.PID,
			Releasable: l.principal == viewer.ID && l.State != stateDraining,
		})
	}
	return s
}

// consoleViewer admits a caller of the console: an operator (auth.admin_scope)
// with an auth: block; without one, loopback callers, or anyone when
// console.allow_remote is set. On false it has answered.
func (g *Gateway) consoleViewer(w http.ResponseWriter, r *http.Request) (auth.Principal, bool) {
	p, ok := g.authenticate(w, r, true)
	if !ok {
		return p, false
	}
	if !g.auth.Enabled() && !g.cfg.Load().Console.AllowRemote && !fromLoopback(r) {
		g.audit(r, p, http.StatusForbidden, "console from a remote peer without auth")
		writeError(w, http.StatusForbidden, textConsoleLoopback)
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
func (g *Gateway) handleConsole(w http.ResponseWriter, r *http.Request) {
	if _, ok := g.consoleViewer(w, r); !ok {
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
func (g *Gateway) handleConsoleEvents(w http.ResponseWriter, r *http.Request) {
	p, ok := g.consoleViewer(w, r)
	if !ok {
		return
	}
	flusher, ok := w.(http.Flusher)
	if !ok {
		writeError(w, http.StatusInternalServerError, "streaming unsupported")
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
		s := g.consoleSnapshot(p)
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
		case <-g.ctx.Done():
			return
		case <-s.changed:
			// A burst of changes (a release takes a lease, a slot and a
			// client at once) is one send.
			time.Sleep(consoleCoalesce)
		case <-tick.C:
		}
	}
}
