package echo

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gorilla/websocket"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
	"github.com/nexus-broker/nexus-broker/pkg/dialenv"
)

func TestHandshakeAndShutdownFrame(t *testing.T) {
	t.Parallel()
	b := newFakeBroker(t)
	inst := spawn{}.start(t, b)
	c := b.accept(t)
	sid := c.handshake(t)
	if !regexp.MustCompile(`^[0-9a-f]{16}$`).MatchString(sid) {
		t.Errorf("session id %q, want 16 hex digits", sid)
	}
	dir := filepath.Join(sessionsRoot(inst.home), sid)
	for path, want := range map[string]os.FileMode{
		filepath.Join(inst.home, ".nexus"): 0o700,
		sessionsRoot(inst.home):            0o700,
		dir:                                0o700,
		filepath.Join(dir, transcriptName): 0o600,
	} {
		fi, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		if got := fi.Mode().Perm(); got != want {
			t.Errorf("%s: mode %v, want %v", path, got, want)
		}
	}

	c.send(t, brokerframe.Frame{Signal: brokerframe.SignalShutdown})
	if err := c.ended(t); !websocket.IsCloseError(err, websocket.CloseNormalClosure) {
		t.Errorf("connection ended with %v, want a normal close", err)
	}
	inst.expectExit(t, ExitOK)
	if n := b.accepted.Load(); n != 1 {
		t.Errorf("%d connections after shutdown, want 1: a shut-down instance must not redial", n)
	}
}

func TestTurnsAndTranscript(t *testing.T) {
	t.Parallel()
	b := newFakeBroker(t)
	inst := spawn{}.start(t, b)
	c := b.accept(t)
	sid := c.handshake(t)

	c.input(t, "hello world")
	c.expectTurn(t, sid+"-1", "echo ", "#1: ", "hello ", "world")
	c.input(t, "again")
	c.expectTurn(t, sid+"-2", "echo ", "#2: ", "again ", "(earlier: ", "hello ", "world)")

	want := []turnRecord{
		{Turn: 1, Input: "hello world", Answer: "echo #1: hello world"},
		{Turn: 2, Input: "again", Answer: "echo #2: again (earlier: hello world)"},
	}
	// The idle status follows the fsync, so the file is complete already.
	if got := inst.transcript(t, sid); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("transcript %+v, want %+v", got, want)
	}
	c.send(t, brokerframe.Frame{Signal: brokerframe.SignalShutdown})
	inst.expectExit(t, ExitOK)
}

func TestRecall(t *testing.T) {
	t.Parallel()
	b := newFakeBroker(t)
	home := t.TempDir()
	first := spawn{home: home}.start(t, b)
	c := b.accept(t)
	sid := c.handshake(t)
	c.input(t, "first")
	c.expectTurn(t, sid+"-1", "echo ", "#1: ", "first")
	c.send(t, brokerframe.Frame{Signal: brokerframe.SignalShutdown})
	first.expectExit(t, ExitOK)

	second := spawn{home: home, args: []string{"-recall", sid}}.start(t, b)
	c = b.accept(t)
	if got := c.handshake(t); got != sid {
		t.Fatalf("recalled instance reported session %q, want %q", got, sid)
	}
	c.input(t, "second")
	c.expectTurn(t, sid+"-2", "echo ", "#2: ", "second ", "(earlier: ", "first)")
	c.send(t, brokerframe.Frame{Signal: brokerframe.SignalShutdown})
	second.expectExit(t, ExitOK)
	if n := len(second.transcript(t, sid)); n != 2 {
		t.Errorf("transcript has %d turns, want 2", n)
	}
}

func TestRecallRefusedBeforeDialing(t *testing.T) {
	t.Parallel()
	for _, id := range []string{"0123456789abcdef", "../escape", "a/b", ".."} {
		t.Run(id, func(t *testing.T) {
			t.Parallel()
			b := newFakeBroker(t)
			inst := spawn{args: []string{"-recall", id}}.start(t, b)
			inst.expectExit(t, ExitFailure)
			if !strings.Contains(inst.logs.String(), "session_id="+id) {
				t.Errorf("stderr does not name session %q:\n%s", id, inst.logs)
			}
			if n := b.accepted.Load(); n != 0 {
				t.Errorf("instance dialed the broker %d times; it must exit before dialing", n)
			}
		})
	}
}

