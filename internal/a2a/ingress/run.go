package ingress

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/a2a"
	"github.com/nexus-broker/nexus-broker/internal/gateway"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// --- running a conversation ----------------------------------------------

// advanceLocked moves c on as far as it can go now: the oldest queued task
// becomes active when none is, and the active task's input goes to the
// instance once the conversation has one that is not busy. A conversation
// without a live instance gets one on a goroutine (start), which moves it
// on again. It returns the send to make once in.mu is released.
func (in *ingress) advanceLocked(c *conv) (send func()) {
	if c.active == nil {
		if len(c.queue) == 0 || in.stopped() {
			return nil
		}
		c.active, c.sent = c.queue[0], false
		c.queue = c.queue[1:]
	}
	if c.sent || c.starting || c.busy {
		return nil
	}
	if c.lease != nil && c.lease.Draining() {
		in.bindLocked(c, nil)
	}
	if c.lease == nil {
		c.starting = true
		go in.start(c)
		return nil
	}
	t := c.active
	c.sent, t.turn = true, a2a.Turn{}
	return in.prepareLocked(c.lease, brokerframe.IO{Type: brokerframe.IOInput, Content: t.input})
}

// kickLocked is advanceLocked from an event: the send goes on a goroutine.
// A conversation left with nothing going on is forgotten.
func (in *ingress) kickLocked(c *conv) {
	if send := in.advanceLocked(c); send != nil {
		go send()
	}
	if c.active == nil && len(c.queue) == 0 && c.lease == nil && !c.starting && !c.busy && in.convs[c.key] == c {
		delete(in.convs, c.key)
	}
}

// start gets c an instance, then moves it on. A spawn that fails settles
// the task that was waiting for it, never hangs it.
func (in *ingress) start(c *conv) {
	l, fail := in.leaseFor(c)
	in.mu.Lock()
	defer in.mu.Unlock()
	c.starting = false
	t := c.active
	switch {
	case t == nil:
		in.kickLocked(c) // canceled while the instance was starting; it stays for the next message
	case fail != nil:
		in.log.Warn("a2a task settled without ever reaching an agent instance", "profile", c.key.profile, "task_id", t.rec.Task.ID,
			"context_id", c.key.context, "state", a2a.StateName(fail.state), "error", fail.text)
		in.setStateLocked(t, fail.state, fail.text)
	case l.Draining():
		in.instanceGoneLocked(t, l)
	default:
		in.kickLocked(c)
	}
}

// prepareLocked restarts l's idle clock with p (every message counts as
// client input); the returned func sends it, never under in.mu, since a
// slow instance blocks it.
func (in *ingress) prepareLocked(l *gateway.Lease, p brokerframe.IO) func() {
	payload, _ := json.Marshal(p) // a struct of strings cannot fail
	return l.Send(payload)
}

// refuseOversize is InvalidParams when p would not fit max_client_frame as
// the io frame of l's instance (nil: of the lease a new conversation gets),
// which a client socket's frame may not exceed either; nil when it fits.
func (in *ingress) refuseOversize(l *gateway.Lease, p brokerframe.IO) *a2a.Error {
	payload, _ := json.Marshal(p) // a struct of strings cannot fail
	if size, limit, fits := in.core.InputFits(l, payload); !fits {
		return a2a.ErrInvalidParams.With("the message would reach the agent instance as a frame of %d bytes, over this broker's "+
			"max_client_frame limit of %d bytes; send a shorter message", size, limit)
	}
	return nil
}

// sendLocked writes one io payload to the lease's instance.
func (in *ingress) sendLocked(l *gateway.Lease, p brokerframe.IO) {
	go in.prepareLocked(l, p)()
}

func isSettled(t *liveTask) bool {
	select {
	case <-t.settled:
		return true
	default:
		return false
	}
}

// spawnFailure is why a conversation got no instance, and the state the
// task waiting for it settles at.
type spawnFailure struct{ state, text string }

// spawnFailed settles a refused claim (4xx: an unknown or mismatched
// binary, a per-principal cap; the same message fails the same way until
// something changes) REJECTED, and a spawn that was attempted and did not
// come up (capacity, a boot that died or timed out) FAILED: a retry may
// succeed.
func spawnFailed(profile string, cerr *gateway.ClaimError) *spawnFailure {
	switch cerr.Status {
	case http.StatusBadRequest, http.StatusConflict, http.StatusTooManyRequests:
		return &spawnFailure{a2a.StateRejected, fmt.Sprintf(textSpawnRefused, profile, cerr.Text)}
	}
	return &spawnFailure{a2a.StateFailed, fmt.Sprintf(textSpawnFailed, profile, cerr.Text)}
}

