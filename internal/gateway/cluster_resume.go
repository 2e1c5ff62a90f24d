package gateway

import (
	"context"
	"encoding/json"
	"net/http"

	"github.com/nexus-broker/nexus-broker/internal/auth"
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

// holdsSession reports whether this host's session index (or a live lease)
// has the session. A spawnd that cannot be asked holds nothing.
func (g *Gateway) holdsSession(ctx context.Context, session string) bool {
	b, err := g.sp.Binding(ctx, session, "")
	return err == nil && b.Entry != ""
}

// answerSession is a peer's side of sessionHolder.
func (g *Gateway) answerSession(ctx context.Context, _ string, body json.RawMessage) (any, error) {
	var c sessionCall
	if err := json.Unmarshal(body, &c); err != nil {
		return nil, err
	}
	return contextAnswer{Mine: g.holdsSession(ctx, c.Session)}, nil
}

// sessionHolder is the peer whose host holds session, "" when this broker
// does (mine) or no peer that answers does.
func (g *Gateway) sessionHolder(ctx context.Context, session string) (holder string, mine bool) {
	if g.holdsSession(ctx, session) {
		return "", true
	}
	askPeers(g, ctx, opSession, sessionCall{Session: session}, func(peer string, a contextAnswer) {
		if a.Mine {
			holder = peer
		}
	})
	return holder, false
}

// routeResume sends a resume to the broker holding its session, which
// serves it as a claim that arrived there: a free slot or its own queue,
// never offered on. routed is false when this broker should serve it;
// mine when it must, its host holding the session.
func (g *Gateway) routeResume(ctx context.Context, p auth.Principal, session string, body []byte) (_ *claimResponse, _ *claimError, routed, mine bool) {
	holder, mine := g.sessionHolder(ctx, session)
	if holder == "" {
		return nil, nil, false, mine
	}
	var a offerAnswer
	if err := g.rt.node.CallFor(ctx, g.resumeTimeout(), holder, opResume, offerCall{Principal: p, Claim: body}, &a); err != nil {
		g.log.Warn("cluster: the broker holding a resumed session did not take the claim", "peer", holder, "session_id", session, "error", err)
		return nil, refuse(http.StatusServiceUnavailable, "spawn_failed", errSessionBrokerUnavailable), true, false
	}
	resp, cerr := g.peerClaimed(holder, a)
	if resp != nil {
		g.log.Info("resume routed to the broker holding its session", "peer", holder, "session_id", session, "lease_id", resp.LeaseID)
	}
	return resp, cerr, true, false
}

// takeResume is the holder's side of routeResume.
func (g *Gateway) takeResume(ctx context.Context, from string, body json.RawMessage) (any, error) {
	return g.takeClaim(ctx, from, body, slotRouted)
}
