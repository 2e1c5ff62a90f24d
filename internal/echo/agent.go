package echo

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/logbound"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// The special inputs. Anything else is echoed.
const (
	cmdEnv        = "/env"
	cmdID         = "/id"
	cmdSpawnChild = "/spawn-child"
	// cmdRun runs the rest of the line with sh -c and answers with its
	// output; served only with EnvAllowRun set.
	cmdRun = "/run "
	cmdAsk = "/ask "
	// cmdApprove asks for a tool approval (approval.request) and answers
	// without waiting for one: a payload an A2A client cannot answer.
	cmdApprove = "/approve "
	cmdBig     = "/big "
	// cmdDrop drops the broker connection abruptly and stays away for the
	// given duration before redialing: it exercises the broker holding
	// client frames while an instance redials.
	cmdDrop = "/drop "
)

const (
	bigChunk = "0123456789"
	// maxBig keeps "/big N" from asking for more memory than a test needs.
	maxBig = 1_000_000
	// crashFlushTimeout bounds how long a crash knob waits for its frames to
	// reach the socket, so a crash on a dead link still happens.
	crashFlushTimeout = 5 * time.Second
)

// agent is the deterministic fake engine. Turns run one at a time on the
// goroutine in run; the read loop hands it payloads through handle and never
// waits for a turn.
type agent struct {
	sess   *session // owned by the run goroutine
	send   *sender
	echoes *echoes
	knobs  knobs
	log    *slog.Logger
	// quiet bounds the lines a broker can cause per frame (logbound).
	quiet  *logbound.Limiter
	failed func(error) // a turn could not be persisted: the instance must stop
	// drop cuts the broker connection for a while (cmdDrop); set by Run.
	drop func(time.Duration)

	mu      sync.Mutex
	pending []string      // inputs waiting for the running turn
	current *turn         // the running turn, nil between turns
	wake    chan struct{} // capacity 1: pending grew
}

// turn is the state the read loop may touch while a turn runs.
type turn struct {
	id     string
	cancel context.CancelFunc
	askID  string              // request id of the open /ask; guarded by agent.mu
	answer chan brokerframe.IO // capacity 1: the hitl.response for askID
}

func newAgent(sess *session, send *sender, echoes *echoes, k knobs, log *slog.Logger, failed func(error)) *agent {
	return &agent{sess: sess, send: send, echoes: echoes, knobs: k, log: log, quiet: logbound.New(log, logbound.Window), failed: failed, wake: make(chan struct{}, 1)}
}