// leaseFor gets the conversation a live lease: one of its session that is
// already running (adopted), else a fresh spawn resuming its session with
// -recall. It returns why not otherwise.
func (in *ingress) leaseFor(c *conv) (*gateway.Lease, *spawnFailure) {
	p := in.profiles.Load().ByName[c.key.profile]
	if p == nil {
		return nil, &spawnFailure{a2a.StateRejected, fmt.Sprintf(textSpawnRefused, c.key.profile, "the profile is no longer configured")}
	}
	in.mu.Lock()
	session := c.session
	in.mu.Unlock()
	if session == "" {
		if b, ok := in.contexts.Get(c.key.String()); ok {
			session = b.SessionID
		}
	}
	if l := in.core.SessionLease(c.key.principal, session); l != nil {
		in.adopt(c, l, session)
		return l, nil
	}
	l, cerr := in.core.Claim(gateway.ClaimSpec{Principal: c.key.principal, Binary: p.Entry, Config: p.Config, Session: session})
	if cerr != nil {
		in.log.Warn("a2a turn could not start an agent instance", "profile", c.key.profile, "context_id", c.key.context,
			"session_id", session, "status", cerr.Status, "error", cerr.Text)
		return nil, spawnFailed(c.key.profile, cerr)
	}
	// Bound under in.mu: a session id recorded from here on reaches the
	// conversation through SessionRecorded, the one before is in f.
	in.mu.Lock()
	f := l.Follow(in)
	in.bindLocked(c, l)
	in.unholdLocked(c)
	in.bindSessionLocked(c, f.SessionID)
	in.mu.Unlock()
	in.log.Info("a2a turn started an agent instance", "profile", c.key.profile, "context_id", c.key.context,
		"session_id", f.SessionID, "lease_id", l.ID(), "pid", f.PID, "binary", f.Binary, "resumed", session != "")
	return l, nil
}

// msgAdopted is upstream's line for a conversation that adopted a live
// lease; held_until_idle (ours) says whether its next input waits.
const msgAdopted = "a2a turn adopted a live instance already running its session"

// adopt binds a conversation to a live lease of its session it did not
// start in this process, typically one restored after a gateway restart.
// Its instance may still be inside a turn: when it last reported work, or
// has reported nothing since this process attached and the conversation
// had a task in flight when the broker stopped. Then it is told to cancel
// and the next input is held until it reports idle. Otherwise it is idle,
// and the next input goes at once.
func (in *ingress) adopt(c *conv, l *gateway.Lease, session string) {
	in.mu.Lock()
	defer in.mu.Unlock()
	// One step: a status the instance reports from here on reaches this
	// conversation (Payload), and the one before is in reported.
	reported := l.Follow(in).Reported
	in.bindLocked(c, l)
	interrupted := in.store.TakeInterrupted(c.key.principal, c.key.profile, c.key.context)
	if reported == brokerframe.StateIdle || reported == "" && !interrupted {
		in.unholdLocked(c)
		in.log.Info(msgAdopted, "profile", c.key.profile, "context_id", c.key.context, "session_id", session, "lease_id", l.ID(),
			"held_until_idle", false)
		return
	}
	in.holdLocked(c, "")
	c.cancelSent = true
	in.sendLocked(l, brokerframe.IO{Type: brokerframe.IOCancel, Source: sourceA2A})
	in.log.Info(msgAdopted, "profile", c.key.profile, "context_id", c.key.context, "session_id", session, "lease_id", l.ID(),
		"held_until_idle", true, "reported", reported)
}

// holdLocked holds c's next input until the instance reports idle (of
// turn, when known), bounded by idleWait.
func (in *ingress) holdLocked(c *conv, turn string) {
	in.unholdLocked(c)
	c.busy, c.busyTurn = true, turn
	c.busyGen++
	gen := c.busyGen
	c.busyTimer = time.AfterFunc(idleWait, func() {
		in.mu.Lock()
		defer in.mu.Unlock()
		if !c.busy || c.busyGen != gen {
			return
		}
		in.log.Warn("an A2A conversation's instance did not report idle after a turn no task owns; sending the next message anyway",
			"profile", c.key.profile, "wait", idleWait)
		in.unholdLocked(c)
		in.kickLocked(c)
	})
}

func (in *ingress) unholdLocked(c *conv) {
	c.busy, c.busyTurn, c.cancelSent, c.cancelTail = false, "", false, false
	if c.busyTimer != nil {
		c.busyTimer.Stop()
		c.busyTimer = nil
	}
}