func TestVerbatimEchoDoesNotWaitForATurn(t *testing.T) {
	t.Parallel()
	b := newFakeBroker(t)
	inst := spawn{env: []string{EnvSlowTurn + "=1h"}}.start(t, b)
	c := b.accept(t)
	sid := c.handshake(t)

	c.input(t, "slow")
	c.expectIOs(t, brokerframe.IO{Type: brokerframe.IOStatus, State: brokerframe.StateThinking, TurnID: sid + "-1"})
	for _, payload := range []string{
		`{"type":"echo","content":"x","n":5}`,
		`{"type":"approval.response","prompt_id":"p","approved":true,"extra":{"nested":[1,2.5,null]}}`,
		`"not an object"`,
	} {
		c.sendIO(t, payload)
		f := c.expectSignal(t, brokerframe.SignalIO)
		if string(f.Payload) != payload {
			t.Errorf("echoed payload %s, want %s", f.Payload, payload)
		}
	}

	c.sendIO(t, `{"type":"cancel","turn_id":"`+sid+`-1","source":"test"}`)
	resumable := false
	c.expectIOs(t,
		brokerframe.IO{Type: brokerframe.IOCancelComplete, TurnID: sid + "-1", Resumable: &resumable},
		brokerframe.IO{Type: brokerframe.IOStatus, State: brokerframe.StateIdle, TurnID: sid + "-1"})
	c.send(t, brokerframe.Frame{Signal: brokerframe.SignalShutdown})
	inst.expectExit(t, ExitOK)
	if n := len(inst.transcript(t, sid)); n != 0 {
		t.Errorf("a cancelled turn was recorded: %d turns", n)
	}
}

func TestAsk(t *testing.T) {
	t.Parallel()
	b := newFakeBroker(t)
	inst := spawn{}.start(t, b)
	c := b.accept(t)
	sid := c.handshake(t)
	turn := sid + "-1"

	c.input(t, "/ask proceed?")
	c.expectIOs(t, brokerframe.IO{Type: brokerframe.IOStatus, State: brokerframe.StateThinking, TurnID: turn})
	req := c.nextIO(t)
	if req.Type != brokerframe.IOHITLRequest || req.RequestID == "" {
		t.Fatalf("got %+v, want a hitl.request with a request id", req)
	}
	c.expectIOs(t, brokerframe.IO{Type: brokerframe.IOStatus, State: brokerframe.StateWaiting, TurnID: turn})
	want := brokerframe.IO{
		Type: brokerframe.IOHITLRequest, TurnID: turn, RequestID: req.RequestID, Prompt: "proceed?", Mode: "choice",
		Choices: []brokerframe.Choice{{ID: "yes", Label: "Yes"}, {ID: "no", Label: "No"}},
	}
	if !equalIO(req, want) {
		t.Errorf("hitl.request %+v, want %+v", req, want)
	}

	// An answer to another question changes nothing: the next frames come
	// from the real answer.
	c.sendIO(t, `{"type":"hitl.response","request_id":"other","choice_id":"no"}`)
	c.sendIO(t, `{"type":"hitl.response","request_id":"`+req.RequestID+`","choice_id":"yes"}`)
	c.expectTurn(t, turn, "answered: ", "yes")

	c.input(t, "/ask free?")
	turn = sid + "-2"
	c.expectIOs(t, brokerframe.IO{Type: brokerframe.IOStatus, State: brokerframe.StateThinking, TurnID: turn})
	req = c.nextIO(t)
	c.expectIOs(t, brokerframe.IO{Type: brokerframe.IOStatus, State: brokerframe.StateWaiting, TurnID: turn})
	c.sendIO(t, `{"type":"hitl.response","request_id":"`+req.RequestID+`","free_text":"maybe"}`)
	c.expectTurn(t, turn, "answered: ", "maybe")

	// A pending question is cancellable like any turn.
	c.input(t, "/ask never answered")
	turn = sid + "-3"
	c.expectIOs(t, brokerframe.IO{Type: brokerframe.IOStatus, State: brokerframe.StateThinking, TurnID: turn})
	c.nextIO(t)
	c.expectIOs(t, brokerframe.IO{Type: brokerframe.IOStatus, State: brokerframe.StateWaiting, TurnID: turn})
	c.sendIO(t, `{"type":"cancel","turn_id":"`+turn+`"}`)
	resumable := false
	c.expectIOs(t,
		brokerframe.IO{Type: brokerframe.IOCancelComplete, TurnID: turn, Resumable: &resumable},
		brokerframe.IO{Type: brokerframe.IOStatus, State: brokerframe.StateIdle, TurnID: turn})

	c.send(t, brokerframe.Frame{Signal: brokerframe.SignalShutdown})
	inst.expectExit(t, ExitOK)
	got := inst.transcript(t, sid)
	if len(got) != 2 || got[0].Answer != "answered: yes" || got[1].Input != "/ask free?" {
		t.Errorf("transcript %+v", got)
	}
}

