// Package router is cluster mode's layer over the lease core: everything
// that forwards to the broker owning a lease, a session or an A2A
// conversation. It serves the HTTP lease routes for leases owned
// elsewhere, relays the client WebSocket through NATS (relay.go, and the
// owner's side in relay_owner.go), offers claims to peers with a free slot
// and re-offers queued ones (claims.go, queue.go), places a resume where
// its session is (resume.go), carries A2A requests and streams to the
// broker holding their conversation (a2a.go, stream.go), and sums the
// cluster-wide listings and caps.
//
// The core asks it through gateway.Router and it reaches the core only
// through Core, the core's exported face: it holds no pointer to the
// gateway and shares no lock with it. Single-broker mode builds none
// (internal/brokerd joins one only with a cluster: block). It may import
// internal/gateway (that face), internal/cluster, internal/a2a,
// internal/auth and internal/config; never the core's internals,
// internal/gateway/spawner, the HTTP face, the A2A door, internal/console,
// internal/brokerd, internal/spawnclient or pkg/spawnrpc
// (internal/gateway's layers_test.go checks it).
package router

import (
	"context"
	"log/slog"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/a2a"
	"github.com/nexus-broker/nexus-broker/internal/auth"
	"github.com/nexus-broker/nexus-broker/internal/cluster"
	"github.com/nexus-broker/nexus-broker/internal/config"
	"github.com/nexus-broker/nexus-broker/internal/gateway"
)

// Core is what the router asks of the lease core (*gateway.Gateway).
type Core interface {
	Context() context.Context
	Config() *config.Config
	AuthEnabled() bool
	Authenticate(w http.ResponseWriter, r *http.Request) (auth.Principal, bool)
	FreeSlots() int
	Load() (slotsInUse, maxConcurrent, queueDepth int)
	OnSlotFreed(f func())
	BinaryNames() []string
	TakeClaim(ctx context.Context, from string, p auth.Principal, body []byte, routed bool) (gateway.PeerClaim, error)
	OfferQueued(serve func(ctx context.Context, p auth.Principal, body []byte) (gateway.PeerClaim, bool)) bool
	HoldsSession(ctx context.Context, session string) bool
	LocalCount(principal string) int
	LocalLeases(p auth.Principal) gateway.LeaseList
	Release(r *http.Request, id string, p auth.Principal) (int, any)
	Ticket(r *http.Request, id string, p auth.Principal) (int, any)
	RedeemTicket(r *http.Request, ticket, lease string) (auth.Principal, bool)
	Attach(r *http.Request, id string, p auth.Principal, fromSeq int64, c gateway.Client, credential string) *gateway.Attachment
	UpgradeClient(w http.ResponseWriter, r *http.Request, id string) (*gateway.ClientSocket, bool)
	CarriedHandler() http.Handler
	HoldsA2A(q gateway.A2AQuery) bool
	A2ATasks(q gateway.TaskQuery) ([]a2a.Task, int)
}

// Router is cluster mode's state: the membership, the brief peer caches,
// and what other brokers carry through this one.
type Router struct {
	core Core
	log  *slog.Logger
	// node is the NATS membership.
	node *cluster.Node
	// capCache holds other brokers' lease counts per principal, briefly.
	capCache *briefCache[int]
	// ctxCache holds which peer holds an A2A conversation, briefly.
	ctxCache *briefCache[string]
	// peerFree carries peers that announced a free slot to reofferQueued.
	peerFree chan string
	// offerAccept is cluster.offer_timeout; offers the claims accepted
	// for peers, spawning.
	offerAccept time.Duration
	offers      offers
	wg          sync.WaitGroup

	mu sync.Mutex
	// relays are the client connections other brokers carry to leases
	// here, by connection id.
	relays map[string]*relayConn
	// streams are the A2A streams other brokers carry from here, by id.
	streams map[string]*carriedStream
}

var _ gateway.Router = (*Router)(nil)

// New builds the router of the broker brokerID over core, from the boot
// configuration's cluster: block. An authentication or configuration error
// is returned; nothing is connected until Start.
func New(core Core, boot *config.Config, brokerID string, log *slog.Logger) (*Router, error) {
	rt := &Router{
		core:     core,
		log:      log,
		capCache: newBriefCache[int](capCacheFor),
		ctxCache: newBriefCache[string](contextCacheFor),
		peerFree: make(chan string, peerFreeBacklog),
		relays:   map[string]*relayConn{},
		streams:  map[string]*carriedStream{},
		offers:   offers{m: map[string]*accepted{}},
	}
	rt.offerAccept = boot.Cluster.OfferTimeout.D()
	if rt.offerAccept <= 0 { // a block not validated
		rt.offerAccept = config.DefaultOfferTimeout
	}
	n, err := cluster.New(cluster.Options{Config: boot.Cluster, BrokerID: brokerID, Advertise: boot.AdvertiseAddr, Log: log,
		Free: core.FreeSlots, PeerFree: rt.peerHasFree, Binaries: core.BinaryNames, Load: rt.load, StateDir: boot.StateDir})
	if err != nil {
		return nil, err
	}
	rt.node = n
	rt.registerOps()
	return rt, nil
}