// bindLocked makes l (nil: none) the lease c runs on.
func (in *ingress) bindLocked(c *conv, l *gateway.Lease) {
	if c.lease != nil {
		delete(in.byLease, c.lease)
	}
	c.lease = l
	if l != nil {
		in.byLease[l] = c
	}
}

// SessionRecorded binds the conversation on l to the session its instance
// reported after the claim was answered (an engine that names its session
// lazily), so that the context resumes it once the instance is gone.
func (in *ingress) SessionRecorded(l *gateway.Lease, id string) {
	in.mu.Lock()
	defer in.mu.Unlock()
	if c := in.byLease[l]; c != nil {
		in.bindSessionLocked(c, id)
	}
}

// bindSessionLocked makes id the conversation's session, durably in
// a2a-contexts.jsonl; "" (none reported yet) changes nothing.
func (in *ingress) bindSessionLocked(c *conv, id string) {
	if id != "" && c.session != id {
		c.session = id
		in.contexts.Put(contextBinding{Principal: c.key.principal, Profile: c.key.profile, ContextID: c.key.context, SessionID: id})
	}
}

// directStreams bounds how many streams one payload's read pump writes
// itself; the rest are left to their handlers.
const directStreams = 4

// Payload is the instance's read pump handing over one io payload. The
// events it publishes are written from here, after in.mu is released.
func (in *ingress) Payload(l *gateway.Lease, p json.RawMessage) {
	var direct [directStreams]*a2a.Stream
	in.mu.Lock()
	in.direct = true
	in.payloadLocked(l, p)
	n := copy(direct[:], in.written)
	for _, s := range in.written[n:] {
		s.Signal()
	}
	clear(in.written)
	in.direct, in.written = false, in.written[:0]
	in.mu.Unlock()
	for _, s := range direct[:n] {
		s.WriteDirect()
	}
}

func (in *ingress) payloadLocked(l *gateway.Lease, p json.RawMessage) {
	c := in.byLease[l]
	if c == nil {
		return
	}
	if c.busy {
		in.watchIdleLocked(c, p)
		return
	}
	if c.cancelTail && in.cancelTailLocked(c, p) {
		return
	}
	t := c.active
	if t == nil || !c.sent {
		return // not this task's: its input has not gone yet
	}
	switch t.turn.Apply(p) {
	case a2a.StepNone:
		in.approvalLocked(t, p)
	case a2a.StepWorking:
		in.setStateLocked(t, a2a.StateWorking, "")
	case a2a.StepInputRequired:
		in.askLocked(t)
	case a2a.StepCompleted:
		in.completeLocked(t)
	case a2a.StepCanceled:
		// The instance still ends the turn with a status idle, which must
		// not reach the next task (an instance may reuse the turn id of a
		// turn it cancelled): the next input waits for it.
		in.holdLocked(c, t.turn.TurnID())
		in.setStateLocked(t, a2a.StateCanceled, textCanceled)
	}
}

// approvalLocked logs a tool approval request, which has no A2A meaning:
// the turn waits for an answer no A2A client can send (upstream's WARN).
func (in *ingress) approvalLocked(t *liveTask, p json.RawMessage) {
	if !bytes.Contains(p, []byte(brokerframe.IOApprovalRequest)) {
		return // the common case: a delta
	}
	var io brokerframe.IO
	if json.Unmarshal(p, &io) != nil || io.Type != brokerframe.IOApprovalRequest {
		return
	}
	in.log.Warn("a2a ingress received a tool approval request it cannot express; the turn will wait for an approval no A2A client can send",
		"profile", t.rec.Profile, "task_id", t.rec.Task.ID, "prompt_id", io.PromptID)
}

// watchIdleLocked ends a conversation's wait for a turn no task owns.
func (in *ingress) watchIdleLocked(c *conv, p json.RawMessage) {
	var io brokerframe.IO
	if json.Unmarshal(p, &io) != nil || io.Type != brokerframe.IOStatus || io.State != brokerframe.StateIdle {
		return
	}
	if c.busyTurn != "" && io.TurnID != "" && io.TurnID != c.busyTurn {
		return
	}
	tail := c.cancelSent
	in.unholdLocked(c)
	c.cancelTail = tail
	in.kickLocked(c)
}

