package router

import (
	"context"
	"encoding/json"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/auth"
	"github.com/nexus-broker/nexus-broker/internal/cluster"
	"github.com/nexus-broker/nexus-broker/internal/gateway"
)

// Leases is GET /leases in cluster mode: every broker asked at once
// within one deadline, the leases of those that answered, their aggregates
// summed, and the others named.
func (rt *Router) Leases(ctx context.Context, p auth.Principal, out gateway.LeaseList) gateway.LeaseList {
	unreachable := askPeers(rt, ctx, opLeases, leaseCall{Principal: p}, func(_ string, theirs gateway.LeaseList) {
		out.Leases = append(out.Leases, theirs.Leases...)
		for _, sum := range [][2]*int{{out.MaxConcurrent, theirs.MaxConcurrent}, {out.SlotsInUse, theirs.SlotsInUse},
			{out.QueueDepth, theirs.QueueDepth}, {out.MaxQueueDepth, theirs.MaxQueueDepth}} {
			if sum[0] != nil && sum[1] != nil {
				*sum[0] += *sum[1]
			}
		}
	})
	gateway.SortLeases(out.Leases)
	out.UnreachableBrokers = &unreachable
	return out
}

// offerCall is a claim a full broker offers a peer: the caller's principal
// and the claim body as the caller sent it.
type offerCall struct {
	Principal auth.Principal  `json:"principal"`
	Claim     json.RawMessage `json:"claim"`
}

// offerTimeout bounds an offered claim: a spawn, the instance's boot and
// its session report.
func (rt *Router) offerTimeout() time.Duration {
	cfg := rt.core.Config()
	return cfg.ReadyTimeout.D() + cfg.SessionReportGrace.D() + 30*time.Second
}

// resumeTimeout bounds a resume sent to the broker holding its session,
// which may queue it there for up to queue_wait_timeout before the spawn.
func (rt *Router) resumeTimeout() time.Duration {
	return rt.offerTimeout() + rt.core.Config().QueueWaitTimeout.D()
}

// OfferClaim offers a claim this broker would queue (or whose binary it
// does not have) to its reachable peers that spawn the claim's binary and
// had a free slot at their last heartbeat, one at a time in random order,
// until one with a free slot spawns it: each takes a slot only if one is
// free at that moment, so exactly one broker spawns. ok is false when
// every such peer declined (or none answered, or the body is too large for
// one cluster message): the claim then queues here as in single-broker
// mode.
func (rt *Router) OfferClaim(ctx context.Context, p auth.Principal, body []byte) (gateway.PeerClaim, bool) {
	if !rt.Offerable(body) {
		return gateway.PeerClaim{}, false
	}
	binary := claimedBinary(body)
	peers := slices.DeleteFunc(rt.node.Peers(), func(p cluster.Peer) bool { return !p.Offerable(binary) })
	rand.Shuffle(len(peers), func(i, j int) { peers[i], peers[j] = peers[j], peers[i] })
	for _, peer := range peers {
		if a, ok := rt.offerTo(ctx, peer.ID, p, body); ok {
			return a, true
		}
	}
	return gateway.PeerClaim{}, false
}

// PeerServes reports whether a reachable peer spawns binary.
func (rt *Router) PeerServes(binary string) bool {
	return slices.ContainsFunc(rt.node.Peers(), func(p cluster.Peer) bool { return p.Reachable && p.Serves(binary) })
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
func (rt *Router) offerTo(ctx context.Context, peer string, p auth.Principal, body []byte) (gateway.PeerClaim, bool) {
	if view, ok := rt.node.Peer(peer); ok && (view.Draining || !view.Serves(claimedBinary(body))) {
		return gateway.PeerClaim{}, false
	}
	var o offerAnswer
	if err := rt.node.CallFor(ctx, rt.acceptWait(), peer, opClaim, offerCall{Principal: p, Claim: body}, &o); err != nil {
		rt.log.Warn("cluster: a peer did not accept an offered claim within cluster.offer_timeout; offering it to the next", "peer", peer, "offer_timeout", rt.acceptWait(), "error", err)
		return gateway.PeerClaim{}, false
	}
	a := o.PeerClaim
	if o.Offer != "" {
		a = rt.collect(ctx, peer, o.Offer)
	} else if a.Declined || a.Status == http.StatusServiceUnavailable {
		return gateway.PeerClaim{}, false
	}
	a.Peer = peer
	if id := a.LeaseID(); id != "" {
		rt.log.Info("claim spawned by a peer: this broker is full", "peer", peer, "lease_id", id)
	}
	return a, true
}

// Offerable reports whether a claim body fits the largest message the
// transport carries (in chunks).
func (rt *Router) Offerable(body []byte) bool {
	return len(body)+payloadOverhead <= cluster.MaxMessage
}

// takeClaim serves a claim another broker sent here: an offer, or a
// resume routed here.
func (rt *Router) takeClaim(ctx context.Context, from string, body json.RawMessage, routed bool) (any, error) {
	var o offerCall
	if err := json.Unmarshal(body, &o); err != nil {
		return nil, err
	}
	return rt.core.TakeClaim(ctx, from, o.Principal, o.Claim, routed)
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

// PeerLeaseCount is principal's leases on every other broker that answers,
// for max_leases_per_principal to count cluster-wide; a count is reused for
// at most capCacheFor. A peer that does not answer counts nothing: its
// leases cannot be seen, and refusing every claim while it is away would
// make its outage everyone's.
func (rt *Router) PeerLeaseCount(principal string) int {
	if n, ok := rt.capCache.get(principal); ok {
		return n
	}
	n := 0
	askPeers(rt, rt.core.Context(), opCount, countCall{Principal: principal}, func(_ string, a countAnswer) { n += a.Leases })
	rt.capCache.put(principal, n)
	return n
}
