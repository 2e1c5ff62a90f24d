package gateway

import (
	"context"
	"encoding/json"
	"net/http"
	"net/url"
	"sort"
	"time"

	"github.com/gorilla/websocket"

	"github.com/nexus-broker/nexus-broker/internal/a2a"
	"github.com/nexus-broker/nexus-broker/internal/auth"
	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/metric"
	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/wire"
)

// --- the cluster router (internal/cluster/router) ---------------------------
//
// In cluster mode the router wraps this face for leases owned elsewhere:
// the core asks it through Router, and it reaches the core only through
// the exported methods of this file. Single-broker mode builds no router:
// JoinCluster is never called, and the core asks nothing.

// Router is the cluster layer as the core asks it.
type Router interface {
	// Start joins the cluster; the router's ops may call the core from then on.
	Start() error
	// Close leaves it, after the gateway's own goroutines ended.
	Close()
	// NewLeaseID mints a lease id (or an A2A task or context id) naming
	// this broker as its owner.
	NewLeaseID() (string, error)
	// RemoteOwner is the broker owning lease id when that is not this one,
	// "" when it is this one.
	RemoteOwner(id string) string
	// ForwardLease answers an HTTP lease route (route: "release",
	// "ticket") for a lease owner owns, as its owner answered it.
	ForwardLease(w http.ResponseWriter, r *http.Request, owner, route string, p auth.Principal)
	// RelayClient serves WS /lease/{id} for a lease owner owns.
	RelayClient(w http.ResponseWriter, r *http.Request, owner, id string)
	// Offerable reports whether a claim body fits one cluster message.
	Offerable(body []byte) bool
	// OfferClaim offers a claim to peers that had a free slot; ok is false
	// when none took it.
	OfferClaim(ctx context.Context, p auth.Principal, body []byte) (_ PeerClaim, ok bool)
	// PeerServes reports whether a reachable peer spawns binary.
	PeerServes(binary string) bool
	// RouteResume sends a resume to the broker holding its session: routed
	// when it did (its answer is the claim's), mine when this broker's
	// host holds the session.
	RouteResume(ctx context.Context, p auth.Principal, session string, body []byte) (_ PeerClaim, routed, mine bool)
	// PeerLeaseCount is principal's leases on the other brokers.
	PeerLeaseCount(principal string) int
	// Leases is GET /leases over every broker, local being this one's.
	Leases(ctx context.Context, p auth.Principal, local LeaseList) LeaseList
	// Ready is nil while the cluster transport serves.
	Ready() error
	// Gauges is what /metrics says of the cluster.
	Gauges() ClusterGauges
	// A2AOwner is the peer holding what q names, "" for none (this broker
	// answers); unsure when a broker that may hold it did not answer.
	A2AOwner(ctx context.Context, q A2AQuery) (owner string, unsure bool)
	// CarryA2A has owner answer an A2A request (body read whole) as p,
	// streamed back when stream is set; refuse answers owner loss.
	CarryA2A(w http.ResponseWriter, r *http.Request, owner string, p auth.Principal, body []byte, stream bool, refuse func(http.ResponseWriter))
	// GatherTasks asks every peer for its share of a ListTasks, handing
	// each answer to got one at a time, and returns the peers that did not
	// answer, sorted.
	GatherTasks(ctx context.Context, q TaskQuery, got func(tasks []a2a.Task, total int)) []string
	// SetDraining has the heartbeats say this broker drains (and offer
	// no free slot), or no longer.
	SetDraining(on bool)
	// Brokers is GET /cluster: this broker, then every one on its
	// membership list.
	Brokers() []BrokerInfo
}

// BrokerInfo is one broker of GET /cluster, as its last heartbeat said
// (this broker: as its next one will).
type BrokerInfo struct {
	BrokerID      string     `json:"broker_id"`
	Self          bool       `json:"self,omitempty"`
	AdvertiseAddr string     `json:"advertise_addr"`
	LastHeartbeat *time.Time `json:"last_heartbeat"`
	// Reachable is a current heartbeat of a protocol this broker routes
	// to; Routed says whether the protocol is one.
	Reachable     bool     `json:"reachable"`
	SlotsInUse    int      `json:"slots_in_use"`
	MaxConcurrent int      `json:"max_concurrent"`
	QueueDepth    int      `json:"queue_depth"`
	Binaries      []string `json:"binaries"`
	Version       string   `json:"version"`
	Protocol      int      `json:"protocol"`
	Routed        bool     `json:"routed"`
	Draining      bool     `json:"draining"`
}

// JoinCluster has Start build the cluster router, with the broker id
// spawnd reports, before the port opens. Call it before Start.
func (g *Gateway) JoinCluster(join func(brokerID string) (Router, error)) { g.join = join }

