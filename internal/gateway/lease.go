package gateway

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/streamlog"
	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/wire"
	"github.com/nexus-broker/nexus-broker/internal/gateway/spawner"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
	"github.com/nexus-broker/nexus-broker/pkg/sessionid"
)

// Lease states as GET /leases reports them.
const (
	stateSpawning = "spawning" // not yet registered, or restored and waiting to reattach
	stateActive   = "active"
	stateDraining = "draining" // teardown started; reason set
)

// Teardown reasons, as GET /leases, the log and the journal name them.
const (
	reasonRelease         = "manual release"
	reasonIdle            = "idle"
	reasonTurnTimeout     = "turn timeout"
	reasonCrashed         = "crashed"
	reasonReattachTimeout = "reattach timeout"
	reasonReadyTimeout    = "ready timeout"
	reasonClaimAbandoned  = "claim failed"
)

// How a teardown treats the process.
type teardownMode int

const (
	teardownGraceful  teardownMode = iota // shutdown frame, release_grace, then escalate
	teardownSkipGrace                     // no socket to ask over: straight to SIGTERM
	teardownExited                        // the process is already gone
)

// drainGrace bounds the wait for an instance's read pump to deliver what the
// instance wrote before it went away.
const drainGrace = 2 * time.Second

// Limits on client → instance frames held while the instance redials.
const (
	holdFrames = streamlog.SendWindow
	holdBytes  = 1 << 20
)

// lease is the gateway's view of one claimed instance.
type lease struct {
	g  *Gateway
	id string
	// principal is set once, but for a warm lease's at its hand-out: then
	// under both g.mu and mu, so a reader holding either needs no other.
	principal string
	entry     string
	createdAt time.Time
	log       *streamlog.Log
	// face is the lease's handle for the layers above (api.go).
	face Lease
	warm warmth
	sendQueue
	guarded
	policy
	milestones
	proof
}

// proof is what the lease's register frames are checked against: the
// verifier of its spawn secret, which spawnd's Spawn (or, for a restored
// lease, List) answered. It is set once, before proven is closed, and read
// only after: proven closed with no verifier is a spawn that failed.
type proof struct {
	verifier []byte
	proven   chan struct{}
}

// prove records the lease's verifier (nil when its Spawn failed) and lets
// the register frames waiting for it be checked.
func (l *lease) prove(verifier []byte) {
	l.verifier = verifier
	close(l.proven)
}

// warmth is a lease's part in the warm pools. pool names the pool of a warm
// lease while it waits to be claimed ("" once handed out, and for every
// other lease), under mu: such a lease has no owner and is nobody's to
// reach; abandon ends its boot, under mu. freed says the lease's capacity
// slot was given up, once: at its teardown, or earlier when a warm lease
// retires or yields it.
type warmth struct {
	pool    string
	abandon context.CancelCauseFunc
	freed   atomic.Bool
}

// sendQueue orders client → instance frames: the client's read pump writes
// them straight to the instance socket (a blocking write is the TCP
// backpressure), and an instance (re)registering flushes the held ones
// first. held/heldBytes are the frames sent while no instance was there.
type sendQueue struct {
	sendMu    sync.Mutex
	held      [][]byte
	heldBytes int
}

// guarded is a lease's state under its mu (which also guards policy).
type guarded struct {
	mu        sync.Mutex
	state     string
	reason    string
	sessionID string
	// sessionErr is why the last refused session-id report was refused.
	sessionErr string
	pid        int64
	spawned    bool
	restored   bool
	inst       *instanceConn
	client     attachedClient
	// clientTurns counts client connections in the order they were
	// accepted; clientTurn is the attached one's (see clientTicket).
	clientTurns, clientTurn uint64
	// follower is the layer above following this lease (an A2A
	// conversation), nil for a lease a WebSocket client claimed. It sees
	// every io payload, and the lease's end after its instance socket
	// drained.
	follower Follower
	// reported is the last turn state (idle or a work state) the instance
	// reported to this process; "" until it reports one.
	reported string
}

// policy is the idle and turn clocks of a lease, under its mu.
type policy struct {
	lastActivity  time.Time
	turnStarted   time.Time // zero while settled
	policyTimer   *time.Timer
	policyAt      time.Time // when policyTimer fires; zero when not armed
	reattachTimer *time.Timer
}

// milestones are the once-only moments of a lease, each a channel closed
// once: ready, the session reported, the exit, the Terminate answered, the
// teardown done.
type milestones struct {
	ready           chan struct{}
	readyOnce       sync.Once
	sessionReported chan struct{}
	reportOnce      sync.Once
	// reports counts the session-id changes the instance reported;
	// recording is closed once spawnd has answered the latest one.
	reports      int
	recording    chan struct{}
	exited       chan struct{}
	exitOnce     sync.Once
	exit         spawner.Exit
	teardownOnce sync.Once
	// terminating is closed once spawnd has answered the teardown's first
	// Terminate.
	terminating chan struct{}
	tornDown    chan struct{}
}

