package gateway

import (
	"context"
	"encoding/json"
	"math/rand/v2"
	"net/http"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/auth"
	"github.com/nexus-broker/nexus-broker/internal/cluster"
)

// joinCluster connects this broker to its peers over NATS (cluster mode).
// An authentication or configuration error refuses the boot; an
// unreachable NATS is retried while the broker serves its own leases.
func (g *Gateway) joinCluster(brokerID string) error {
	rt := &router{
		capCache: newBriefCache[int](capCacheFor),
		ctxCache: newBriefCache[string](contextCacheFor),
		peerFree: make(chan string, peerFreeBacklog),
		relays:   map[string]*relayConn{},
		streams:  map[string]*carriedStream{},
	}
	n, err := cluster.New(cluster.Options{Config: g.boot.Cluster, BrokerID: brokerID, Advertise: g.boot.AdvertiseAddr, Log: g.log,
		Free: g.cap.Free, PeerFree: rt.peerHasFree, Binaries: g.binaryNames})
	if err != nil {
		return err
	}
	g.registerClusterOps(n)
	// Set before the first request can arrive: the ops read it.
	rt.node = n
	g.rt = rt
	g.cap.SetOnFree(n.BeatNow)
	g.wg.Add(1)
	go g.reofferQueued()
	return n.Start()
}

// clusterLeases is GET /leases in cluster mode: every broker asked at once
// within one deadline, the leases of those that answered, their aggregates
// summed, and the others named.
func (g *Gateway) clusterLeases(ctx context.Context, p auth.Principal) leasesJSON {
	out := g.localLeases(p)
	unreachable := askPeers(g, ctx, opLeases, leaseCall{Principal: p}, func(_ string, theirs leasesJSON) {
		out.Leases = append(out.Leases, theirs.Leases...)
		for _, sum := range [][2]*int{{out.MaxConcurrent, theirs.MaxConcurrent}, {out.SlotsInUse, theirs.SlotsInUse},
			{out.QueueDepth, theirs.QueueDepth}, {out.MaxQueueDepth, theirs.MaxQueueDepth}} {
			if sum[0] != nil && sum[1] != nil {
				*sum[0] += *sum[1]
			}
		}
	})
	sortLeases(out.Leases)
	out.UnreachableBrokers = &unreachable
	return out
}

// sortLeases orders GET /leases: oldest first, then by id.
func sortLeases(ls []LeaseInfo) {
	sort.Slice(ls, func(i, j int) bool {
		if !ls[i].CreatedAt.Equal(ls[j].CreatedAt) {
			return ls[i].CreatedAt.Before(ls[j].CreatedAt)
		}
		return ls[i].LeaseID < ls[j].LeaseID
	})
}

// outcomeDeclined is an offered claim a peer had no free slot for.
const outcomeDeclined = "declined"

// slotMode says how a claim gets its capacity slot.
type slotMode int

const (
	slotAcquire slotMode = iota // take one, queueing under queue_wait_timeout
	slotOffered                 // a peer's offer: a free slot now, or decline
	slotRouted                  // a resume routed here, where its session is: as slotAcquire, never sent on
)

// offerCall is a claim a full broker offers a peer: the caller's principal
// and the claim body as the caller sent it.
type offerCall struct {
	Principal auth.Principal  `json:"principal"`
	Claim     json.RawMessage `json:"claim"`
}

type offerAnswer struct {
	Declined bool            `json:"declined,omitempty"`
	Status   int             `json:"status,omitempty"`
	Error    string          `json:"error,omitempty"`
	Outcome  string          `json:"outcome,omitempty"`
	Claim    json.RawMessage `json:"claim,omitempty"`
}

// offerTimeout bounds an offered claim: a spawn, the instance's boot and
// its session report.
func (g *Gateway) offerTimeout() time.Duration {
	cfg := g.cfg.Load()
	return cfg.ReadyTimeout.D() + cfg.SessionReportGrace.D() + 30*time.Second
}

// resumeTimeout bounds a resume sent to the broker holding its session,
// which may queue it there for up to queue_wait_timeout before the spawn.
func (g *Gateway) resumeTimeout() time.Duration {
	return g.offerTimeout() + g.cfg.Load().QueueWaitTimeout.D()
}

// offerClaim offers a claim this broker would queue (or whose binary it
// does not have) to its reachable peers that spawn the claim's binary and
// had a free slot at their last heartbeat, one at a time in random order,
// until one with a free slot spawns it: each takes a slot only if one is
// free at that moment, so exactly one broker spawns. ok is false when
// every such peer declined (or none answered, or the body is too large for
// one cluster message): the claim then queues here as in single-broker
// mode.
func (g *Gateway) offerClaim(ctx context.Context, p auth.Principal, body []byte) (*claimResponse, *claimError, bool) {
	if !g.offerable(body) {
		return nil, nil, false
	}
	binary := claimedBinary(body)
	peers := slices.DeleteFunc(g.rt.node.Peers(), func(p cluster.Peer) bool { return !p.Reachable || p.Free <= 0 || !p.Serves(binary) })
	rand.Shuffle(len(peers), func(i, j int) { peers[i], peers[j] = peers[j], peers[i] })
	for _, peer := range peers {
		if resp, cerr, ok := g.offerTo(ctx, peer.ID, p, body); ok {
			return resp, cerr, true
		}
	}
	return nil, nil, false
}

