package gateway

import (
	"net/http"

	"github.com/nexus-broker/nexus-broker/internal/gateway/spawner"
)

// errUnknownSession is the one answer, with auth:, to a resume of a session
// the caller did not create: another principal's and an unrecorded one
// alike, so neither the status, the body nor the timing (one Binding call
// either way, before anything is spawned) tells whether the id exists.
const errUnknownSession = "unknown session"

// checkOwner holds a resume to the principal that created the session when
// auth is on, from spawnd's Binding answer (b, err); nil lets it proceed.
// The log says which case refused it, never the owner.
func (g *Gateway) checkOwner(principal, session string, b spawner.Bound, err error) *claimError {
	if !g.auth.Enabled() {
		return nil
	}
	switch {
	case err != nil:
		g.log.Warn("resume refused: nexus-spawnd could not say who owns the session", "principal", principal, "session_id", session, "error", err)
		return refuse(http.StatusServiceUnavailable, "spawn_failed", errSpawnerUnavailable)
	case b.Owner == spawner.OwnerOther:
		g.log.Warn("resume refused: the session belongs to another principal", "principal", principal, "session_id", session)
	case b.Owner == spawner.OwnerUnrecorded:
		g.log.Warn("resume refused: no owner is recorded for the session (evicted, created before owners were recorded, or unknown)", "principal", principal, "session_id", session)
	default:
		return nil
	}
	return refuse(http.StatusNotFound, "rejected", errUnknownSession)
}