func TestSpecialInputs(t *testing.T) {
	t.Parallel()
	b := newFakeBroker(t)
	cwd := t.TempDir()
	inst := spawn{dir: cwd, group: true, env: []string{"EXTRA_FROM_ENTRY=1"}}.start(t, b)
	c := b.accept(t)
	sid := c.handshake(t)

	c.input(t, "/env")
	c.expectTurn(t, sid+"-1", "EXTRA_FROM_ENTRY,HOME,LANG,NEXUS_BROKER_ADDR,NEXUS_BROKER_LEASE_ID,NEXUS_BROKER_SPAWN_SECRET,PATH,TZ")

	c.input(t, "/id")
	answer := collectAnswer(t, c, sid+"-2")
	re := regexp.MustCompile(`^uid=(\d+) gid=(\d+) groups=[0-9,]* home=(\S+) cwd=(\S+)$`)
	m := re.FindStringSubmatch(answer)
	if m == nil || m[1] != strconv.Itoa(os.Getuid()) || m[2] != strconv.Itoa(os.Getgid()) || m[3] != inst.home || m[4] != cwd {
		t.Errorf("/id answered %q; want uid=%d gid=%d home=%s cwd=%s", answer, os.Getuid(), os.Getgid(), inst.home, cwd)
	}

	c.input(t, "/spawn-child")
	answer = collectAnswer(t, c, sid+"-3")
	pid, err := strconv.Atoi(strings.TrimPrefix(answer, "child="))
	if err != nil {
		t.Fatalf("/spawn-child answered %q", answer)
	}
	t.Cleanup(func() { syscall.Kill(pid, syscall.SIGKILL) })
	if pgid, err := syscall.Getpgid(pid); err != nil || pgid != inst.cmd.Process.Pid {
		t.Errorf("child %d is in process group %d (%v), want the instance's group %d", pid, pgid, err, inst.cmd.Process.Pid)
	}

	c.input(t, "/big 300")
	chunks := make([]string, 300)
	for i := range chunks {
		chunks[i] = "0123456789"
	}
	c.expectTurn(t, sid+"-4", chunks...)

	// Near misses of a command are plain input.
	c.input(t, "/big -1")
	c.expectTurn(t, sid+"-5", "echo ", "#5: ", "/big ", "-1 ", "(earlier: ", "/big ", "300)")

	c.send(t, brokerframe.Frame{Signal: brokerframe.SignalShutdown})
	inst.expectExit(t, ExitOK)
}

// TestRunIsServedOnlyWithItsKnob: /run is a containment-test tool, so an
// instance started without EnvAllowRun echoes it as plain input.
func TestRunIsServedOnlyWithItsKnob(t *testing.T) {
	t.Parallel()
	for _, allow := range []bool{false, true} {
		b := newFakeBroker(t)
		var env []string
		if allow {
			env = []string{EnvAllowRun + "=1"}
		}
		inst := spawn{dir: t.TempDir(), env: env}.start(t, b)
		c := b.accept(t)
		sid := c.handshake(t)
		c.input(t, "/run echo ran; false")
		want := "echo #1: /run echo ran; false"
		if allow {
			want = "run failed: exit status 1: ran"
		}
		if got := collectAnswer(t, c, sid+"-1"); got != want {
			t.Errorf("allow=%v: /run answered %q, want %q", allow, got, want)
		}
		c.send(t, brokerframe.Frame{Signal: brokerframe.SignalShutdown})
		inst.expectExit(t, ExitOK)
	}
}