// Start connects this broker to its peers over NATS. An unreachable NATS
// is retried while the broker serves its own leases.
func (rt *Router) Start() error {
	rt.core.OnSlotFreed(rt.node.BeatNow)
	rt.wg.Add(1)
	go rt.reofferQueued()
	return rt.node.Start()
}

// Close leaves the cluster once the gateway's lifetime ended.
func (rt *Router) Close() {
	rt.wg.Wait()
	rt.node.Close()
}

// NewLeaseID mints a lease id naming this broker as the owner.
func (rt *Router) NewLeaseID() (string, error) { return cluster.NewLeaseID(rt.node.ID()) }

// RemoteOwner is the broker owning lease id when that is not this one.
func (rt *Router) RemoteOwner(id string) string {
	if o := cluster.Owner(id); o != "" && o != rt.node.ID() {
		return o
	}
	return ""
}

// load is this broker's slots and queue, for its heartbeats.
func (rt *Router) load() cluster.Load {
	inUse, max, depth := rt.core.Load()
	return cluster.Load{SlotsInUse: inUse, MaxConcurrent: max, QueueDepth: depth}
}

// SetDraining has the heartbeats say this broker drains, or no longer.
func (rt *Router) SetDraining(on bool) { rt.node.SetDraining(on) }

// Brokers is GET /cluster: this broker, then every one on its list.
func (rt *Router) Brokers() []gateway.BrokerInfo {
	out := []gateway.BrokerInfo{brokerInfo(rt.node.Self())}
	out[0].Self = true
	for _, p := range rt.node.Peers() {
		out = append(out, brokerInfo(p))
	}
	return out
}

func brokerInfo(p cluster.Peer) gateway.BrokerInfo {
	b := gateway.BrokerInfo{BrokerID: p.ID, AdvertiseAddr: p.Advertise, Reachable: p.Reachable, SlotsInUse: p.Load.SlotsInUse,
		MaxConcurrent: p.Load.MaxConcurrent, QueueDepth: p.Load.QueueDepth, Binaries: p.Binaries, Version: p.Version,
		Protocol: p.Protocol, Routed: p.Compatible, Draining: p.Draining}
	if !p.LastHeartbeat.IsZero() {
		at := p.LastHeartbeat.UTC()
		b.LastHeartbeat = &at
	}
	if b.Binaries == nil {
		b.Binaries = []string{}
	}
	return b
}

// Ready is nil while NATS has not failed three times in a row.
func (rt *Router) Ready() error { return rt.node.Ready() }

// Gauges is what /metrics says of the cluster.
func (rt *Router) Gauges() gateway.ClusterGauges {
	c := gateway.ClusterGauges{NATSFailures: rt.node.Failures()}
	for _, r := range cluster.RefusedReasons {
		c.Refused = append(c.Refused, gateway.RefusedCount{Reason: r, N: rt.node.Refused(r)})
	}
	for _, p := range rt.node.Peers() {
		if p.Reachable {
			c.PeersReachable++
		}
	}
	return c
}

// askPeers sends op to every reachable peer at once and hands each answer
// to got, one at a time. It returns the peers that did not answer (the
// unreachable ones included), sorted, never nil.
func askPeers[A any](rt *Router, ctx context.Context, op string, body any, got func(peer string, a A)) []string {
	missing := []string{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, peer := range rt.node.Peers() {
		if !peer.Reachable {
			missing = append(missing, peer.ID)
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			var a A
			err := rt.node.Call(ctx, peer.ID, op, body, &a)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				missing = append(missing, peer.ID)
				return
			}
			got(peer.ID, a)
		}()
	}
	wg.Wait()
	slices.Sort(missing)
	return missing
}

// briefCache keeps what peers answered for at most ttl.
type briefCache[V any] struct {
	ttl time.Duration
	mu  sync.Mutex
	m   map[string]briefEntry[V]
}

type briefEntry[V any] struct {
	v  V
	at time.Time
}

func newBriefCache[V any](ttl time.Duration) *briefCache[V] {
	return &briefCache[V]{ttl: ttl, m: map[string]briefEntry[V]{}}
}

func (c *briefCache[V]) get(key string) (V, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.m[key]
	if !ok || time.Since(e.at) >= c.ttl {
		var zero V
		return zero, false
	}
	return e.v, true
}

// put stores v, dropping what has expired so the cache does not grow with
// every key ever asked about.
func (c *briefCache[V]) put(key string, v V) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for k, e := range c.m {
		if time.Since(e.at) >= c.ttl {
			delete(c.m, k)
		}
	}
	c.m[key] = briefEntry[V]{v: v, at: time.Now()}
}
