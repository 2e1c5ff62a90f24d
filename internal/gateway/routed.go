package gateway

import (
	"context"
	"encoding/json"
	"net/http"
	"net/url"
	"sort"

	"github.com/nexus-broker/nexus-broker/internal/auth"
)

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
	resp      *claimResponse
	cerr      *claimError
}

// remoteOwner is the broker owning lease id when that is not this one.
func (g *Gateway) remoteOwner(id string) string {
	if g.rt == nil {
		return ""
	}
	return g.rt.RemoteOwner(id)
}

// ownerAnswer is a lease route as its owner answers it: status and body.
type ownerAnswer func(r *http.Request, id string, p auth.Principal) (int, any)

// ownerRoute serves a lease route here when this broker owns the lease (or
// in single-broker mode), else has the router forward it to the owner.
func (g *Gateway) ownerRoute(route string, local ownerAnswer) func(http.ResponseWriter, *http.Request, auth.Principal) {
	return func(w http.ResponseWriter, r *http.Request, p auth.Principal) {
		id := r.PathValue("lease_id")
		if owner := g.remoteOwner(id); owner != "" {
			g.rt.ForwardLease(w, r, owner, route, p)
			return
		}
		st, v := local(r, id, p)
		writeJSON(w, st, v)
	}
}

// forwarded stands for a request another broker carried, for the audit
// line: the route, and the broker it came through as the peer.
func forwarded(method, path, from string) *http.Request {
	return &http.Request{Method: method, URL: &url.URL{Path: path}, RemoteAddr: "broker " + from}
}

// peerClaimed is the claim answer a peer gave: its lease, or its refusal.
func (g *Gateway) peerClaimed(a PeerClaim) (*claimResponse, *claimError) {
	if a.Status != http.StatusOK {
		return nil, &claimError{status: a.Status, text: a.Error, outcome: a.Outcome}
	}
	var resp claimResponse
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
		if l.principal == principal {
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