// collectAnswer reads a whole turn and returns its streamed text.
func collectAnswer(t *testing.T, c *brokerConn, turnID string) string {
	t.Helper()
	c.expectIOs(t, brokerframe.IO{Type: brokerframe.IOStatus, State: brokerframe.StateThinking, TurnID: turnID})
	var text strings.Builder
	for {
		m := c.nextIO(t)
		if m.Type == brokerframe.IOStreamEnd {
			break
		}
		if m.Type != brokerframe.IOStreamDelta || m.TurnID != turnID {
			t.Fatalf("got %+v inside turn %s", m, turnID)
		}
		text.WriteString(m.Content)
	}
	c.expectIOs(t, brokerframe.IO{Type: brokerframe.IOStatus, State: brokerframe.StateIdle, TurnID: turnID})
	return text.String()
}

func TestReconnectDeliversBufferedFrames(t *testing.T) {
	t.Parallel()
	b := newFakeBroker(t)
	// Deltas 300 ms apart, and a broker that turns away the first two redials
	// (250 ms + 500 ms of backoff): part of the turn is produced while no
	// socket exists and must arrive, in order, after the next handshake.
	inst := spawn{env: []string{EnvSlowTurn + "=300ms"}}.start(t, b)
	c1 := b.accept(t)
	sid := c1.handshake(t)
	turn := sid + "-1"
	c1.input(t, "a b c d")
	c1.expectIOs(t,
		brokerframe.IO{Type: brokerframe.IOStatus, State: brokerframe.StateThinking, TurnID: turn},
		brokerframe.IO{Type: brokerframe.IOStreamDelta, TurnID: turn, Content: "echo "})
	b.refuse.Store(2)
	c1.ws.NetConn().Close()
	deltas := []string{"echo "}
	// Frames that reached the broker before the drop were delivered; only
	// what follows them may come over the new connection.
	for data := range c1.msgs {
		deltas = append(deltas, deltaContent(t, data, turn))
	}

	c2 := b.accept(t)
	if got := c2.handshake(t); got != sid {
		t.Fatalf("re-registered with session %q, want %q", got, sid)
	}
	onNewConn := 0
	for {
		m := c2.nextIO(t)
		if m.Type == brokerframe.IOStreamEnd {
			break
		}
		if m.Type != brokerframe.IOStreamDelta || m.TurnID != turn {
			t.Fatalf("got %+v, want the rest of turn %s", m, turn)
		}
		deltas = append(deltas, m.Content)
		onNewConn++
	}
	if want := []string{"echo ", "#1: ", "a ", "b ", "c ", "d"}; fmt.Sprintf("%q", deltas) != fmt.Sprintf("%q", want) || onNewConn == 0 {
		t.Errorf("deltas %q (%d on the new connection), want %q with some on the new connection", deltas, onNewConn, want)
	}
	c2.expectIOs(t, brokerframe.IO{Type: brokerframe.IOStatus, State: brokerframe.StateIdle, TurnID: turn})
	c2.send(t, brokerframe.Frame{Signal: brokerframe.SignalShutdown})
	inst.expectExit(t, ExitOK)
	if n := strings.Count(inst.logs.String(), "broker connection lost"); n != 3 {
		t.Errorf("logged %d lost connections, want 3 (the drop and two refused dials)", n)
	}
}

func deltaContent(t *testing.T, data []byte, turnID string) string {
	t.Helper()
	f, err := brokerframe.Decode(data)
	var m brokerframe.IO
	if err == nil {
		err = json.Unmarshal(f.Payload, &m)
	}
	if err != nil || m.Type != brokerframe.IOStreamDelta || m.TurnID != turnID {
		t.Fatalf("frame %s (%v), want a delta of turn %s", data, err, turnID)
	}
	return m.Content
}

