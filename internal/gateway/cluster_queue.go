package gateway

import (
	"context"
	"net/http"

	"github.com/nexus-broker/nexus-broker/internal/auth"
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

// queuedOffer is a queued claim a peer may serve instead: what to offer,
// and the peer's answer once it served it.
type queuedOffer struct {
	// ctx is the claimant's: an offer is abandoned when it hangs up.
	ctx       context.Context
	principal auth.Principal
	body      []byte
	resp      *claimResponse
	cerr      *claimError
}

// peerHasFree hears a peer's heartbeat announcing a free slot.
func (rt *router) peerHasFree(peer string) {
	select {
	case rt.peerFree <- peer:
	default:
	}
}

// reofferQueued offers queued claims to each peer that announces a free
// slot, for the gateway's lifetime.
func (g *Gateway) reofferQueued() {
	defer g.wg.Done()
	for {
		select {
		case <-g.ctx.Done():
			return
		case peer := <-g.rt.peerFree:
			for g.offerQueued(peer) {
			}
		}
	}
}

// offerQueued offers the oldest queued claim to peer, and reports whether
// the peer served it (so the next may follow).
func (g *Gateway) offerQueued(peer string) bool {
	w := g.cap.NextOffer()
	if w == nil {
		return false
	}
	o := w.Offer()
	resp, cerr, served := g.offerTo(o.ctx, peer, o.principal, o.body)
	if cerr != nil && cerr.status == http.StatusTooManyRequests {
		// The peer counted this very claim, booked here, against the
		// principal's cap: it waits on here, where it was admitted.
		served = false
	}
	if served {
		o.resp, o.cerr = resp, cerr
		g.log.Info("queued claim served by a peer that freed a slot", "peer", peer, "principal_id", o.principal.ID)
	}
	g.cap.OfferEnded(w, served)
	return served
}
