package router

import (
	"context"
	"net/http"

	"github.com/nexus-broker/nexus-broker/internal/auth"
	"github.com/nexus-broker/nexus-broker/internal/gateway"
)

// A claim that finds the whole cluster full waits in this broker's FIFO,
// under this broker's queue_wait_timeout and max_queue_depth. A peer's
// freed slot reaches it: a broker whose slot frees with nobody queued for
// it heartbeats at once, saying how many it has free, and a broker that
// hears a peer with a free slot offers it its oldest queued claims, one
// at a time, until the peer declines. A claim out on offer keeps its
// place, and a local slot freed meanwhile is held for it until the peer
// answers, so exactly one broker spawns it.

// peerFreeBacklog is how many free-slot announcements wait for the
// offering goroutine; more are dropped, the next heartbeat repeats them.
const peerFreeBacklog = 16

// peerHasFree hears a peer's heartbeat announcing a free slot.
func (rt *Router) peerHasFree(peer string) {
	select {
	case rt.peerFree <- peer:
	default:
	}
}

// reofferQueued offers queued claims to each peer that announces a free
// slot, for the gateway's lifetime.
func (rt *Router) reofferQueued() {
	defer rt.wg.Done()
	done := rt.core.Context().Done()
	for {
		select {
		case <-done:
			return
		case peer := <-rt.peerFree:
			for rt.offerQueued(peer) {
			}
		}
	}
}

// offerQueued offers the oldest queued claim to peer, and reports whether
// the peer served it (so the next may follow).
func (rt *Router) offerQueued(peer string) bool {
	return rt.core.OfferQueued(func(ctx context.Context, p auth.Principal, body []byte) (gateway.PeerClaim, bool) {
		a, served := rt.offerTo(ctx, peer, p, body)
		if a.Status == http.StatusTooManyRequests {
			// The peer counted this very claim, booked here, against the
			// principal's cap: it waits on here, where it was admitted.
			served = false
		}
		if served {
			rt.log.Info("queued claim served by a peer that freed a slot", "peer", peer, "principal_id", p.ID)
		}
		return a, served
	})
}