func TestLivenessRedialsASilentBroker(t *testing.T) {
	t.Parallel()
	b := newFakeBroker(t)
	b.mute.Store(true)
	inst := spawn{env: []string{EnvPingInterval + "=50ms", EnvPeerTimeout + "=300ms"}}.start(t, b)
	c1 := b.accept(t)
	sid := c1.handshake(t)
	select {
	case <-c1.pings:
	case <-time.After(waitTimeout):
		t.Fatal("nexus-echo never pinged the broker")
	}
	if err := c1.ended(t); websocket.IsCloseError(err, websocket.CloseNormalClosure) {
		t.Errorf("a dead peer got a normal close: %v", err)
	}
	c2 := b.accept(t)
	if got := c2.handshake(t); got != sid {
		t.Fatalf("re-registered with session %q, want %q", got, sid)
	}
	c2.send(t, brokerframe.Frame{Signal: brokerframe.SignalShutdown})
	inst.expectExit(t, ExitOK)
}

func TestSignalsStopCleanly(t *testing.T) {
	t.Parallel()
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGINT} {
		t.Run(sig.String(), func(t *testing.T) {
			t.Parallel()
			b := newFakeBroker(t)
			inst := spawn{}.start(t, b)
			c := b.accept(t)
			sid := c.handshake(t)
			c.input(t, "before")
			c.expectTurn(t, sid+"-1", "echo ", "#1: ", "before")
			inst.cmd.Process.Signal(sig)
			if err := c.ended(t); !websocket.IsCloseError(err, websocket.CloseNormalClosure) {
				t.Errorf("connection ended with %v, want a normal close", err)
			}
			inst.expectExit(t, ExitOK)
			if n := len(inst.transcript(t, sid)); n != 1 {
				t.Errorf("transcript has %d turns, want 1", n)
			}
		})
	}
}

func TestIgnoreShutdownKnob(t *testing.T) {
	t.Parallel()
	b := newFakeBroker(t)
	inst := spawn{env: []string{EnvIgnoreShutdown + "=1"}}.start(t, b)
	c := b.accept(t)
	sid := c.handshake(t)

	// Frames are handled in order, so a turn answered after the shutdown
	// frame proves the frame was ignored.
	c.send(t, brokerframe.Frame{Signal: brokerframe.SignalShutdown})
	c.input(t, "still here")
	c.expectTurn(t, sid+"-1", "echo ", "#1: ", "still ", "here")

	inst.cmd.Process.Signal(syscall.SIGTERM)
	inst.logs.waitFor(t, "ignoring SIGTERM")
	c.input(t, "and now")
	c.expectTurn(t, sid+"-2", "echo ", "#2: ", "and ", "now ", "(earlier: ", "still ", "here)")

	inst.cmd.Process.Signal(syscall.SIGKILL)
	inst.expectExit(t, -1)
}

func TestExitBeforeReadyKnob(t *testing.T) {
	t.Parallel()
	b := newFakeBroker(t)
	inst := spawn{env: []string{EnvExitBeforeReady + "=1"}}.start(t, b)
	c := b.accept(t)
	if reg := c.expectSignal(t, brokerframe.SignalRegister); reg.Secret != testSecret {
		t.Errorf("register secret %q, want the spawn secret", reg.Secret)
	}
	c.ended(t)
	inst.expectExit(t, ExitBeforeReady)
}