// peerClaimed is the claim answer a peer gave: its lease, or its refusal.
func (g *Gateway) peerClaimed(peer string, a offerAnswer) (*claimResponse, *claimError) {
	if a.Status != http.StatusOK {
		return nil, &claimError{status: a.Status, text: a.Error, outcome: a.Outcome}
	}
	var resp claimResponse
	if err := json.Unmarshal(a.Claim, &resp); err != nil {
		g.log.Warn("cluster: a peer's claim answer was unreadable", "peer", peer, "error", err)
		return nil, refuse(http.StatusBadGateway, "spawn_failed", "a peer's claim answer was unreadable")
	}
	return &resp, nil
}

// peerServes reports whether a reachable peer spawns binary.
func (g *Gateway) peerServes(binary string) bool {
	return slices.ContainsFunc(g.rt.node.Peers(), func(p cluster.Peer) bool { return p.Reachable && p.Serves(binary) })
}

// claimedBinary is the registry entry a claim body names, "" for the
// default (or an unreadable body, which the claim's own parse refuses).
func claimedBinary(body []byte) string {
	var c struct {
		Binary string `json:"binary"`
	}
	_ = json.Unmarshal(body, &c)
	return strings.TrimSpace(c.Binary)
}

// offerTo offers a claim to one peer; ok is false when the peer declined
// it (no free slot, or no spawner: 503), did not answer, or does not spawn
// the claim's binary (it would answer 400 for an entry another broker
// has).
func (g *Gateway) offerTo(ctx context.Context, peer string, p auth.Principal, body []byte) (*claimResponse, *claimError, bool) {
	if view, ok := g.rt.node.Peer(peer); ok && !view.Serves(claimedBinary(body)) {
		return nil, nil, false
	}
	var a offerAnswer
	if err := g.rt.node.CallFor(ctx, g.offerTimeout(), peer, opClaim, offerCall{Principal: p, Claim: body}, &a); err != nil {
		g.log.Warn("cluster: offering a claim to a peer failed", "peer", peer, "error", err)
		return nil, nil, false
	}
	if a.Declined || a.Status == http.StatusServiceUnavailable {
		return nil, nil, false
	}
	resp, cerr := g.peerClaimed(peer, a)
	if resp != nil {
		g.log.Info("claim spawned by a peer: this broker is full", "peer", peer, "lease_id", resp.LeaseID)
	}
	return resp, cerr, true
}

// offerable reports whether a claim body fits the largest message the
// transport carries (in chunks).
func (g *Gateway) offerable(body []byte) bool {
	return len(body)+payloadOverhead <= cluster.MaxMessage
}

// takeOffer is the peer's side of offerClaim.
func (g *Gateway) takeOffer(ctx context.Context, from string, body json.RawMessage) (any, error) {
	return g.takeClaim(ctx, from, body, slotOffered)
}

// takeClaim serves a claim another broker sent here, as slot says.
func (g *Gateway) takeClaim(ctx context.Context, from string, body json.RawMessage, slot slotMode) (any, error) {
	var o offerCall
	if err := json.Unmarshal(body, &o); err != nil {
		return nil, err
	}
	r := forwarded(http.MethodPost, "/claim", from).WithContext(ctx)
	resp, cerr := g.claimBody(r, o.Principal, o.Claim, slot)
	switch {
	case cerr != nil && cerr.outcome == outcomeDeclined:
		return offerAnswer{Declined: true}, nil
	case cerr != nil:
		return offerAnswer{Status: cerr.status, Error: cerr.text, Outcome: cerr.outcome}, nil
	}
	g.log.Info("claim accepted for a peer", "peer", from, "lease_id", resp.LeaseID, "principal_id", o.Principal.ID)
	raw, err := json.Marshal(resp)
	return offerAnswer{Status: http.StatusOK, Claim: raw}, err
}

// capCacheFor is how long another broker's count of a principal's leases
// is reused for max_leases_per_principal.
const capCacheFor = time.Second

type countCall struct {
	Principal string `json:"principal"`
}

type countAnswer struct {
	Leases int `json:"leases"`
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
		if l.principal == principal {
			n++
		}
	}
	return n
}

// peerLeaseCount is principal's leases on every other broker that answers,
// for max_leases_per_principal to count cluster-wide; a count is reused for
// at most capCacheFor. A peer that does not answer counts nothing: its
// leases cannot be seen, and refusing every claim while it is away would
// make its outage everyone's.
func (g *Gateway) peerLeaseCount(principal string) int {
	if n, ok := g.rt.capCache.get(principal); ok {
		return n
	}
	n := 0
	askPeers(g, g.ctx, opCount, countCall{Principal: principal}, func(_ string, a countAnswer) { n += a.Leases })
	g.rt.capCache.put(principal, n)
	return n
}

// askPeers sends op to every reachable peer at once and hands each answer
// to got, one at a time. It returns the peers that did not answer (the
// unreachable ones included), sorted, never nil.
func askPeers[A any](g *Gateway, ctx context.Context, op string, body any, got func(peer string, a A)) []string {
	missing := []string{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, peer := range g.rt.node.Peers() {
		if !peer.Reachable {
			missing = append(missing, peer.ID)
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			var a A
			err := g.rt.node.Call(ctx, peer.ID, op, body, &a)
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
