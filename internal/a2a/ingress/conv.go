package ingress

import (
	"context"
	"log/slog"
	"net/http"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/a2a"
	"github.com/nexus-broker/nexus-broker/internal/bindindex"
	"github.com/nexus-broker/nexus-broker/internal/config"
	"github.com/nexus-broker/nexus-broker/internal/gateway"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// A conversation (principal, profile, contextId) is bound to an engine
// session, runs one task at a time on an ordinary lease, and queues the
// rest. Every task change is put in the store before any stream sees it.

const (
	contextsFile = "a2a-contexts.jsonl"
	maxContexts  = 4096
	// idleWait bounds how long a conversation waits for its instance to
	// report idle after a turn no task owns any more (one cancelled, timed
	// out waiting for input, or in flight when the broker restarted)
	// before sending the next input anyway: a safety net for an instance
	// that never says, not the ordinary path.
	idleWait = 10 * time.Second
	// cancelWait bounds how long CancelTask waits for the instance to
	// acknowledge before answering with the task as it stands.
	cancelWait = 10 * time.Second
	sourceA2A  = "broker.a2a"
)

// Status texts a task settles with, in upstream's words where it has them;
// they never name a lease.
const (
	textSpawnFailed  = "an agent instance for profile %q could not be started: %s"
	textSpawnRefused = "this broker refused to start an agent instance for profile %q: %s"
	textInputTimeout = "the agent asked a question and no answer arrived within %s, so the turn was abandoned"
	textCanceled     = "the task was canceled by the client"
)

// The ErrorInfo details upstream's refusals of a message naming a task
// carry, for a client to branch on rather than on prose.
const (
	detailTerminal        = "TASK_ALREADY_TERMINAL"
	detailNotAwaiting     = "TASK_NOT_AWAITING_INPUT"
	detailContextMismatch = "TASK_CONTEXT_MISMATCH"
)

// contextBinding is one line of a2a-contexts.jsonl.
type contextBinding struct {
	Principal string `json:"principal"`
	Profile   string `json:"profile"`
	ContextID string `json:"context_id"`
	SessionID string `json:"session_id"`
}

type convKey struct{ principal, profile, context string }

func (k convKey) String() string { return k.principal + "\x00" + k.profile + "\x00" + k.context }

// ingress is the A2A front door's state. Everything under mu.
type ingress struct {
	core Core
	log  *slog.Logger
	// boot is the configuration the gateway booted with.
	boot *config.Config
	// mux is the one the door's routes are on.
	mux      *http.ServeMux
	store    *a2a.Store
	contexts *bindindex.Index[contextBinding] // in memory without state_dir, or when the file is off
	profiles atomic.Pointer[a2a.Profiles]

	mu sync.Mutex
	// convs are the conversations with something going on: a task, a
	// lease, a spawn or a hold. A quiet one is forgotten (its session is in
	// contexts) so that conversations cost memory only while they live.
	convs   map[convKey]*conv
	byLease map[*gateway.Lease]*conv // the conversation each A2A lease serves
	live    map[string]*liveTask     // tasks not yet terminal, by id
	// direct is set while the read pump publishes (payload): the streams
	// it queues events on go to written, for it to write.
	direct  bool
	written []*a2a.Stream
}

// conv is one conversation. It moves on events only (a message arrives, a
// task settles, the instance reports idle, a lease starts or ends): see
// advanceLocked.
type conv struct {
	key     convKey
	session string
	lease   *gateway.Lease
	queue   []*liveTask // waiting, oldest first
	active  *liveTask   // the task the conversation is on; nil between tasks
	// sent is set once active's input went to the instance: only then are
	// the instance's payloads active's.
	sent bool
	// starting is set while a goroutine gets the conversation an instance.
	starting bool
	// busy holds the next input while the instance may still be inside a
	// turn no task owns; its status idle (of busyTurn, when known) or
	// busyTimer after idleWait ends the hold.
	busy      bool
	busyTurn  string
	busyGen   int
	busyTimer *time.Timer
	// cancelSent: the held turn was told to cancel. cancelTail: its status
	// idle ended the hold, and what an instance says about a cancel after
	// that idle (the stock agent's system output and cancel.complete) is
	// still that turn's, not the next task's; the next task's own first
	// payload, or the cancel.complete, ends it.
	cancelSent, cancelTail bool
}

// liveTask is a task not yet terminal.
type liveTask struct {
	rec       *a2a.Record
	conv      *conv
	input     string
	turn      a2a.Turn
	subs      map[*a2a.Stream]struct{}
	settled   chan struct{} // closed at a terminal state
	parked    chan struct{} // replaced each time the task reaches INPUT_REQUIRED or ends
	askTimer  *time.Timer
	cancelReq bool
}

// open opens the task store and the context index in dir ("": in memory).
func (in *ingress) open(dir string) {
	in.convs, in.byLease, in.live = map[convKey]*conv{}, map[*gateway.Lease]*conv{}, map[string]*liveTask{}
	t, log := in.boot.A2A.Tasks, in.log
	in.store = a2a.OpenStore(dir, a2a.Policy{TTL: t.TTL.D(), MaxPerContext: t.MaxPerContext, MaxBytes: int64(t.MaxStoreBytes)}, log)
	spec := bindindex.Spec[contextBinding]{
		Limit: maxContexts,
		Key: func(b contextBinding) (string, bool) {
			k := convKey{b.Principal, b.Profile, b.ContextID}
			return k.String(), b.ContextID != "" && b.SessionID != "" && b.Profile != ""
		},
		What: "A2A context → session index",
		Off:  "conversation continuity lasts only as long as this process",
		Skip: "skipped unreadable a2a context index records; the broker was most likely killed mid-write", // upstream's words, one line each
		Lost: "this binding is kept in memory only",
	}
	if dir != "" {
		spec.Path = filepath.Join(dir, contextsFile)
		if in.contexts = bindindex.Open(spec, log); in.contexts != nil {
			n, skipped := in.contexts.Opened()
			log.Info("a2a context index opened", "path", spec.Path, "bindings", n, "skipped_records", skipped)
		}
	}
	if in.contexts == nil {
		// In memory: continuity lasts as long as this process, with the
		// same cap, so a quiet conversation needs no memory of its own.
		spec.Path = ""
		in.contexts = bindindex.Open(spec, log)
	}
}

// stopped says whether the gateway is shutting down.
func (in *ingress) stopped() bool {
	select {
	case <-in.core.Done():
		return true
	default:
		return false
	}
}

// --- submitting ---------------------------------------------------------

// submit accepts a new message on its conversation: the task is stored as
// SUBMITTED and queued; it runs when the task ahead of it is terminal. A
// stream is returned when stream is set, registered before the task can
// change.
func (in *ingress) submit(principal, profile string, msg *a2a.Message, text string, stream bool) (*liveTask, *a2a.Stream) {
	if msg.ContextID == "" {
		msg.ContextID = in.newID()
	}
	now := time.Now()
	t := &liveTask{
		input:   text,
		subs:    map[*a2a.Stream]struct{}{},
		settled: make(chan struct{}),
		parked:  make(chan struct{}),
	}
	id := in.newID()
	msg.TaskID = id
	t.rec = &a2a.Record{Principal: principal, Profile: profile, Created: now, Task: a2a.Task{
		ID: id, ContextID: msg.ContextID, Status: a2a.Status{State: a2a.StateSubmitted, Timestamp: &now},
		History: []a2a.Message{*msg},
	}}
	key := convKey{principal, profile, msg.ContextID}
	in.mu.Lock()
	c := in.convs[key]
	if c == nil {
		c = &conv{key: key}
		in.convs[key] = c
	}
	t.conv = c
	in.store.Put(t.rec)
	in.live[id] = t
	var s *a2a.Stream
	if stream {
		s = in.subscribeLocked(t)
	}
	c.queue = append(c.queue, t)
	send := in.advanceLocked(c)
	if c.active != nil && c.active != t {
		in.log.Warn("a2a task queued behind the conversation's active turn", "profile", profile, "task_id", id,
			"context_id", msg.ContextID, "ahead", len(c.queue))
	}
	in.mu.Unlock()
	if send != nil {
		send() // on a warm conversation the input goes from here, with no hop
	}
	return t, s
}

// subscribeLocked attaches a stream to t; its first event is t's snapshot.
func (in *ingress) subscribeLocked(t *liveTask) *a2a.Stream {
	snap := t.rec.Task.Clone()
	s := a2a.NewStream(a2a.Event{Task: &snap})
	t.subs[s] = struct{}{}
	return s
}

func (in *ingress) unsubscribe(t *liveTask, s *a2a.Stream) {
	in.mu.Lock()
	defer in.mu.Unlock()
	delete(t.subs, s)
	s.End()
}

// publishLocked stores t and then queues evs on every stream: written by
// the read pump once in.mu is released when it is the publisher (see
// payload), else by the stream's handler. A terminal state is written to
// the file; a move between live states is kept in memory (see
// a2a.Store.Update).
func (in *ingress) publishLocked(t *liveTask, evs ...a2a.Event) {
	if a2a.Terminal(t.rec.Task.Status.State) {
		in.store.Put(t.rec)
	} else {
		in.store.Update(t.rec)
	}
	for s := range t.subs {
		if !s.Push(evs) {
			delete(t.subs, s)
		}
		if in.direct {
			in.written = append(in.written, s)
		} else {
			s.Signal()
		}
	}
}

// setStateLocked moves t to state with an optional agent message, stores it
// and streams the status update (after extra events, such as the answer).
func (in *ingress) setStateLocked(t *liveTask, state, text string, extra ...a2a.Event) {
	now := time.Now()
	st := a2a.Status{State: state, Timestamp: &now}
	if text != "" {
		st.Message = a2a.AgentMessage(t.rec.Task, text)
	}
	t.rec.Task.Status = st
	evs := append(extra, a2a.Event{StatusUpdate: &a2a.StatusUpdate{TaskID: t.rec.Task.ID, ContextID: t.rec.Task.ContextID, Status: st}})
	if state == a2a.StateInputRequired {
		close(t.parked)
		t.parked = make(chan struct{})
	}
	if a2a.Terminal(state) {
		if t.askTimer != nil {
			t.askTimer.Stop()
		}
		delete(in.live, t.rec.Task.ID)
		close(t.parked)
		close(t.settled)
	}
	in.publishLocked(t, evs...)
	if c := t.conv; a2a.Terminal(state) && c.active == t {
		c.active, c.sent = nil, false
		in.kickLocked(c)
	}
}

// --- reading and cancelling ---------------------------------------------

// lookupLocked is a live task in the caller's scope.
func (in *ingress) lookupLocked(principal, profile, id string) *liveTask {
	t := in.live[id]
	if t == nil || t.rec.Principal != principal || t.rec.Profile != profile {
		return nil
	}
	return t
}

// answer routes a message naming a task parked in INPUT_REQUIRED to the
// instance as its hitl.response.
func (in *ingress) answer(principal, profile string, msg *a2a.Message, text string) (*liveTask, *a2a.Error) {
	in.mu.Lock()
	defer in.mu.Unlock()
	t := in.lookupLocked(principal, profile, msg.TaskID)
	if t == nil {
		if _, ok := in.store.Get(principal, profile, msg.TaskID); ok {
			return nil, a2a.ErrUnsupportedOp.With("task %q has ended and accepts no further messages; send a message with no taskId to start a new task", msg.TaskID).
				WithMeta("taskId", msg.TaskID, "detail", detailTerminal)
		}
		return nil, a2a.TaskNotFound(msg.TaskID)
	}
	if msg.ContextID != "" && msg.ContextID != t.rec.Task.ContextID {
		return nil, a2a.ErrUnsupportedOp.With("message names task %q but context %q; a task is continued by naming the context it belongs to, %q",
			msg.TaskID, msg.ContextID, t.rec.Task.ContextID).WithMeta("taskId", msg.TaskID, "contextId", t.rec.Task.ContextID, "detail", detailContextMismatch)
	}
	if t.rec.Task.Status.State != a2a.StateInputRequired || t.conv.lease == nil {
		return nil, a2a.ErrUnsupportedOp.With("task %q is not waiting for input; a message may only continue a task that reported %s", msg.TaskID, a2a.StateName(a2a.StateInputRequired)).
			WithMeta("taskId", msg.TaskID, "detail", detailNotAwaiting)
	}
	reply := a2a.Reply(t.turn.Question(), text)
	if aerr := in.refuseOversize(t.conv.lease, reply); aerr != nil {
		return nil, aerr
	}
	if msg.ContextID == "" {
		msg.ContextID = t.rec.Task.ContextID
	}
	t.rec.Task.History = append(t.rec.Task.History, *msg)
	in.store.Put(t.rec) // the answer is history: written, unlike the state moves
	if t.askTimer != nil {
		t.askTimer.Stop()
	}
	in.sendLocked(t.conv.lease, reply)
	in.setStateLocked(t, a2a.StateWorking, "")
	return t, nil
}

// cancel is CancelTask: a queued task leaves the queue at once; the running
// one is asked to cancel and settles on the instance's acknowledgement (or
// at once when no turn is bound yet).
func (in *ingress) cancel(principal, profile, id string) (*a2a.Task, *a2a.Error) {
	task, aerr := in.cancelTask(principal, profile, id)
	if aerr == nil && task.Status.State == a2a.StateCanceled {
		in.log.Info("a2a task canceled", "profile", profile, "task_id", id)
	}
	return task, aerr
}

func (in *ingress) cancelTask(principal, profile, id string) (*a2a.Task, *a2a.Error) {
	in.mu.Lock()
	t := in.lookupLocked(principal, profile, id)
	if t == nil {
		in.mu.Unlock()
		if r, ok := in.store.Get(principal, profile, id); ok {
			return nil, a2a.ErrTaskNotCancelable.With("task is in terminal state %s and cannot be canceled", a2a.StateName(r.Task.Status.State)).WithMeta("taskId", id)
		}
		return nil, a2a.TaskNotFound(id)
	}
	c := t.conv
	for i, q := range c.queue {
		if q == t {
			c.queue = append(c.queue[:i:i], c.queue[i+1:]...)
			in.setStateLocked(t, a2a.StateCanceled, textCanceled)
			snap := t.rec.Task.Clone()
			in.mu.Unlock()
			return &snap, nil
		}
	}
	if c.active == t && c.lease != nil && t.turn.TurnID() != "" {
		if !t.cancelReq {
			t.cancelReq = true
			in.sendLocked(c.lease, brokerframe.IO{Type: brokerframe.IOCancel, TurnID: t.turn.TurnID(), Source: sourceA2A})
		}
		in.mu.Unlock()
		select {
		case <-t.settled:
		case <-time.After(cancelWait):
		}
		in.mu.Lock()
		snap := t.rec.Task.Clone()
		in.mu.Unlock()
		return &snap, nil
	}
	// Not bound to a turn yet: settle now, and keep the next input back
	// until the instance is idle in case the input already reached it.
	in.abandonTurnLocked(c, t)
	in.setStateLocked(t, a2a.StateCanceled, textCanceled)
	snap := t.rec.Task.Clone()
	in.mu.Unlock()
	return &snap, nil
}

// subscribe is SubscribeToTask: a live task's stream opens on its snapshot;
// a terminal one gets its snapshot and the end.
func (in *ingress) subscribe(principal, profile, id string) (*a2a.Stream, func(), *a2a.Error) {
	in.mu.Lock()
	defer in.mu.Unlock()
	if t := in.lookupLocked(principal, profile, id); t != nil {
		s := in.subscribeLocked(t)
		return s, func() { in.unsubscribe(t, s) }, nil
	}
	r, ok := in.store.Get(principal, profile, id)
	if !ok {
		return nil, nil, a2a.TaskNotFound(id)
	}
	s := a2a.NewStream(a2a.Event{Task: &r.Task})
	s.End()
	return s, func() {}, nil
}

// wait blocks until t is terminal or parked in INPUT_REQUIRED, or ctx ends,
// and returns t as stored.
func (in *ingress) wait(ctx context.Context, t *liveTask) a2a.Task {
	in.mu.Lock()
	parked := t.parked
	in.mu.Unlock()
	select {
	case <-parked:
	case <-ctx.Done():
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	return t.rec.Task.Clone()
}