// What the router answers and closes with, in the core's words.
const (
	TextOwnerUnavailable = "lease owner unavailable"
	// TextUnknownLease is the 404 of a lease that is not the caller's, or none.
	TextUnknownLease = errUnknownLease
	CodeSuperseded   = wire.CodeSuperseded
	CloseSuperseded  = wire.CloseSuperseded
	CloseRestarting  = wire.CloseRestarting
	// FinishFlush bounds how long a finishing client is written what the
	// lease produced.
	FinishFlush = finishFlush
	// The credentials the connection log names.
	CredentialAnonymous = credentialAnonymous
	CredentialBearer    = credentialBearer
	CredentialTicket    = credentialTicket
)

// LeaseGone is the close a carrier gives a client whose attachment is no
// longer here.
var LeaseGone = CloseReq{Code: websocket.CloseGoingAway, Reason: wire.CloseLeaseClosed}

// Forwarded stands for a request another broker carried, for the audit
// line: the route, and the broker it came through as the peer.
func Forwarded(method, path, from string) *http.Request { return forwarded(method, path, from) }

// Load is this broker's slots in use of max_concurrent, and its queue.
func (g *Gateway) Load() (slotsInUse, maxConcurrent, queueDepth int) {
	maxConcurrent, slotsInUse, queueDepth, _ = g.cap.Snapshot()
	return slotsInUse, maxConcurrent, queueDepth
}

// FreeSlots is how many capacity slots are free now.
func (g *Gateway) FreeSlots() int { return g.cap.Free() }

// OnSlotFreed has f called when a slot frees with nobody queued for it.
func (g *Gateway) OnSlotFreed(f func()) { g.cap.SetOnFree(f) }

// BinaryNames is spawnd's registry entries, sorted.
func (g *Gateway) BinaryNames() []string { return g.binaryNames() }

// LeaseList is GET /leases' answer.
type LeaseList struct {
	MaxConcurrent *int        `json:"max_concurrent,omitempty"`
	SlotsInUse    *int        `json:"slots_in_use,omitempty"`
	QueueDepth    *int        `json:"queue_depth,omitempty"`
	MaxQueueDepth *int        `json:"max_queue_depth,omitempty"`
	Leases        []LeaseInfo `json:"leases"`
	// UnreachableBrokers (cluster mode only) names the brokers that did not
	// answer: their leases and aggregates are missing from the rest.
	UnreachableBrokers *[]string `json:"unreachable_brokers,omitempty"`
}

// LocalLeases is this broker's part of GET /leases for p. An operator
// (auth.admin_scope, or every caller without auth) sees every lease and
// the aggregates; anyone else only their own leases, the aggregates absent
// rather than zeroed.
func (g *Gateway) LocalLeases(p auth.Principal) LeaseList {
	if !g.auth.IsAdmin(p) {
		return LeaseList{Leases: g.Leases(p.ID, false)}
	}
	max, inUse, depth, maxDepth := g.cap.Snapshot()
	return LeaseList{
		MaxConcurrent: &max, SlotsInUse: &inUse, QueueDepth: &depth, MaxQueueDepth: &maxDepth,
		Leases: g.Leases("", true),
	}
}

// LocalCount is principal's live leases here plus its claims in flight.
func (g *Gateway) LocalCount(principal string) int { return g.localCount(principal) }

// Ticket is POST /ticket/{id} on the lease's owner, as Release is.
func (g *Gateway) Ticket(r *http.Request, id string, p auth.Principal) (int, any) {
	return g.ticket(r, id, p)
}

// RedeemTicket spends a ticket for lease, minted here, and returns its
// principal; a refusal is audited against r.
func (g *Gateway) RedeemTicket(r *http.Request, ticket, lease string) (auth.Principal, bool) {
	p, ok := g.tickets.Redeem(ticket, lease)
	if !ok {
		g.denied(r, p.ID, http.StatusUnauthorized, auth.TextRejected, ticketDenial)
	}
	return p, ok
}

// PeerClaim is a claim's answer as it crosses between brokers: declined
// (no free slot for an offer), or the HTTP status, and the claim or the
// refusal.
type PeerClaim struct {
	Declined bool            `json:"declined,omitempty"`
	Status   int             `json:"status,omitempty"`
	Error    string          `json:"error,omitempty"`
	Outcome  string          `json:"outcome,omitempty"`
	Claim    json.RawMessage `json:"claim,omitempty"`
	// Peer is the broker that answered, for the log.
	Peer string `json:"-"`
}