func TestCrashKnobs(t *testing.T) {
	t.Parallel()
	t.Run(CrashMidTurn, func(t *testing.T) {
		t.Parallel()
		b := newFakeBroker(t)
		inst := spawn{env: []string{EnvCrash + "=" + CrashMidTurn}}.start(t, b)
		c := b.accept(t)
		sid := c.handshake(t)
		c.input(t, "boom now")
		c.expectIOs(t,
			brokerframe.IO{Type: brokerframe.IOStatus, State: brokerframe.StateThinking, TurnID: sid + "-1"},
			brokerframe.IO{Type: brokerframe.IOStreamDelta, TurnID: sid + "-1", Content: "echo "})
		if err := c.ended(t); !websocket.IsCloseError(err, websocket.CloseAbnormalClosure) {
			t.Errorf("connection ended with %v, want an abnormal closure", err)
		}
		inst.expectExit(t, ExitCrashMidTurn)
		if n := len(inst.transcript(t, sid)); n != 0 {
			t.Errorf("transcript has %d turns, want 0", n)
		}
	})
	t.Run(CrashAfterAnswer, func(t *testing.T) {
		t.Parallel()
		b := newFakeBroker(t)
		inst := spawn{env: []string{EnvCrash + "=" + CrashAfterAnswer}}.start(t, b)
		c := b.accept(t)
		sid := c.handshake(t)
		c.input(t, "done")
		c.expectTurn(t, sid+"-1", "echo ", "#1: ", "done")
		if err := c.ended(t); !websocket.IsCloseError(err, websocket.CloseAbnormalClosure) {
			t.Errorf("connection ended with %v, want an abnormal closure", err)
		}
		inst.expectExit(t, ExitCrashAfterAnswer)
		if n := len(inst.transcript(t, sid)); n != 1 {
			t.Errorf("transcript has %d turns, want 1", n)
		}
	})
}

func TestRegisterKnobs(t *testing.T) {
	t.Parallel()
	tests := []struct {
		env  string
		want string // the register frame's version and secret
	}{
		{EnvNoSecret + "=1", `1 "" false`},
		{EnvWrongSecret + "=1", `1 "` + strings.Repeat("x", len(testSecret)) + `" true`},
		{EnvFrameVersion + "=2", `2 "` + testSecret + `" true`},
		{EnvFrameVersion + "=0", `0 "` + testSecret + `" true`},
	}
	for _, tt := range tests {
		t.Run(tt.env, func(t *testing.T) {
			t.Parallel()
			b := newFakeBroker(t)
			inst := spawn{env: []string{tt.env}}.start(t, b)
			c := b.accept(t)
			raw := c.nextRaw(t)
			var reg struct {
				Version *int
				Secret  *string
				Signal  brokerframe.Signal
			}
			if err := json.Unmarshal(raw, &reg); err != nil || reg.Version == nil || reg.Signal != brokerframe.SignalRegister {
				t.Fatalf("first frame %s (%v), want a register frame with a version", raw, err)
			}
			secret := ""
			if reg.Secret != nil {
				secret = *reg.Secret
			}
			if got := fmt.Sprintf("%d %q %t", *reg.Version, secret, reg.Secret != nil); got != tt.want {
				t.Errorf("register frame %s: got %s, want %s", raw, got, tt.want)
			}
			c.expectSignal(t, brokerframe.SignalReady)
			c.expectSignal(t, brokerframe.SignalSessionIDReport)
			c.send(t, brokerframe.Frame{Signal: brokerframe.SignalShutdown})
			inst.expectExit(t, ExitOK)
		})
	}
}

func TestBootDelayKnob(t *testing.T) {
	t.Parallel()
	const delay = 300 * time.Millisecond
	b := newFakeBroker(t)
	start := time.Now()
	inst := spawn{env: []string{EnvBootDelay + "=" + delay.String()}}.start(t, b)
	c := b.accept(t)
	if waited := time.Since(start); waited < delay {
		t.Errorf("dialed after %v, want at least %v", waited, delay)
	}
	c.handshake(t)
	c.send(t, brokerframe.Frame{Signal: brokerframe.SignalShutdown})
	inst.expectExit(t, ExitOK)
}

func TestNoSessionReportKnob(t *testing.T) {
	t.Parallel()
	b := newFakeBroker(t)
	inst := spawn{env: []string{EnvNoSessionReport + "=1"}}.start(t, b)
	c := b.accept(t)
	c.expectSignal(t, brokerframe.SignalRegister)
	c.expectSignal(t, brokerframe.SignalReady)
	c.input(t, "x")
	if m := c.nextIO(t); m.Type != brokerframe.IOStatus || m.State != brokerframe.StateThinking {
		t.Errorf("got %+v after ready, want the turn's thinking status", m)
	}
	c.send(t, brokerframe.Frame{Signal: brokerframe.SignalShutdown})
	inst.expectExit(t, ExitOK)
}