func (g *Gateway) newLease(id, principal, entry string, created time.Time) *lease {
	l := &lease{
		g: g, id: id, principal: principal, entry: entry, createdAt: created,
		log:     streamlog.New(id, int64(g.boot.ClientReplayBufferBytes)),
		guarded: guarded{state: stateSpawning},
		policy:  policy{lastActivity: created},
		milestones: milestones{
			ready:           make(chan struct{}),
			sessionReported: make(chan struct{}),
			exited:          make(chan struct{}),
			terminating:     make(chan struct{}),
			tornDown:        make(chan struct{}),
		},
		proof: proof{proven: make(chan struct{})},
	}
	l.face.l = l
	return l
}

func (l *lease) currentState() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.state
}

func (l *lease) isSpawned() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.spawned
}

func (l *lease) markReady() {
	l.readyOnce.Do(func() { close(l.ready) })
}

// maxSessionReports is how many session-id changes one lease may report,
// the same cap spawnd applies; a stock nexus reports one per session and
// repeats it on every redial, which changes nothing.
const maxSessionReports = 4

// markSession handles an instance's session-id report. An id is carried by
// the lease only once spawnd has recorded it, in report order; a report
// that breaks the session id rule, or comes past the cap, is refused with a
// WARN (one past the cap) and the lease keeps the id it had. Either way the
// claim waiting on sessionReported is released.
func (l *lease) markSession(id string) {
	l.mu.Lock()
	if id == "" || id == l.sessionID {
		l.mu.Unlock()
		l.settleSession()
		return
	}
	l.reports++
	n, prev := l.reports, l.recording
	done := make(chan struct{})
	if n <= maxSessionReports {
		l.recording = done
	}
	l.mu.Unlock()
	var refusal error
	switch err := sessionid.Validate(id); {
	case n > maxSessionReports:
		refusal = fmt.Errorf("the lease already reported %d session ids, the most one lease may", maxSessionReports)
	case err != nil:
		refusal = err
	}
	if refusal != nil {
		if n <= maxSessionReports+1 {
			l.g.log.Warn("instance's session-id report refused; the lease keeps running with the session id it had",
				"lease_id", l.id, "error", refusal)
		}
		l.refuseSession(refusal.Error())
		l.settleSession()
		return
	}
	if l.g.takeAhead(l, id, n == 1 && prev == nil) {
		l.settleSession() // the claim answers now (ahead.go)
		go func() {
			defer close(done)
			l.g.recordAhead(l, id)
		}()
		return
	}
	go func() {
		defer close(done)
		if prev != nil {
			<-prev // spawnd records a lease's ids in the order they came
		}
		keep, refused := l.g.recordInOrder(l.id, id)
		if keep {
			l.recorded(id)
		} else if refused != "" {
			l.refuseSession(refused)
		}
		l.settleSession()
	}()
}

// recorded makes id, which spawnd recorded, the lease's session id (an id
// taken ahead already is), and tells the lease's follower.
func (l *lease) recorded(id string) {
	l.mu.Lock()
	l.sessionID = id
	obs := l.follower
	l.mu.Unlock()
	if obs != nil {
		obs.SessionRecorded(l.handle(), id)
	}
}

// refuseSession keeps why a session-id report was refused, for the claim
// to answer when the lease is left without an id.
func (l *lease) refuseSession(why string) {
	l.mu.Lock()
	l.sessionErr = why
	l.mu.Unlock()
}

func (l *lease) settleSession() {
	l.reportOnce.Do(func() { close(l.sessionReported) })
}

// onExit is spawnd's word that the instance process is gone: a crash, or,
// after a Terminate this gateway did not call (-stop's, one before a
// restart; its own teardown set the reason first), that release.
func (l *lease) onExit(ev spawner.Exit) {
	l.exitOnce.Do(func() {
		l.mu.Lock()
		l.exit = ev
		l.mu.Unlock()
		close(l.exited)
		reason := reasonCrashed
		if ev.Terminated {
			reason = reasonRelease
		}
		go l.teardown(reason, teardownExited)
	})
}

