package gateway

import (
	"context"
	"encoding/json"
	"net"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/auth"
	"github.com/nexus-broker/nexus-broker/internal/config"
	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/streamlog"
	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/wire"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// This file (with api_router.go, the part only the cluster router uses) is
// the lease core's face to the layers above it (the A2A door, the
// cluster router, the HTTP face, the console), but for the entry points
// that sit with their logic: ClaimRequest and CountClaim (claim.go),
// Routes (gateway.go), NotReady (release.go) and WriteMetrics
// (metrics.go). Nothing else of the core is theirs to call, and its
// internals (internal/gateway/internal) are out of their reach by the
// compiler. The face is
//
//   - Claim (and ClaimRequest, POST /claim's, with CountClaim) and Release:
//     start a lease through the one spawn spine (admission, the capacity
//     queue, the claims metric) and end one;
//   - Lease, the handle on one lease: Send a payload to its instance, Follow its
//     io payloads and its end, and Attach a client to its stream at a cursor;
//   - Leases (the leases a caller sees), Binaries, Pools, Capacity, Config;
//   - Subscribe: the lease events (claimed, released, crashed, reaped,
//     evicted, a client coming or going);
//   - Mount, Routes, Authenticate, Admit, Audit, BaseURL and
//     StreamConn: the routes of the layers above and the guard every route
//     goes through;
//   - NotReady and WriteMetrics: what GET /readyz and GET /metrics say.

// --- leases -----------------------------------------------------------------

// Lease is a layer's handle on one lease. There is one per lease, so a
// *Lease may key a map.
type Lease struct{ l *lease }

// handle is l's one *Lease.
func (l *lease) handle() *Lease { return &l.face }

// ID is the lease id.
func (h *Lease) ID() string { return h.l.id }

// Draining says whether the lease's teardown began.
func (h *Lease) Draining() bool { return h.l.currentState() == stateDraining }

// EndedHow words how the lease's instance ended (its exit status or signal
// after a crash, else the teardown reason), for a caller whose turn it left
// unfinished.
func (h *Lease) EndedHow() string { return h.l.endedHow() }

// Send counts payload (an io payload) as client input now, restarting the
// lease's idle clock, and returns the write of its io frame to the
// instance. The write blocks while a slow instance does not read, so call
// it outside the caller's own locks.
func (h *Lease) Send(payload json.RawMessage) (write func()) {
	l := h.l
	data := ioFrame(l.id, payload)
	l.clientInput()
	return func() { l.sendToInstance(data, false) }
}

// ioFrame is the io frame carrying payload to the instance of lease id.
func ioFrame(id string, payload json.RawMessage) []byte {
	data, _ := brokerframe.Encode(brokerframe.Frame{Signal: brokerframe.SignalIO, LeaseID: id, Payload: payload})
	return data
}

// InputFits says whether payload, an io payload, fits max_client_frame as
// the io frame the instance of h would be written (h nil: the instance of a
// lease this gateway would mint, whose id is as long): size is that frame's
// length and limit the key's value. A layer above refuses what does not
// fit, as WS /lease/{id} closes with 1009 on such a frame.
func (g *Gateway) InputFits(h *Lease, payload json.RawMessage) (size, limit int, fits bool) {
	var id string
	if h != nil {
		id = h.l.id
	} else {
		id, _ = g.newLeaseID() // its length is what counts
	}
	size, limit = len(ioFrame(id, payload)), int(g.cfg.Load().MaxClientFrame)
	return size, limit, size <= limit
}

// Follower follows one lease for a layer above (Follow).
type Follower interface {
	// Payload is called on the instance's read pump, in order, for every io
	// payload.
	Payload(l *Lease, p json.RawMessage)
	// Closed is called once by the teardown, after the instance's socket
	// drained and before the lease is gone.
	Closed(l *Lease)
	// SessionRecorded is called when spawnd recorded a session id the
	// instance reported, however late after the claim.
	SessionRecorded(l *Lease, id string)
}

// Followed is a lease as Follow found it, in the step that made f its
// follower: a status or session id reported later reaches f instead.
type Followed struct {
	// Reported is the last turn state (idle or a work state) the instance
	// reported to this process, "" before its first.
	Reported  string
	SessionID string
	PID       int64
	// Binary is the entry the lease runs.
	Binary string
}

// Follow makes f the lease's one follower.
func (h *Lease) Follow(f Follower) Followed {
	l := h.l
	l.mu.Lock()
	defer l.mu.Unlock()
	l.follower = f
	return Followed{Reported: l.reported, SessionID: l.sessionID, PID: l.pid, Binary: l.entry}
}

// ClaimSpec is a claim made by a layer above rather than POST /claim.
type ClaimSpec struct {
	Principal string
	// Binary is the entry asked for; a resumed session's recorded entry
	// wins over none and refuses another, as POST /claim's does.
	Binary string
	Config []byte
	// Session, when set, is resumed with -recall.
	Session string
}

// ClaimError is why a claim was refused: the HTTP status POST /claim would
// answer, and its text.
type ClaimError struct {
	Status int
	Text   string
	// Outcome is the claims metric's (CountClaim), Cause the underlying
	// error, for the log only.
	Outcome, Cause string
	// RetryAfter, when set, is the answer's Retry-After (seconds).
	RetryAfter int
}

// Claim outcomes and texts a layer above answers with.
const (
	// OutcomeRejected is a claim refused for what it asked (or who asked).
	OutcomeRejected = "rejected"
	// OutcomeCancelled is a claim whose client went away.
	OutcomeCancelled = "cancelled"
	// TextInvalidClaimBody is the 400 of a claim body that is not one.
	TextInvalidClaimBody = "invalid claim body"
)

// Claim admits and spawns a lease as POST /claim does (the per-principal
// caps, the capacity queue, ready_timeout, the claims metric), for as long
// as the gateway runs: the caller's context does not bound it.
func (g *Gateway) Claim(s ClaimSpec) (*Lease, *ClaimError) {
	start := time.Now()
	entry, cerr := g.resumeEntry(g.ctx, s.Principal, s.Session, s.Binary)
	var l *lease
	if cerr == nil {
		l, cerr = g.spawnLease(g.ctx, s.Principal, entry, s.Config, s.Session, slotAcquire, nil)
	}
	if ce := cerr.face(); ce != nil {
		g.CountClaim(start, ce)
		return nil, ce
	}
	g.CountClaim(start, nil)
	return l.handle(), nil
}

// Release is POST /release/{id} on the lease's owner: p's live lease id is
// torn down (answered at once, and carried out by spawnd, while spawnd does
// not answer). It returns the status and body to answer; a lease that is
// not p's is the uniform 404, audited against r.
func (g *Gateway) Release(r *http.Request, id string, p auth.Principal) (int, any) {
	return g.release(r, id, p)
}

// SessionLease is principal's live lease running session, nil for none.
func (g *Gateway) SessionLease(principal, session string) *Lease {
	if l := g.sessionLease(principal, session); l != nil {
		return l.handle()
	}
	return nil
}

// --- clients attached at a cursor -------------------------------------------

// Client is a connection a layer above attaches to a lease's stream
// (Attach): the core says when it must close.
type Client interface {
	// Finish closes after the lease's stream, as far as it goes, was read.
	Finish(code int, reason string)
	// Displace closes at once with 4501: a newer connection took over.
	Displace()
	// GoAway closes with 1001 at gateway shutdown.
	GoAway()
}

// Attachment is a Client's place in a lease's stream.
type Attachment struct {
	l *lease
	c *outsideClient
	// resumed: attached with fromSeq >= 0, so told about frames evicted
	// before it read them, as WS /lease/{id} tells a resuming client.
	resumed bool
}

// outsideClient is a Client as a lease streams to it.
type outsideClient struct {
	Client
	mu  sync.Mutex
	cur *streamlog.Cursor
	gap *brokerframe.StreamGap
}

func (c *outsideClient) place(cur *streamlog.Cursor, gap *brokerframe.StreamGap) {
	c.mu.Lock()
	c.cur, c.gap = cur, gap
	c.mu.Unlock()
}

// notify and flushHeld need nothing: a reader waits on the stream log
// itself (Attachment.Read).
func (c *outsideClient) notify(bool)                    {}
func (c *outsideClient) flushHeld()                     {}
func (c *outsideClient) finish(code int, reason string) { c.Finish(code, reason) }
func (c *outsideClient) displace()                      { c.Displace() }
func (c *outsideClient) goAway()                        { c.GoAway() }

// Attach makes c p's lease id's client, the newest connection winning as
// for WS /lease/{id}: fromSeq < 0 starts at the stream's end, else after
// seq fromSeq (what a resuming client last read). credential names how p
// proved itself, for the log. It returns nil for a lease that is not p's
// (audited against r), draining, or where c was displaced on arrival.
func (g *Gateway) Attach(r *http.Request, id string, p auth.Principal, fromSeq int64, c Client, credential string) *Attachment {
	l := g.owned(r, id, p)
	if l == nil {
		return nil
	}
	oc := &outsideClient{Client: c}
	if !g.attachClient(l, oc, 0, fromSeq, p.ID, credential) {
		return nil
	}
	return &Attachment{l: l, c: oc, resumed: fromSeq >= 0}
}

// Lease is the lease a is attached to.
func (a *Attachment) Lease() *Lease { return a.l.handle() }

// Seq is the last seq a's cursor passed.
func (a *Attachment) Seq() uint64 {
	a.c.mu.Lock()
	defer a.c.mu.Unlock()
	return a.c.cur.Seq()
}

// Gap is, once, the notice (a whole frame, counted) that the frames a
// resuming client asked for are gone; nil when none are.
func (a *Attachment) Gap() []byte {
	a.c.mu.Lock()
	gap := a.c.gap
	a.c.gap = nil
	a.c.mu.Unlock()
	if gap == nil {
		return nil
	}
	a.l.g.m.ReplayGaps.Inc(gap.Reason)
	return streamlog.GapFrame(a.l.id, gap)
}

// Frame is one frame of a lease's stream.
type Frame = streamlog.Entry

// Read follows the lease's frames: up to max after the cursor, appended to
// buf, and the cursor moved past them. When none is there yet it returns
// none and wake, closed once one is. Frames evicted before they were read
// are skipped, with the last seq they covered (through), and for a client
// that resumed returned as the gap notice evicted (a whole frame,
// counted).
func (a *Attachment) Read(buf []Frame, max int) (frames []Frame, evicted []byte, through uint64, wake <-chan struct{}) {
	a.c.mu.Lock()
	cur := a.c.cur
	a.c.mu.Unlock()
	frames, missFrom, missThrough, wake := a.l.log.ReadBatch(cur, buf, max, true)
	if missFrom > 0 {
		if a.resumed {
			evicted = a.l.g.evictedGap(a.l.id, missFrom, missThrough)
		}
		return nil, evicted, missThrough, nil
	}
	return frames, nil, 0, wake
}

// Advance releases the frames up to seq for eviction: the client has them.
func (a *Attachment) Advance(seq uint64) {
	a.c.mu.Lock()
	cur := a.c.cur
	a.c.mu.Unlock()
	a.l.log.Advance(cur, seq)
}

// Pending says whether frames after the cursor remain to be read.
func (a *Attachment) Pending() bool {
	a.c.mu.Lock()
	cur := a.c.cur
	a.c.mu.Unlock()
	return a.l.log.HasAfter(cur)
}

// Send delivers the client's messages to the instance, in order, as WS
// /lease/{id} delivers them (only io travels client → instance). A message
// over max_client_frame is not delivered, nor any after it: the client is
// finished with 1009 naming the limit, and Send reports false.
func (a *Attachment) Send(msgs [][]byte) bool {
	var held *instanceConn
	var refused *CloseReq
	for _, m := range msgs {
		var ic *instanceConn
		if ic, refused = a.l.fromClient(m, true); ic != nil {
			held = ic
		}
		if refused != nil {
			break
		}
	}
	if held != nil {
		a.l.flushInstance(held)
	}
	if refused != nil {
		a.c.Finish(refused.Code, refused.Reason)
		return false
	}
	return true
}

// Detach ends the attachment: the connection went away.
func (a *Attachment) Detach() {
	a.c.mu.Lock()
	cur := a.c.cur
	a.c.mu.Unlock()
	a.l.g.detachClient(a.l, a.c, cur)
}

// --- listings ---------------------------------------------------------------

// BinaryInfo is one entry of GET /binaries.
type BinaryInfo struct {
	Name        string  `json:"name"`
	Label       *string `json:"label,omitempty"`       // nil: unset, omitted; "" is kept
	Description *string `json:"description,omitempty"` // likewise
}

// Binaries lists the entries spawnd offers, by name: never a path.
func (g *Gateway) Binaries() []BinaryInfo {
	bs := *g.binaries.Load()
	out := make([]BinaryInfo, len(bs))
	for i, b := range bs {
		out[i] = BinaryInfo{Name: b.Name, Label: b.Label, Description: b.Description}
	}
	return out
}

// LeaseInfo is one row of GET /leases.
type LeaseInfo struct {
	LeaseID      string    `json:"lease_id"`
	SessionID    string    `json:"session_id,omitempty"`
	PID          int64     `json:"pid"`
	State        string    `json:"state"`
	Binary       string    `json:"binary"`
	Reason       string    `json:"reason,omitempty"`
	LastActivity time.Time `json:"last_activity"`
	CreatedAt    time.Time `json:"created_at"`
	// Pool names the pool of a warm lease nobody claimed yet, which only
	// an operator's listing holds.
	Pool string `json:"pool,omitempty"`
	// For the console only: GET /leases discloses neither.
	Principal      string `json:"-"`
	ClientAttached bool   `json:"-"`
}

// Leases lists the live leases owner sees, oldest first; all of them when
// all is set.
func (g *Gateway) Leases(owner string, all bool) []LeaseInfo {
	ls := slices.DeleteFunc(g.liveLeases(), func(l *lease) bool { return !all && !l.ownedBy(owner) })
	out := make([]LeaseInfo, 0, len(ls))
	for _, l := range ls {
		l.mu.Lock()
		out = append(out, LeaseInfo{
			LeaseID: l.id, SessionID: l.sessionID, PID: l.pid, State: l.state, Binary: l.entry,
			Reason: l.reason, LastActivity: l.lastActivity.UTC(), CreatedAt: l.createdAt.UTC(), Pool: l.warm.pool,
			Principal: l.principal, ClientAttached: l.client != nil,
		})
		l.mu.Unlock()
	}
	SortLeases(out)
	return out
}

// PoolInfo is one warm pool in force, for the console.
type PoolInfo struct {
	Name    string `json:"name"`
	Binary  string `json:"binary"`
	Idle    int    `json:"idle"`
	MinIdle int    `json:"min_idle"`
}

// Pools lists the pools in force, as declared.
func (g *Gateway) Pools() []PoolInfo {
	stats := g.pools.m.Stats()
	out := make([]PoolInfo, len(stats))
	for i, s := range stats {
		out[i] = PoolInfo{Name: s.Name, Binary: s.Entry, Idle: s.Idle, MinIdle: s.MinIdle}
	}
	return out
}

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

// Config is the configuration in force.
func (g *Gateway) Config() *config.Config { return g.cfg.Load() }

// Done is closed when the gateway shuts down.
func (g *Gateway) Done() <-chan struct{} { return g.ctx.Done() }

// Context ends when the gateway shuts down.
func (g *Gateway) Context() context.Context { return g.ctx }

// StateDraining is the state LeaseInfo names a lease whose teardown began.
const StateDraining = stateDraining

// --- lease events -----------------------------------------------------------

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

// --- layers ------------------------------------------------------------------

// Layer is a layer above the core that starts, reloads and stops with it
// (the A2A door).
type Layer interface {
	// Start runs in Start once spawnd answered, before the leases spawnd
	// holds are restored; an error fails the start.
	Start() error
	// Reload checks next, before spawnd is asked to reload; an error
	// rejects the reload. apply puts next in force once the reload applies.
	Reload(next *config.Config) (apply func(), err error)
	// Stop runs in Shutdown once the core stopped.
	Stop()
}

// Extend has l start, reload and stop with the core. Extend before Start.
func (g *Gateway) Extend(l Layer) { g.layers = append(g.layers, l) }

// --- routes and the guard ---------------------------------------------------

// Mount adds routes of a layer above the core to the HTTP layer's mux
// (Routes). Mount before Routes.
func (g *Gateway) Mount(routes func(*http.ServeMux)) { g.mounts = append(g.mounts, routes) }

// Authenticate verifies r's credential against the auth: block and returns
// the caller's principal. On a refusal it has already answered r (401, or
// 503 with Retry-After) and written the audit line, and returns false.
// Without an auth: block every caller is the anonymous principal.
func (g *Gateway) Authenticate(w http.ResponseWriter, r *http.Request) (auth.Principal, bool) {
	return g.authenticate(w, r, false)
}

// Admit authenticates r, as an operator (auth.admin_scope) when admin is
// set. On false it has answered.
func (g *Gateway) Admit(w http.ResponseWriter, r *http.Request, admin bool) (auth.Principal, bool) {
	return g.authenticate(w, r, admin)
}

// Audit logs a refusal of r to p as every route's refusals are logged,
// with attrs (slog's key-value pairs) before the peer.
func (g *Gateway) Audit(r *http.Request, p auth.Principal, status int, reason string, attrs ...any) {
	g.audit(r, p, status, reason, attrs...)
}

// AuthEnabled says whether the broker authenticates its callers.
func (g *Gateway) AuthEnabled() bool { return g.auth.Enabled() }

// BaseURL is the origin this broker advertises (advertise_addr, else its
// listen address), http or https as it serves.
func (g *Gateway) BaseURL() string { return g.origin("http", "https") }

// StreamConn is the connection r came on and the measure of its send room,
// for a layer streaming an answer (an SSE stream) to pace itself as the
// core's own sockets do.
func StreamConn(r *http.Request) (net.Conn, func(net.Conn) (int, bool)) {
	conn, _ := wire.ConnOf(r.Context())
	return conn, wire.SendRoom
}