// cancelTailLocked reports whether p belongs to the tail of a turn that
// was told to cancel and reported idle: an output or a cancel.complete
// (which ends the tail). Anything else is the next turn's, and ends it too.
func (in *ingress) cancelTailLocked(c *conv, p json.RawMessage) bool {
	var io brokerframe.IO
	_ = json.Unmarshal(p, &io)
	switch io.Type {
	case brokerframe.IOOutput:
		return true
	case brokerframe.IOCancelComplete:
		c.cancelTail = false
		return true
	}
	c.cancelTail = false
	return false
}

// abandonTurnLocked tells the instance to cancel t's turn and holds the
// conversation's next input until the instance reports idle. Called before
// t settles, so that the settling cannot send the next input first.
func (in *ingress) abandonTurnLocked(c *conv, t *liveTask) {
	if c.lease == nil || c.active != t || !c.sent {
		return
	}
	in.holdLocked(c, t.turn.TurnID())
	c.cancelSent = true
	in.sendLocked(c.lease, brokerframe.IO{Type: brokerframe.IOCancel, TurnID: t.turn.TurnID(), Source: sourceA2A})
}

func (in *ingress) askLocked(t *liveTask) {
	q := t.turn.Question()
	msg := a2a.AgentMessage(t.rec.Task, q.Text())
	// upstream's key, then ours with the whole question
	msg.Metadata = map[string]any{"nexus.hitl.requestId": q.RequestID, "nexus.hitl": map[string]any{"request_id": q.RequestID, "mode": q.Mode, "choices": q.Choices}}
	now := time.Now()
	t.rec.Task.Status = a2a.Status{State: a2a.StateInputRequired, Message: msg, Timestamp: &now}
	close(t.parked)
	t.parked = make(chan struct{})
	in.publishLocked(t, a2a.Event{StatusUpdate: &a2a.StatusUpdate{TaskID: t.rec.Task.ID, ContextID: t.rec.Task.ContextID, Status: t.rec.Task.Status}})
	if d := in.boot.A2A.Tasks.InputTimeout.D(); d > 0 {
		if t.askTimer != nil {
			t.askTimer.Stop()
		}
		t.askTimer = time.AfterFunc(d, func() { in.inputTimedOut(t) })
	}
}

func (in *ingress) inputTimedOut(t *liveTask) {
	in.mu.Lock()
	defer in.mu.Unlock()
	if isSettled(t) || t.rec.Task.Status.State != a2a.StateInputRequired {
		return
	}
	d := in.boot.A2A.Tasks.InputTimeout.D()
	in.abandonTurnLocked(t.conv, t)
	in.setStateLocked(t, a2a.StateFailed, fmt.Sprintf(textInputTimeout, d))
	in.log.Warn("a2a task abandoned: the agent's question went unanswered", "profile", t.rec.Profile, "task_id", t.rec.Task.ID,
		"context_id", t.rec.Task.ContextID, "input_timeout", d)
}

func (in *ingress) completeLocked(t *liveTask) {
	// The id and name are upstream's (and nexus.io.a2a's): one answer per
	// task, so the task id makes the artifact id unique.
	art := a2a.Artifact{ArtifactID: t.rec.Task.ID + "-response", Name: "response", Parts: []a2a.Part{a2a.TextPart(t.turn.Answer())}}
	t.rec.Task.Artifacts = append(t.rec.Task.Artifacts, art)
	up := a2a.Event{ArtifactUpdate: &a2a.ArtifactUpdate{TaskID: t.rec.Task.ID, ContextID: t.rec.Task.ContextID, Artifact: art, LastChunk: true}}
	in.setStateLocked(t, a2a.StateCompleted, "", up)
}

// Closed settles the active task of a lease that ended (crash, idle,
// release): its socket drained first, so an answer it sent has already
// completed the task.
func (in *ingress) Closed(l *gateway.Lease) {
	in.mu.Lock()
	defer in.mu.Unlock()
	c := in.byLease[l]
	if c == nil {
		return
	}
	in.log.Info("a2a agent instance stopped", "lease_id", l.ID())
	in.bindLocked(c, nil)
	in.unholdLocked(c)
	if t := c.active; t != nil && c.sent {
		in.instanceGoneLocked(t, l)
	}
	// An input not sent yet goes to the conversation's next instance.
	in.kickLocked(c)
}

// instanceGoneLocked fails a task whose instance (l's) went away, saying how.
func (in *ingress) instanceGoneLocked(t *liveTask, l *gateway.Lease) {
	how := l.EndedHow() + " before the turn finished"
	in.log.Warn("a2a task failed because its agent instance went away", "profile", t.rec.Profile, "task_id", t.rec.Task.ID, "reason", how)
	in.setStateLocked(t, a2a.StateFailed, how)
}
