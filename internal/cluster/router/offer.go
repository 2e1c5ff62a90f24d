package router

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"net/http"
	"sync"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/gateway"
)

// An offered claim crosses in two requests. opClaim is answered within
// cluster.offer_timeout: accepted once the peer holds a free slot for it
// (before the spawn), else its refusal or decline; a peer that does not
// answer in time is skipped for the next. opClaimed then waits for the
// accepted claim's answer, under the spawn's own bounds (offerTimeout).
const opClaimed = "claimed"

// offerAnswer is opClaim's answer: Offer names an accepted claim, to be
// collected with opClaimed; without it the embedded answer is final.
type offerAnswer struct {
	gateway.PeerClaim
	Offer string `json:"offer,omitempty"`
}

type claimedCall struct {
	Offer string `json:"offer"`
}

// accepted is an offered claim this broker took, spawning; done closes
// when its answer is in.
type accepted struct {
	from   string
	done   chan struct{}
	answer gateway.PeerClaim
	err    error
}

// offers are the claims this broker accepted for peers and has not yet
// handed their answers, by offer id.
type offers struct {
	mu sync.Mutex
	m  map[string]*accepted
}

// acceptWait is cluster.offer_timeout.
func (rt *Router) acceptWait() time.Duration { return rt.offerAccept }

// takeOffer is the peer's side of OfferClaim's first step: it runs the
// claim on its own goroutine (bounded by offerTimeout, not by this
// request) and answers when the claim holds its slot, or has its answer,
// whichever is first. Past offer_timeout the claim is cancelled: the
// offering broker has moved on.
func (rt *Router) takeOffer(ctx context.Context, from string, body json.RawMessage) (any, error) {
	var o offerCall
	if err := json.Unmarshal(body, &o); err != nil {
		return nil, err
	}
	var idb [16]byte
	_, _ = rand.Read(idb[:])
	a := &accepted{from: from, done: make(chan struct{})}
	id := hex.EncodeToString(idb[:])
	took := make(chan struct{})
	claimCtx, cancel := context.WithTimeout(rt.core.Context(), rt.offerTimeout())
	go func() {
		defer cancel()
		a.answer, a.err = rt.core.TakeClaim(gateway.WithAccept(claimCtx, func() { close(took) }), from, o.Principal, o.Claim, false)
		close(a.done)
	}()
	select {
	case <-took:
		rt.offers.mu.Lock()
		rt.offers.m[id] = a
		rt.offers.mu.Unlock()
		// Dropped once answered, collected or not: a peer that never asks
		// leaves no entry behind.
		go func() {
			<-a.done
			time.AfterFunc(rt.acceptWait()+rt.offerTimeout(), func() { rt.offers.take(id, from) })
		}()
		return offerAnswer{Offer: id}, nil
	case <-a.done:
		return offerAnswer{PeerClaim: a.answer}, a.err
	case <-ctx.Done():
		cancel()
		return nil, ctx.Err()
	}
}

// take removes and returns the offer id accepted for from, nil for none.
func (o *offers) take(id, from string) *accepted {
	o.mu.Lock()
	defer o.mu.Unlock()
	a := o.m[id]
	if a == nil || a.from != from {
		return nil
	}
	delete(o.m, id)
	return a
}

// answerClaimed is opClaimed: the answer of a claim accepted for the
// asking broker, once it is in.
func (rt *Router) answerClaimed(ctx context.Context, from string, body json.RawMessage) (any, error) {
	var c claimedCall
	if err := json.Unmarshal(body, &c); err != nil {
		return nil, err
	}
	a := rt.offers.take(c.Offer, from)
	if a == nil {
		return nil, errors.New("no claim accepted for this broker under that offer")
	}
	select {
	case <-a.done:
		return a.answer, a.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// collect waits for the answer of a claim peer accepted. Accepted, it is
// the claim's answer either way: another peer must not spawn it too.
func (rt *Router) collect(ctx context.Context, peer, offer string) gateway.PeerClaim {
	var a gateway.PeerClaim
	if err := rt.node.CallFor(ctx, rt.offerTimeout(), peer, opClaimed, claimedCall{Offer: offer}, &a); err != nil {
		rt.log.Warn("cluster: a peer accepted a claim and then did not answer it", "peer", peer, "error", err)
		return gateway.PeerClaim{Status: http.StatusBadGateway, Error: "the broker that accepted the claim did not answer it", Outcome: "spawn_failed"}
	}
	return a
}
