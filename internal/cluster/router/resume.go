package router

import (
	"context"
	"encoding/json"
	"net/http"

	"github.com/nexus-broker/nexus-broker/internal/auth"
	"github.com/nexus-broker/nexus-broker/internal/gateway"
)

// A session lives on the host that ran it (its transcript is under that
// host's instance home), so in cluster mode a resume goes to the broker
// whose spawnd's session index holds it: asked of every peer when this
// broker does not hold it. A session this broker holds is spawned here,
// queued when full, never offered to a peer. No holder: this broker decides
// as for any claim.

// errSessionBrokerUnavailable is the 503 of a resume whose session's broker
// was found but did not take the claim.
const errSessionBrokerUnavailable = "the broker holding this session is unavailable"

type sessionCall struct {
	Session string `json:"session"`
}

// answerSession is a peer's side of sessionHolder.
func (rt *Router) answerSession(ctx context.Context, _ string, body json.RawMessage) (any, error) {
	var c sessionCall
	if err := json.Unmarshal(body, &c); err != nil {
		return nil, err
	}
	return contextAnswer{Mine: rt.core.HoldsSession(ctx, c.Session)}, nil
}

// sessionHolder is the peer whose host holds session, "" when this broker
// does (mine) or no peer that answers does.
func (rt *Router) sessionHolder(ctx context.Context, session string) (holder string, mine bool) {
	if rt.core.HoldsSession(ctx, session) {
		return "", true
	}
	askPeers(rt, ctx, opSession, sessionCall{Session: session}, func(peer string, a contextAnswer) {
		if a.Mine {
			holder = peer
		}
	})
	return holder, false
}

// RouteResume sends a resume to the broker holding its session, which
// serves it as a claim that arrived there: a free slot or its own queue,
// never offered on. routed is false when this broker should serve it;
// mine when it must, its host holding the session.
func (rt *Router) RouteResume(ctx context.Context, p auth.Principal, session string, body []byte) (_ gateway.PeerClaim, routed, mine bool) {
	holder, mine := rt.sessionHolder(ctx, session)
	if holder == "" {
		return gateway.PeerClaim{}, false, mine
	}
	var a gateway.PeerClaim
	if err := rt.node.CallFor(ctx, rt.resumeTimeout(), holder, opResume, offerCall{Principal: p, Claim: body}, &a); err != nil {
		rt.log.Warn("cluster: the broker holding a resumed session did not take the claim", "peer", holder, "session_id", session, "error", err)
		return gateway.PeerClaim{Status: http.StatusServiceUnavailable, Error: errSessionBrokerUnavailable, Outcome: "spawn_failed"}, true, false
	}
	a.Peer = holder
	if id := a.LeaseID(); id != "" {
		rt.log.Info("resume routed to the broker holding its session", "peer", holder, "session_id", session, "lease_id", id)
	}
	return a, true, false
}

// takeResume is the holder's side of RouteResume.
func (rt *Router) takeResume(ctx context.Context, from string, body json.RawMessage) (any, error) {
	return rt.takeClaim(ctx, from, body, true)
}