// teardown ends the lease once, whoever asks first; later callers wait for
// the same teardown. Order matters: the instance's read pump is drained
// before anything is closed, so what an instance wrote on its way out still
// reaches its client.
func (l *lease) teardown(reason string, mode teardownMode) {
	l.teardownOnce.Do(func() {
		l.mu.Lock()
		l.state = stateDraining
		l.reason = reason
		inst, exit := l.inst, l.exit
		if l.policyTimer != nil {
			l.policyTimer.Stop()
		}
		if l.reattachTimer != nil {
			l.reattachTimer.Stop()
		}
		l.mu.Unlock()
		l.g.log.Info("lease draining", "lease_id", l.id, "reason", reason)
		if reason == reasonCrashed {
			l.g.log.Warn("instance exited unexpectedly; treating as crash", "lease_id", l.id, "error", exitError(exit),
				"exit_code", exit.ExitCode, "signal", exit.Signal)
		}

		if mode != teardownExited {
			term := func(noWait bool) {
				l.g.terminate(l, spawner.Termination{LeaseID: l.id, Reason: reason, SkipGrace: mode == teardownSkipGrace, NoWait: noWait})
			}
			// Begun before the shutdown frame goes, so that an instance
			// obeying it at once still ends for this reason, not as a
			// crash; once it is answered spawnd.max_leases excludes the
			// lease (a claim it yielded its slot to waits for that).
			term(true)
			close(l.terminating)
			if inst != nil && mode == teardownGraceful {
				inst.sendShutdown()
			}
			term(false)
		}
		if inst != nil {
			select {
			case <-inst.drained:
			case <-time.After(drainGrace):
				l.g.log.Warn("instance socket did not drain within the grace after its process exited; closing it",
					"lease_id", l.id, "grace", drainGrace)
			}
			inst.ws.CloseNow(1000, "")
		}
		l.mu.Lock()
		obs := l.follower
		l.mu.Unlock()
		if obs != nil {
			obs.Closed(l.handle())
		}
		code, text := 1001, wire.CloseLeaseClosed
		if reason == reasonCrashed {
			code, text = wire.CodeInstanceCrashed, wire.CloseInstanceCrashed
		}
		l.mu.Lock()
		c := l.client
		l.client = nil
		l.mu.Unlock()
		if c != nil {
			c.finish(code, text)
		}
		l.releaseSlot()
		l.g.removeLease(l)
		l.g.pools.m.Gone(l.id)
		l.g.publish(teardownEvent(reason), l, reason)
		msg := "lease released"
		if reason == reasonCrashed {
			msg = "lease removed after crash" // upstream's two lines
		}
		l.g.log.Info(msg, "lease_id", l.id, "reason", reason)
		close(l.tornDown)
	})
	<-l.tornDown
}

// releaseSlot gives the lease's capacity slot back, once.
func (l *lease) releaseSlot() {
	if l.warm.freed.CompareAndSwap(false, true) {
		l.g.freeSlot()
	}
}

// freeSlot gives a capacity slot back, and tells the pools waiting for one.
func (g *Gateway) freeSlot() {
	g.cap.Release()
	g.pools.m.SlotFreed()
}

// owner is the lease's principal, and whether it is a warm lease nobody
// claimed yet (whose principal means nothing).
func (l *lease) owner() (principal string, warm bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.principal, l.warm.pool != ""
}

// ownedBy says whether principal owns the lease: never a warm lease
// nobody claimed, and, with auth:, never a lease without an owner.
func (l *lease) ownedBy(principal string) bool {
	owner, warm := l.owner()
	return !warm && owner == principal && (owner != "" || !l.g.auth.Enabled())
}

// detachAll drops the lease's sockets at gateway shutdown without touching
// its process: clients get 1001, the instance redials the next gateway.
func (l *lease) detachAll() {
	l.mu.Lock()
	c, inst := l.client, l.inst
	l.client, l.inst = nil, nil
	if l.policyTimer != nil {
		l.policyTimer.Stop()
	}
	if l.reattachTimer != nil {
		l.reattachTimer.Stop()
	}
	l.mu.Unlock()
	if c != nil {
		c.goAway()
	}
	if inst != nil {
		inst.ws.CloseNow(1001, "broker shutting down")
	}
}

// --- idle and turn policy ---------------------------------------------------
//
// One timer per lease, re-armed on the events that move its deadline, so a
// lease is released within milliseconds of its deadline rather than at the
// next sweep.

// activate starts the idle clock when the lease becomes usable.
func (l *lease) activate() {
	l.mu.Lock()
	l.state = stateActive
	l.lastActivity = time.Now()
	l.rearmLocked()
	l.mu.Unlock()
}

// clientInput records client → instance input: it resets the idle clock.
func (l *lease) clientInput() {
	l.mu.Lock()
	l.lastActivity = time.Now()
	l.rearmLocked()
	l.mu.Unlock()
}