// handle routes one io payload from the broker. input queues a turn; cancel
// and hitl.response act on the running turn at once; anything else is
// echoed by the echoes goroutine, so echoes never wait behind a slow turn
// and a cancel never waits behind an echo.
func (a *agent) handle(payload json.RawMessage) {
	switch string(payloadType(payload)) {
	case brokerframe.IOInput, brokerframe.IOCancel, brokerframe.IOHITLResponse:
	default:
		a.echoes.add(payload)
		return
	}
	var m brokerframe.IO
	if err := json.Unmarshal(payload, &m); err != nil {
		a.quiet.Warn(brokerSubject, "dropping a malformed io payload", "error", err)
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	switch m.Type {
	case brokerframe.IOInput:
		a.pending = append(a.pending, m.Content)
		wake(a.wake)
	case brokerframe.IOCancel:
		if t := a.current; t != nil && (m.TurnID == "" || m.TurnID == t.id) {
			t.cancel()
			return
		}
		a.quiet.Log(slog.LevelInfo, brokerSubject, "cancel names no running turn", "turn_id", m.TurnID)
	case brokerframe.IOHITLResponse:
		if t := a.current; t != nil && t.askID != "" && m.RequestID == t.askID {
			t.askID = "" // one answer per question; answer has room for it
			t.answer <- m
			return
		}
		a.quiet.Log(slog.LevelInfo, brokerSubject, "hitl.response names no open question", "request_id", m.RequestID)
	}
}

// run executes queued inputs in order until ctx ends.
func (a *agent) run(ctx context.Context) {
	for {
		a.mu.Lock()
		if len(a.pending) == 0 {
			a.mu.Unlock()
			select {
			case <-ctx.Done():
				return
			case <-a.wake:
				continue
			}
		}
		input := a.pending[0]
		a.pending[0] = "" // the backing array outlives this input
		a.pending = a.pending[1:]
		a.mu.Unlock()
		a.runTurn(ctx, input)
		if ctx.Err() != nil {
			return
		}
	}
}

// reply is a computed answer and the pieces it is streamed in; the pieces
// are substrings of text and concatenate to it.
type reply struct {
	text   string
	chunks []string
}

func (a *agent) runTurn(ctx context.Context, input string) {
	n := a.sess.turns + 1
	tctx, cancel := context.WithCancel(ctx)
	defer cancel()
	t := &turn{id: fmt.Sprintf("%s-%d", a.sess.id, n), cancel: cancel, answer: make(chan brokerframe.IO, 1)}
	a.setCurrent(t)
	defer a.setCurrent(nil)

	started := a.knobs.WorkState
	if started == "" {
		started = brokerframe.StateThinking
	}
	a.status(started, t.id)
	r, err := a.compute(tctx, t, n, input)
	if err == nil {
		err = a.stream(tctx, t.id, r.chunks)
	}
	if err != nil {
		if ctx.Err() != nil {
			return // the instance is stopping; nobody is waiting for this turn
		}
		a.cancelled(t.id)
		return
	}
	a.send.io(brokerframe.IO{Type: brokerframe.IOStreamEnd, TurnID: t.id, FinishReason: "stop"})
	if err := a.sess.record(input, r.text); err != nil {
		a.failed(err)
		return
	}
	a.status(brokerframe.StateIdle, t.id)
	if a.knobs.Crash == CrashAfterAnswer {
		a.crash(ExitCrashAfterAnswer)
	}
}

// cancelled ends a cancelled turn: cancel.complete, then status idle; with
// StockStatus in the stock agent's order instead (its cancel plugin's
// cancelling status, the idle, a system output saying so, and then the
// cancel.complete), so the turn's last words come after its idle.
func (a *agent) cancelled(turnID string) {
	done := brokerframe.IO{Type: brokerframe.IOCancelComplete, TurnID: turnID, Resumable: new(bool)}
	if a.knobs.StockStatus {
		a.status("cancelling", turnID)
		a.status(brokerframe.StateIdle, turnID)
		a.send.io(brokerframe.IO{Type: brokerframe.IOOutput, TurnID: turnID, Role: "system", Content: "_Operation cancelled._"})
		a.send.io(done)
	} else {
		a.send.io(done)
		a.status(brokerframe.StateIdle, turnID)
	}
	a.log.Info("turn cancelled", "turn_id", turnID)
}

func (a *agent) setCurrent(t *turn) {
	a.mu.Lock()
	a.current = t
	a.mu.Unlock()
}

func (a *agent) status(state, turnID string) {
	if a.knobs.StockStatus {
		turnID = ""
	}
	a.send.io(brokerframe.IO{Type: brokerframe.IOStatus, State: state, TurnID: turnID})
}

// compute produces turn n's answer. Only /ask waits (for its hitl.response),
// so only /ask can fail, by being cancelled.
func (a *agent) compute(ctx context.Context, t *turn, n int, input string) (reply, error) {
	switch {
	case input == cmdEnv:
		return words(envNames()), nil
	case input == cmdID:
		return words(identity()), nil
	case input == cmdSpawnChild:
		return words(a.spawnChild()), nil
	}
	if command, ok := strings.CutPrefix(input, cmdRun); ok && a.knobs.AllowRun {
		return words(run(ctx, command)), nil
	}
	if q, ok := strings.CutPrefix(input, cmdAsk); ok && q != "" {
		return a.ask(ctx, t, q)
	}
	if call, ok := strings.CutPrefix(input, cmdApprove); ok && call != "" {
		a.send.io(brokerframe.IO{Type: brokerframe.IOApprovalRequest, TurnID: t.id, PromptID: newID(8), ToolCall: call, Description: "run " + call})
		return words("approval requested for " + call), nil
	}
	if s, ok := strings.CutPrefix(input, cmdDrop); ok {
		if d, err := time.ParseDuration(s); err == nil && d >= 0 && a.drop != nil {
			a.drop(d)
			return words("dropped for " + d.String()), nil
		}
	}
	if s, ok := strings.CutPrefix(input, cmdBig); ok {
		if count, err := strconv.Atoi(s); err == nil && count >= 0 && count <= maxBig {
			text := strings.Repeat(bigChunk, count)
			chunks := make([]string, count)
			for i := range chunks {
				chunks[i] = text[i*len(bigChunk) : (i+1)*len(bigChunk)]
			}
			return reply{text: text, chunks: chunks}, nil
		}
	}
	text := fmt.Sprintf("echo #%d: %s", n, input)
	if a.sess.turns > 0 {
		text += fmt.Sprintf(" (earlier: %s)", a.sess.lastInput)
	}
	return words(text), nil
}

// words splits text into word-sized chunks, each keeping the spaces after it.
func words(text string) reply {
	var chunks []string
	for rest := text; rest != ""; {
		i := strings.IndexByte(rest, ' ')
		if i < 0 {
			chunks = append(chunks, rest)
			break
		}
		j := i
		for j < len(rest) && rest[j] == ' ' {
			j++
		}
		chunks = append(chunks, rest[:j])
		rest = rest[j:]
	}
	return reply{text: text, chunks: chunks}
}

// ask puts a yes/no question to the client and waits for its answer. The
// turn stays open (status waiting) until the answer or a cancel.
func (a *agent) ask(ctx context.Context, t *turn, question string) (reply, error) {
	reqID := newID(8)
	a.mu.Lock()
	t.askID = reqID
	a.mu.Unlock()
	a.send.io(brokerframe.IO{
		Type:      brokerframe.IOHITLRequest,
		TurnID:    t.id,
		RequestID: reqID,
		Prompt:    question,
		Mode:      "choice",
		Choices:   []brokerframe.Choice{{ID: "yes", Label: "Yes"}, {ID: "no", Label: "No"}},
	})
	a.status(brokerframe.StateWaiting, t.id)
	select {
	case <-ctx.Done():
		return reply{}, ctx.Err()
	case r := <-t.answer:
		a.status(brokerframe.StateThinking, t.id)
		chosen := r.ChoiceID
		if chosen == "" {
			chosen = r.FreeText
		}
		return words("answered: " + chosen), nil
	}
}

// stream sends the chunks as stream.delta payloads. The slow-turn knob waits
// before each one; a cancel is honoured between any two. A long answer is
// paced to the socket (and so waits out a disconnection) instead of
// outrunning the outbox, which would evict the answer's own beginning.
func (a *agent) stream(ctx context.Context, turnID string, chunks []string) error {
	var wait *time.Timer
	if a.knobs.SlowTurn > 0 {
		wait = time.NewTimer(a.knobs.SlowTurn)
		defer wait.Stop()
	}
	for i, c := range chunks {
		if wait != nil {
			if i > 0 {
				wait.Reset(a.knobs.SlowTurn)
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-wait.C:
			}
		} else if err := ctx.Err(); err != nil {
			return err
		}
		a.send.io(brokerframe.IO{Type: brokerframe.IOStreamDelta, TurnID: turnID, Content: c})
		if i == 0 && a.knobs.Crash == CrashMidTurn {
			a.crash(ExitCrashMidTurn)
		}
		if err := a.send.out.waitRoom(ctx); err != nil {
			return err
		}
	}
	return nil
}

// crash waits (bounded) until what was sent is on the socket, then exits
// without any cleanup: the broker must see a process that died, not one that
// said goodbye.
func (a *agent) crash(code int) {
	a.log.Warn("crashing on purpose", "knob", EnvCrash, "mode", a.knobs.Crash, "exit_code", code)
	t := time.NewTimer(crashFlushTimeout)
	select {
	case <-a.send.out.flushed():
	case <-t.C:
	}
	os.Exit(code)
}

// envNames lists the names, never the values, of the process environment:
// tests use it to check what a spawn passed without leaking secrets.
func envNames() string {
	env := os.Environ()
	names := make([]string, 0, len(env))
	for _, kv := range env {
		name, _, _ := strings.Cut(kv, "=")
		names = append(names, name)
	}
	slices.Sort(names)
	return strings.Join(names, ",")
}

// identity reports who the instance runs as and where, for run_as tests.
func identity() string {
	groups, err := os.Getgroups()
	var gs []string
	if err == nil {
		slices.Sort(groups)
		for _, g := range groups {
			gs = append(gs, strconv.Itoa(g))
		}
	}
	cwd, err := os.Getwd()
	if err != nil {
		cwd = "?"
	}
	return fmt.Sprintf("uid=%d gid=%d groups=%s home=%s cwd=%s",
		os.Getuid(), os.Getgid(), strings.Join(gs, ","), os.Getenv("HOME"), cwd)
}

// run runs a shell command and returns its combined output, trimmed, or
// why it failed.
func run(ctx context.Context, command string) string {
	out, err := exec.CommandContext(ctx, "/bin/sh", "-c", command).CombinedOutput()
	if err != nil {
		return fmt.Sprintf("run failed: %v: %s", err, bytes.TrimSpace(out))
	}
	return string(bytes.TrimSpace(out))
}

// spawnChild starts a grandchild in the instance's own process group, so
// tests can check that a release or crash reaps the whole group.
func (a *agent) spawnChild() string {
	cmd := exec.Command("sleep", "3600")
	if err := cmd.Start(); err != nil {
		return "spawn-child failed: " + err.Error()
	}
	go cmd.Wait() // reap it if it dies first, so it never lingers as a zombie
	a.log.Info("spawned a child", "pid", cmd.Process.Pid)
	return fmt.Sprintf("child=%d", cmd.Process.Pid)
}