// LeaseID is the lease a claim answer granted, "" for none.
func (a PeerClaim) LeaseID() string {
	var c struct {
		LeaseID string `json:"lease_id"`
	}
	if a.Status != http.StatusOK || json.Unmarshal(a.Claim, &c) != nil {
		return ""
	}
	return c.LeaseID
}

// acceptKey carries an offer's accept hook in a claim's context.
type acceptKey struct{}

// WithAccept has an offered claim run with ctx call accepted once it holds
// its slot, before the spawn: the offering broker is answered then.
func WithAccept(ctx context.Context, accepted func()) context.Context {
	return context.WithValue(ctx, acceptKey{}, accepted)
}

// accepted calls ctx's accept hook, if any.
func accepted(ctx context.Context) {
	if f, ok := ctx.Value(acceptKey{}).(func()); ok {
		f()
	}
}

// TakeClaim serves a claim another broker sent here: an offer from a full
// broker (a free slot now, or declined; WithAccept hears of the slot), or
// a resume routed here, where its session is (queued as any claim, never
// sent on).
func (g *Gateway) TakeClaim(ctx context.Context, from string, p auth.Principal, body []byte, routed bool) (PeerClaim, error) {
	slot := slotOffered
	if routed {
		slot = slotRouted
	}
	r := forwarded(http.MethodPost, "/claim", from).WithContext(ctx)
	resp, cerr := g.claimBody(r, p, body, slot)
	switch {
	case cerr != nil && cerr.outcome == outcomeDeclined:
		return PeerClaim{Declined: true}, nil
	case cerr != nil:
		return PeerClaim{Status: cerr.status, Error: cerr.text, Outcome: cerr.outcome}, nil
	}
	g.log.Info("claim accepted for a peer", "peer", from, "lease_id", resp.LeaseID, "principal_id", p.ID)
	raw, err := json.Marshal(resp)
	return PeerClaim{Status: http.StatusOK, Claim: raw}, err
}

// OfferQueued hands the oldest queued claim a peer may serve to serve, and
// reports whether serve took it: the claim's answer is then serve's.
func (g *Gateway) OfferQueued(serve func(ctx context.Context, p auth.Principal, body []byte) (PeerClaim, bool)) bool {
	w := g.cap.NextOffer()
	if w == nil {
		return false
	}
	o := w.Offer()
	a, served := serve(o.ctx, o.principal, o.body)
	if served {
		o.resp, o.cerr = g.peerClaimed(a)
	}
	g.cap.OfferEnded(w, served)
	return served
}

// HoldsSession reports whether this host's session index (or a live
// lease) has the session. A spawnd that cannot be asked holds nothing.
func (g *Gateway) HoldsSession(ctx context.Context, session string) bool {
	b, err := g.sp.Binding(ctx, session, "")
	return err == nil && b.Entry != ""
}

// ClusterGauges is what /metrics says of the cluster.
type ClusterGauges = metric.Cluster

// RefusedCount is one reason's count of refused cluster messages.
type RefusedCount = metric.RefusedCount

// ClientSocket is a client's WebSocket, accepted by the core.
type ClientSocket struct{ *wire.Conn }

// UpgradeClient accepts WS /lease/{id}'s handshake for a lease another
// layer serves; on false it has logged the refusal.
func (g *Gateway) UpgradeClient(w http.ResponseWriter, r *http.Request, id string) (*ClientSocket, bool) {
	conn, err := wire.Upgrader.Upgrade(w, r, nil)
	if err != nil {
		g.logAcceptFailed("client", r, err)
		return nil, false
	}
	return &ClientSocket{wire.NewConn(conn, g.log, "client", id)}, true
}

// ServeCarried has the requests other brokers carry here served by mux,
// the HTTP layer's routes (internal/httpapi.Handler), unwrapped by its
// host guard: a carried request comes from a peer broker, not a browser.
func (g *Gateway) ServeCarried(mux *http.ServeMux) { g.mux.Store(mux) }

// CarriedHandler is the mux ServeCarried named, for requests other brokers
// carry here; nil until then.
func (g *Gateway) CarriedHandler() http.Handler {
	if mux := g.mux.Load(); mux != nil {
		return mux
	}
	return nil
}

type forwardedKey struct{}

// Carried marks a request's context as carried here by another broker,
// which authenticated p (never set from the network).
func Carried(ctx context.Context, p auth.Principal) context.Context {
	return context.WithValue(ctx, forwardedKey{}, p)
}

// forwardedPrincipal is the principal of a request another broker
// authenticated and carried here.
func forwardedPrincipal(ctx context.Context) (auth.Principal, bool) {
	p, ok := ctx.Value(forwardedKey{}).(auth.Principal)
	return p, ok
}