// TestSessionReportDelayKnob: the first connection's handshake carries no
// session-id report; it comes on its own, no sooner than the delay after
// the instance started; a redial reports it in the handshake again.
func TestSessionReportDelayKnob(t *testing.T) {
	t.Parallel()
	const delay = time.Second
	b := newFakeBroker(t)
	start := time.Now()
	inst := spawn{env: []string{EnvSessionReportDelay + "=" + delay.String()}}.start(t, b)
	c := b.accept(t)
	c.expectSignal(t, brokerframe.SignalRegister)
	c.expectSignal(t, brokerframe.SignalReady)
	late := c.expectSignal(t, brokerframe.SignalSessionIDReport)
	if d := time.Since(start); d < delay {
		t.Errorf("the session id was reported %v after the start, before the %v delay", d, delay)
	}
	c.ws.NetConn().Close()
	c2 := b.accept(t)
	if again := c2.handshake(t); again != late.SessionID {
		t.Errorf("the redial reported %q, the late report %q", again, late.SessionID)
	}
	c2.send(t, brokerframe.Frame{Signal: brokerframe.SignalShutdown})
	inst.expectExit(t, ExitOK)
}

func TestCommandLine(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		args   []string // full argv after the binary; "CONFIG" is a readable file
		env    []string
		noEnv  bool
		code   int
		stderr string
	}{
		{name: "no config", args: nil, code: ExitUsage, stderr: "-config is required"},
		{name: "unknown flag", args: []string{"-config", "CONFIG", "-profile", "vision"}, code: ExitUsage, stderr: "flag provided but not defined: -profile"},
		{name: "unreadable config", args: []string{"-config", "/nonexistent/config.yaml"}, code: ExitUsage, stderr: "/nonexistent/config.yaml"},
		{name: "bad knob", args: []string{"-config", "CONFIG"}, env: []string{EnvCrash + "=sometimes"}, code: ExitUsage, stderr: EnvCrash},
		{name: "bad duration", args: []string{"-config", "CONFIG"}, env: []string{EnvSlowTurn + "=soon"}, code: ExitUsage, stderr: EnvSlowTurn},
		{name: "no broker env", args: []string{"-config", "CONFIG"}, noEnv: true, code: ExitFailure, stderr: dialenv.BrokerAddr},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			b := newFakeBroker(t)
			cfg := filepath.Join(t.TempDir(), "config.yaml")
			if err := os.WriteFile(cfg, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			args := append([]string(nil), tt.args...)
			for i, a := range args {
				if a == "CONFIG" {
					args[i] = cfg
				}
			}
			inst := spawn{env: tt.env, noEnv: tt.noEnv}.run(t, b, exec.Command(echoBinary(t), args...))
			inst.expectExit(t, tt.code)
			if !strings.Contains(inst.logs.String(), tt.stderr) {
				t.Errorf("stderr lacks %q:\n%s", tt.stderr, inst.logs)
			}
			if n := b.accepted.Load(); n != 0 {
				t.Errorf("dialed the broker %d times", n)
			}
		})
	}
}

func TestReplayFlagAndExtraArgsAccepted(t *testing.T) {
	t.Parallel()
	b := newFakeBroker(t)
	inst := spawn{args: []string{"-replay", "extra"}}.start(t, b)
	c := b.accept(t)
	c.handshake(t)
	c.send(t, brokerframe.Frame{Signal: brokerframe.SignalShutdown})
	inst.expectExit(t, ExitOK)
}

func TestBigAnswerArrivesWhole(t *testing.T) {
	t.Parallel()
	const n = 30000 // about 3 MiB of frames, three times the outbox limit
	b := newFakeBroker(t)
	inst := spawn{}.start(t, b)
	c := b.accept(t)
	sid := c.handshake(t)
	c.input(t, "/big "+strconv.Itoa(n))
	chunks := make([]string, n)
	for i := range chunks {
		chunks[i] = "0123456789"
	}
	c.expectTurn(t, sid+"-1", chunks...)
	c.send(t, brokerframe.Frame{Signal: brokerframe.SignalShutdown})
	inst.expectExit(t, ExitOK)
	if strings.Contains(inst.logs.String(), "oldest frames dropped") {
		t.Error("the outbox dropped frames of a turn on a live connection")
	}
}