// turnStatus reads an instance status state on its way to the client.
func (l *lease) turnStatus(state string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case state == brokerframe.StateIdle:
		// Settling restarts the idle clock: a turn longer than idle_timeout
		// must not be reapable the instant it answers.
		l.turnStarted = time.Time{}
		l.lastActivity = time.Now()
	case brokerframe.IsWorkState(state):
		if !l.turnStarted.IsZero() {
			return // the turn clock measures the whole turn
		}
		l.turnStarted = time.Now()
	default:
		return // unknown states are ignored, never read as either signal
	}
	l.rearmLocked()
}

// rearm moves the lease's deadline to the idle_timeout and
// max_turn_duration in force, after a reload changed them.
func (l *lease) rearm() {
	l.mu.Lock()
	l.rearmLocked()
	l.mu.Unlock()
}

// deadlineLocked is when the policy would release the lease, and why.
func (l *lease) deadlineLocked() (time.Time, string) {
	cfg := l.g.cfg.Load()
	// A warm lease is exempt until claimed: nobody uses it yet.
	if cfg.IdleTimeout <= 0 || l.state != stateActive || l.warm.pool != "" {
		return time.Time{}, ""
	}
	if !l.turnStarted.IsZero() {
		if cfg.MaxTurnDuration <= 0 {
			return time.Time{}, ""
		}
		return l.turnStarted.Add(cfg.MaxTurnDuration.D()), reasonTurnTimeout
	}
	return l.lastActivity.Add(cfg.IdleTimeout.D()), reasonIdle
}

// rearmLocked makes sure the policy timer fires no later than the current
// deadline. A deadline that moved later needs no timer update: the timer
// fires early and policyFired re-arms it for the new deadline, which keeps
// timer work off the path of every client frame.
func (l *lease) rearmLocked() {
	at, _ := l.deadlineLocked()
	switch {
	case at.IsZero():
		if l.policyTimer != nil {
			l.policyTimer.Stop()
		}
		l.policyAt = time.Time{}
	case l.policyTimer == nil:
		l.policyTimer = time.AfterFunc(time.Until(at), l.policyFired)
		l.policyAt = at
	case l.policyAt.IsZero() || at.Before(l.policyAt):
		l.policyTimer.Reset(time.Until(at))
		l.policyAt = at
	}
}

// exitError words an instance's exit as os/exec does ("exit status 5"),
// which is what upstream's crash line carries.
func exitError(ev spawner.Exit) string {
	if s := ev.Signal; s != "" {
		return "signal: " + s
	}
	return fmt.Sprintf("exit status %d", ev.ExitCode)
}

// endedHow words how the lease's instance ended, for a client whose turn it
// leaves unfinished: the exit status or signal of a crash, else the reason
// the lease was torn down.
func (l *lease) endedHow() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case l.reason != reasonCrashed:
		return fmt.Sprintf("the agent instance was stopped (%s)", l.reason)
	case l.exit.Signal != "":
		return "the agent instance was killed by " + l.exit.Signal
	case l.exit.ExitCode < 0:
		return "the agent instance is gone (nexus-spawnd no longer holds it)"
	}
	return fmt.Sprintf("the agent instance exited with exit status %d", l.exit.ExitCode)
}

// msgTurnOverrun is the WARN a turn_timeout release logs, in upstream's words.
const msgTurnOverrun = "releasing a lease whose turn outlived max_turn_duration. The instance " +
	"never reported its turn finished — it is wedged, a tool never returned, or this " +
	"workload legitimately takes longer than the configured bound"

func (l *lease) policyFired() {
	l.mu.Lock()
	l.policyAt = time.Time{}
	at, reason := l.deadlineLocked()
	if at.IsZero() {
		l.mu.Unlock()
		return
	}
	if d := time.Until(at); d > 0 { // moved since the timer was armed
		l.policyTimer.Reset(d)
		l.policyAt = at
		l.mu.Unlock()
		return
	}
	l.mu.Unlock()
	cfg := l.g.cfg.Load()
	if reason == reasonIdle {
		l.g.log.Info("releasing idle lease", "lease_id", l.id, "idle_timeout", cfg.IdleTimeout.D(), "reason", reason)
	} else {
		l.g.log.Warn(msgTurnOverrun, "lease_id", l.id, "max_turn_duration", cfg.MaxTurnDuration.D(), "reason", reason)
	}
	l.teardown(reason, teardownGraceful)
}

func (g *Gateway) publish(kind EventKind, l *lease, detail string) {
	if len(g.subs) == 0 {
		return
	}
	principal, _ := l.owner()
	ev := Event{At: time.Now().UTC(), Kind: kind, LeaseID: l.id, Principal: principal, Binary: l.entry, Detail: detail}
	for _, f := range g.subs {
		f(ev)
	}
}

// teardownEvent names a teardown reason's event kind.
func teardownEvent(reason string) EventKind {
	switch reason {
	case reasonRelease:
		return EventReleased
	case reasonCrashed:
		return EventCrashed
	}
	return EventReaped
}
