package gateway

// A session id answered ahead of spawnd's Record. A claim answers with the
// session id its instance reported only once spawnd will not refuse it
// (hardening: no client is handed an id spawnd refused). Usually that
// means waiting for Record's answer. But where Record carries nothing the
// answer depends on (no auth:, so no owner to record; no state_dir, so no
// index of gone leases' sessions and their entries, which the gateway does
// not hold, and nothing to put on disk first), spawnd refuses a lease's
// first id only for what the gateway checks first (the session id rule,
// the report cap) or for a session another live lease holds; and every
// lease spawnd holds, the gateway holds too, with its session id, from
// before its Spawn to after spawnd forgot it. So the gateway takes such an
// id itself when no lease of its own holds it and no Record of it is in
// flight, writes the Record, and answers the claim without waiting for the
// reply: one round trip to another process fewer on a cold claim
// (docs/architecture.md, "The claim's lanes").
//
// What keeps spawnd's view the gateway's: no id is taken ahead while an
// ordinary Record of it is in flight (spawnd may be applying it), and
// until an ahead Record is answered nothing else about the session
// reaches spawnd: another lease reporting the same id takes the ordinary
// path and its Record waits, and so does a resume's Spawn of it. spawnd
// thus sees the ahead Record first, as the gateway assumed. Should spawnd
// refuse it all the same, the lease ends and the refusal is logged as the
// error it is.

// reasonRecordRefused ends a lease whose session id, answered ahead,
// spawnd refused.
const reasonRecordRefused = "session id refused"

// recordsAhead says whether a session id may be answered ahead of spawnd's
// Record here.
func (g *Gateway) recordsAhead() bool {
	return !g.auth.Enabled() && g.boot.StateDir == ""
}

// takeAhead makes session l's, ahead of spawnd's answer, if it may be: a
// claimed lease's first report, where recordsAhead, of a session no other
// lease of this gateway holds and no Record of it is in flight for; false
// is the ordinary path.
func (g *Gateway) takeAhead(l *lease, session string, first bool) bool {
	if !first || !g.recordsAhead() {
		return false
	}
	l.mu.Lock()
	warm := l.warm.pool != ""
	l.mu.Unlock()
	if warm {
		return false // booting: no claim waits on it
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if _, inFlight := g.ahead[session]; inFlight || g.recording[session] > 0 {
		return false
	}
	for _, o := range g.leases {
		if o == l {
			continue
		}
		o.mu.Lock()
		held := o.sessionID == session
		o.mu.Unlock()
		if held {
			return false
		}
	}
	l.mu.Lock()
	l.sessionID = session
	l.mu.Unlock()
	g.ahead[session] = make(chan struct{})
	return true
}

// recordAhead writes the Record of a session takeAhead gave l and waits
// for its answer, off the claim's path. A refusal, which takeAhead's
// conditions rule out, ends the lease.
func (g *Gateway) recordAhead(l *lease, session string) {
	keep, refused := g.record(l.id, session)
	g.mu.Lock()
	done := g.ahead[session]
	delete(g.ahead, session)
	g.mu.Unlock()
	close(done)
	switch {
	case refused != "":
		g.log.Error("nexus-spawnd refused a session id the claim was already answered with; ending the lease",
			"lease_id", l.id, "session_id", session, "error", refused)
		l.mu.Lock()
		l.sessionID = ""
		l.mu.Unlock()
		go l.teardown(reasonRecordRefused, teardownSkipGrace)
	case keep:
		l.recorded(session)
	}
}

// awaitAhead waits until no Record of session answered ahead is in flight,
// so that what the caller sends spawnd about session comes after it.
func (g *Gateway) awaitAhead(session string) {
	if session == "" {
		return
	}
	g.mu.Lock()
	g.awaitAheadLocked(session)
	g.mu.Unlock()
}

// awaitAheadLocked is awaitAhead for a caller holding g.mu, which it
// releases while it waits.
func (g *Gateway) awaitAheadLocked(session string) {
	for done := g.ahead[session]; done != nil; done = g.ahead[session] {
		g.mu.Unlock()
		<-done
		g.mu.Lock()
	}
}

// recordInOrder is an ordinary Record of session for lease id: sent once
// no Record of session answered ahead is in flight, and counted while it
// is, so that none is taken ahead meanwhile.
func (g *Gateway) recordInOrder(id, session string) (keep bool, refused string) {
	g.mu.Lock()
	g.awaitAheadLocked(session)
	g.recording[session]++
	g.mu.Unlock()
	defer func() {
		g.mu.Lock()
		if g.recording[session]--; g.recording[session] == 0 {
			delete(g.recording, session)
		}
		g.mu.Unlock()
	}()
	return g.record(id, session)
}