// TestEchoesWaitForABrokerSlowToRead: a broker that stops reading while it
// sends 20 MB of echo payloads (its read queue fills, then its socket) gets
// every echo back, in order, once it reads again: the instance waits for
// room instead of evicting, and its read loop still takes the shutdown
// that follows.
func TestEchoesWaitForABrokerSlowToRead(t *testing.T) {
	t.Parallel()
	const n = 20000
	b := newFakeBroker(t)
	inst := spawn{}.start(t, b)
	c := b.accept(t)
	c.handshake(t)
	pad := strings.Repeat("x", 1000)
	sent := make(chan error, 1)
	go func() {
		for i := range n {
			p := fmt.Sprintf(`{"type":"echo","n":%d,"pad":%q}`, i, pad)
			f, err := brokerframe.Encode(brokerframe.Frame{LeaseID: testLease, Signal: brokerframe.SignalIO, Payload: json.RawMessage(p)})
			if err == nil {
				err = c.ws.WriteMessage(websocket.TextMessage, f)
			}
			if err != nil {
				sent <- err
				return
			}
		}
		sent <- nil
	}()
	time.Sleep(2 * time.Second) // the fault itself: the broker reads nothing for 2 s
	for i := range n {
		var p struct{ N int }
		f := c.expectSignal(t, brokerframe.SignalIO)
		if err := json.Unmarshal(f.Payload, &p); err != nil || p.N != i {
			t.Fatalf("echo %d: got %s (%v): echoes were lost", i, f.Payload[:min(len(f.Payload), 40)], err)
		}
	}
	if err := <-sent; err != nil {
		t.Fatal(err)
	}
	c.send(t, brokerframe.Frame{Signal: brokerframe.SignalShutdown})
	inst.expectExit(t, ExitOK)
	if log := inst.logs.String(); strings.Contains(log, "dropped") {
		t.Errorf("nexus-echo logged a drop while connected:\n%s", log)
	}
}

// TestFramesTheInstanceCannotUseLogOnce: a broker that floods the instance
// with frames it cannot use (undecodable, of a signal an instance never
// gets, an input payload that is not one, cancels and hitl.responses that
// name nothing) makes it write each line once in the window (logbound),
// not once per frame, and the instance still answers the input after them.
func TestFramesTheInstanceCannotUseLogOnce(t *testing.T) {
	t.Parallel()
	const n = 500
	b := newFakeBroker(t)
	inst := spawn{}.start(t, b)
	c := b.accept(t)
	sid := c.handshake(t)
	lines := map[string]func(){
		"dropping an undecodable frame from the broker": func() {
			if err := c.ws.WriteMessage(websocket.TextMessage, []byte(`{"signal":`)); err != nil {
				t.Fatal(err)
			}
		},
		"ignoring a frame an instance does not expect": func() { c.send(t, brokerframe.Frame{Signal: brokerframe.SignalReady}) },
		"dropping a malformed io payload":              func() { c.sendIO(t, `{"type":"input","content":7}`) },
		"cancel names no running turn":                 func() { c.sendIO(t, `{"type":"cancel","turn_id":"none"}`) },
		"hitl.response names no open question":         func() { c.sendIO(t, `{"type":"hitl.response","request_id":"none"}`) },
	}
	for range n {
		for _, send := range lines {
			send()
		}
	}
	// Frames are handled in order: once this input is answered, every
	// frame before it was.
	c.input(t, "after")
	c.expectTurn(t, sid+"-1", "echo ", "#1: ", "after")
	log := inst.logs.String()
	for msg := range lines {
		if got := strings.Count(log, `msg="`+msg+`"`); got != 1 {
			t.Errorf("%d frames wrote %q %d times, want once in the window", n, msg, got)
		}
	}
}