// A2AQuery asks whether a broker holds a conversation (Context) or a task
// (Task), in the caller's scope.
type A2AQuery struct {
	Principal string `json:"principal"`
	Profile   string `json:"profile"`
	Context   string `json:"context,omitempty"`
	Task      string `json:"task,omitempty"`
}

// TaskQuery is a ListTasks a broker answers its share of: the first Limit
// of the caller's matching tasks.
type TaskQuery struct {
	Principal string          `json:"principal"`
	Profile   string          `json:"profile"`
	Req       a2a.ListRequest `json:"req"`
	Limit     int             `json:"limit"`
}

// ServeA2A has the A2A door answer the router's questions of this broker:
// holds (does it hold what q names) and tasks (its share of a ListTasks).
// Call it before Start.
func (g *Gateway) ServeA2A(holds func(A2AQuery) bool, tasks func(TaskQuery) ([]a2a.Task, int)) {
	g.a2aHolds, g.a2aTasks = holds, tasks
}

// HoldsA2A reports whether this broker holds what q names.
func (g *Gateway) HoldsA2A(q A2AQuery) bool { return g.a2aHolds != nil && g.a2aHolds(q) }

// A2ATasks is this broker's share of a ListTasks: the first q.Limit of the
// matching tasks, and how many match.
func (g *Gateway) A2ATasks(q TaskQuery) ([]a2a.Task, int) {
	if g.a2aTasks == nil {
		return []a2a.Task{}, 0
	}
	return g.a2aTasks(q)
}

// Cluster is the cluster router once Start built it, nil in single-broker
// mode (and before Start).
func (g *Gateway) Cluster() Router { return g.rt }

// IsCarried says whether r is a request another broker carried here.
func IsCarried(r *http.Request) bool {
	_, ok := forwardedPrincipal(r.Context())
	return ok
}

// Identify verifies r's credential without answering r: the caller's
// principal, or the refusal Authenticate would answer and audit.
func (g *Gateway) Identify(r *http.Request) (auth.Principal, *auth.Refusal) {
	return g.auth.Authenticate(r)
}

// The core's side of cluster mode: where a lease route, a claim or a
// listing turns to the router (Router) when there is one.

// outcomeDeclined is an offered claim a peer had no free slot for.
const outcomeDeclined = "declined"

// slotMode says how a claim gets its capacity slot.
type slotMode int

const (
	slotAcquire slotMode = iota // take one, queueing under queue_wait_timeout
	slotOffered                 // a peer's offer: a free slot now, or decline
	slotRouted                  // a resume routed here, where its session is: as slotAcquire, never sent on
)

// queuedOffer is a queued claim a peer may serve instead: what to offer,
// and the peer's answer once it served it.
type queuedOffer struct {
	// ctx is the claimant's: an offer is abandoned when it hangs up.
	ctx       context.Context
	principal auth.Principal
	body      []byte
	resp      *ClaimAnswer
	cerr      *claimError
}

// remoteOwner is the broker owning lease id when that is not this one.
func (g *Gateway) remoteOwner(id string) string {
	if g.rt == nil {
		return ""
	}
	return g.rt.RemoteOwner(id)
}

// forwarded stands for a request another broker carried, for the audit
// line: the route, and the broker it came through as the peer.
func forwarded(method, path, from string) *http.Request {
	return &http.Request{Method: method, URL: &url.URL{Path: path}, RemoteAddr: "broker " + from}
}

// peerClaimed is the claim answer a peer gave: its lease, or its refusal.
func (g *Gateway) peerClaimed(a PeerClaim) (*ClaimAnswer, *claimError) {
	if a.Status != http.StatusOK {
		return nil, &claimError{status: a.Status, text: a.Error, outcome: a.Outcome}
	}
	var resp ClaimAnswer
	if err := json.Unmarshal(a.Claim, &resp); err != nil {
		g.log.Warn("cluster: a peer's claim answer was unreadable", "peer", a.Peer, "error", err)
		return nil, refuse(http.StatusBadGateway, "spawn_failed", "a peer's claim answer was unreadable")
	}
	return &resp, nil
}

// localCount is principal's live leases here plus its claims in flight.
func (g *Gateway) localCount(principal string) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.localCountLocked(principal)
}

func (g *Gateway) localCountLocked(principal string) int {
	n := g.claiming[principal]
	for _, l := range g.leases {
		if l.ownedBy(principal) {
			n++
		}
	}
	return n
}

// SortLeases orders GET /leases: oldest first, then by id.
func SortLeases(ls []LeaseInfo) {
	sort.Slice(ls, func(i, j int) bool {
		if !ls[i].CreatedAt.Equal(ls[j].CreatedAt) {
			return ls[i].CreatedAt.Before(ls[j].CreatedAt)
		}
		return ls[i].LeaseID < ls[j].LeaseID
	})
}
