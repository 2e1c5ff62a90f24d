package echo

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/gorilla/websocket"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
	"github.com/nexus-broker/nexus-broker/pkg/dialenv"
)

// The tests run the real nexus-echo binary against a minimal broker on
// loopback, as the end-to-end tests do with the real gateway.

const (
	testLease  = "lease-test-1"
	testSecret = "s3cret-value-never-logged"
	// waitTimeout bounds every wait on an event; generous because the binary
	// is race-instrumented under -race.
	waitTimeout = 20 * time.Second
)

var (
	binDir   string
	binOnce  sync.Once
	binPath  string
	binError error
)

func TestMain(m *testing.M) {
	var err error
	binDir, err = os.MkdirTemp("", "nexus-echo-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(binDir)
	os.Exit(code)
}

// echoBinary builds cmd/nexus-echo once per test run, race-instrumented when
// the tests are, so a data race in the binary fails the run too.
func echoBinary(t *testing.T) string {
	t.Helper()
	binOnce.Do(func() {
		binPath = filepath.Join(binDir, "nexus-echo")
		args := []string{"build", "-o", binPath}
		if raceEnabled {
			args = append(args, "-race")
		}
		args = append(args, "github.com/nexus-broker/nexus-broker/cmd/nexus-echo")
		out, err := exec.Command("go", args...).CombinedOutput()
		if err != nil {
			binError = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if binError != nil {
		t.Fatal(binError)
	}
	return binPath
}

// fakeBroker accepts dial-backs on /instance and hands each to the test.
type fakeBroker struct {
	srv      *httptest.Server
	conns    chan *brokerConn
	accepted atomic.Int32
	// mute makes new connections swallow pings instead of answering them.
	mute atomic.Bool
	// refuse is how many coming dials to turn away, as a broker that is down.
	refuse atomic.Int32
}

func newFakeBroker(t *testing.T) *fakeBroker {
	t.Helper()
	b := &fakeBroker{conns: make(chan *brokerConn, 16)}
	var up websocket.Upgrader
	var mu sync.Mutex
	var all []*brokerConn
	b.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/instance" {
			http.NotFound(w, r)
			return
		}
		if b.refuse.Add(-1) >= 0 {
			http.Error(w, "broker restarting", http.StatusServiceUnavailable)
			return
		}
		b.refuse.Store(0)
		ws, err := up.Upgrade(w, r, nil)
		if err != nil {
			return
		}
		b.accepted.Add(1)
		c := &brokerConn{ws: ws, msgs: make(chan []byte, 4096), pings: make(chan struct{}, 1)}
		if b.mute.Load() {
			ws.SetPingHandler(func(string) error {
				select {
				case c.pings <- struct{}{}:
				default:
				}
				return nil
			})
		}
		go c.readLoop()
		mu.Lock()
		all = append(all, c)
		mu.Unlock()
		b.conns <- c
	}))
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range all {
			c.ws.Close()
		}
		b.srv.Close()
	})
	return b
}

func (b *fakeBroker) addr() string {
	return "ws" + strings.TrimPrefix(b.srv.URL, "http") + "/instance"
}

func (b *fakeBroker) accept(t *testing.T) *brokerConn {
	t.Helper()
	select {
	case c := <-b.conns:
		return c
	case <-time.After(waitTimeout):
		t.Fatal("nexus-echo never dialed the broker")
		return nil
	}
}

// brokerConn is the broker's end of one dial-back socket.
type brokerConn struct {
	ws    *websocket.Conn
	msgs  chan []byte   // closed when the read fails; err is set before
	err   error         // why reading stopped
	pings chan struct{} // a ping arrived (muted connections only)
}

func (c *brokerConn) readLoop() {
	for {
		_, data, err := c.ws.ReadMessage()
		if err != nil {
			c.err = err
			close(c.msgs)
			return
		}
		c.msgs <- data
	}
}

func (c *brokerConn) nextRaw(t *testing.T) []byte {
	t.Helper()
	select {
	case data, ok := <-c.msgs:
		if !ok {
			t.Fatalf("connection ended while a frame was expected: %v", c.err)
		}
		return data
	case <-time.After(waitTimeout):
		t.Fatal("timed out waiting for a frame")
		return nil
	}
}

func (c *brokerConn) next(t *testing.T) brokerframe.Frame {
	t.Helper()
	data := c.nextRaw(t)
	f, err := brokerframe.Decode(data)
	if err != nil {
		t.Fatalf("undecodable frame %s: %v", data, err)
	}
	if f.LeaseID != testLease {
		t.Fatalf("frame %s: lease_id %q, want %q", data, f.LeaseID, testLease)
	}
	return f
}

func (c *brokerConn) expectSignal(t *testing.T, want brokerframe.Signal) brokerframe.Frame {
	t.Helper()
	f := c.next(t)
	if f.Signal != want {
		t.Fatalf("got a %s frame, want %s", f.Signal, want)
	}
	return f
}

// nextIO returns the next frame's payload; the frame must be io.
func (c *brokerConn) nextIO(t *testing.T) brokerframe.IO {
	t.Helper()
	f := c.expectSignal(t, brokerframe.SignalIO)
	var m brokerframe.IO
	if err := json.Unmarshal(f.Payload, &m); err != nil {
		t.Fatalf("io payload %s: %v", f.Payload, err)
	}
	return m
}

// handshake checks register (with the real secret), ready and
// session-id-report, and returns the reported session id.
func (c *brokerConn) handshake(t *testing.T) string {
	t.Helper()
	reg := c.expectSignal(t, brokerframe.SignalRegister)
	if reg.Version != brokerframe.Version || reg.Secret != testSecret {
		t.Fatalf("register: version %d secret %q, want %d and the spawn secret", reg.Version, reg.Secret, brokerframe.Version)
	}
	c.expectSignal(t, brokerframe.SignalReady)
	sid := c.expectSignal(t, brokerframe.SignalSessionIDReport).SessionID
	if validSessionID(sid) != nil {
		t.Fatalf("session-id-report carries an invalid id %q", sid)
	}
	return sid
}

// ended waits for the instance to end the connection and returns why.
func (c *brokerConn) ended(t *testing.T) error {
	t.Helper()
	deadline := time.After(waitTimeout)
	for {
		select {
		case data, ok := <-c.msgs:
			if !ok {
				return c.err
			}
			t.Fatalf("unexpected frame while waiting for the connection to end: %s", data)
		case <-deadline:
			t.Fatal("timed out waiting for the connection to end")
		}
	}
}

func (c *brokerConn) send(t *testing.T, f brokerframe.Frame) {
	t.Helper()
	f.LeaseID = testLease
	b, err := brokerframe.Encode(f)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.ws.WriteMessage(websocket.TextMessage, b); err != nil {
		t.Fatalf("sending %s: %v", f.Signal, err)
	}
}

func (c *brokerConn) sendIO(t *testing.T, payload string) {
	t.Helper()
	c.send(t, brokerframe.Frame{Signal: brokerframe.SignalIO, Payload: json.RawMessage(payload)})
}

func (c *brokerConn) input(t *testing.T, content string) {
	t.Helper()
	p, err := json.Marshal(brokerframe.IO{Type: brokerframe.IOInput, Content: content})
	if err != nil {
		t.Fatal(err)
	}
	c.sendIO(t, string(p))
}

// expectTurn checks a complete answered turn, frame by frame.
func (c *brokerConn) expectTurn(t *testing.T, turnID string, chunks ...string) {
	t.Helper()
	want := []brokerframe.IO{{Type: brokerframe.IOStatus, State: brokerframe.StateThinking, TurnID: turnID}}
	for _, ch := range chunks {
		want = append(want, brokerframe.IO{Type: brokerframe.IOStreamDelta, TurnID: turnID, Content: ch})
	}
	want = append(want,
		brokerframe.IO{Type: brokerframe.IOStreamEnd, TurnID: turnID, FinishReason: "stop"},
		brokerframe.IO{Type: brokerframe.IOStatus, State: brokerframe.StateIdle, TurnID: turnID})
	c.expectIOs(t, want...)
}

func (c *brokerConn) expectIOs(t *testing.T, want ...brokerframe.IO) {
	t.Helper()
	for i, w := range want {
		got := c.nextIO(t)
		if !equalIO(got, w) {
			t.Fatalf("payload %d: got %+v, want %+v", i, got, w)
		}
	}
}

func equalIO(a, b brokerframe.IO) bool {
	ja, _ := json.Marshal(a)
	jb, _ := json.Marshal(b)
	return bytes.Equal(ja, jb)
}

// instance is one running nexus-echo process.
type instance struct {
	cmd  *exec.Cmd
	home string
	logs *logBuffer
	done chan struct{}
	code int // valid once done is closed
}

type spawn struct {
	args  []string // after -config, which is always passed unless noConfig
	env   []string // added to the base environment
	home  string   // default: a fresh temp dir
	dir   string   // working directory
	noEnv bool     // omit the NEXUS_BROKER_* variables
	group bool     // own process group
}

func (s spawn) start(t *testing.T, b *fakeBroker) *instance {
	t.Helper()
	bin := echoBinary(t)
	cfg := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(cfg, []byte("ignored: true\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, append([]string{"-config", cfg}, s.args...)...)
	return s.run(t, b, cmd)
}

func (s spawn) run(t *testing.T, b *fakeBroker, cmd *exec.Cmd) *instance {
	t.Helper()
	if s.home == "" {
		s.home = t.TempDir()
	}
	cmd.Env = []string{"HOME=" + s.home, "LANG=C.UTF-8", "PATH=" + os.Getenv("PATH"), "TZ=UTC"}
	if !s.noEnv {
		cmd.Env = append(cmd.Env,
			dialenv.BrokerAddr+"="+b.addr(),
			dialenv.LeaseID+"="+testLease,
			dialenv.SpawnSecret+"="+testSecret)
	}
	cmd.Env = append(cmd.Env, s.env...)
	cmd.Dir = s.dir
	if s.group {
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	}
	inst := &instance{cmd: cmd, home: s.home, logs: newLogBuffer(), done: make(chan struct{})}
	cmd.Stderr = inst.logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		cmd.Wait()
		inst.code = cmd.ProcessState.ExitCode()
		close(inst.done)
	}()
	t.Cleanup(func() {
		select {
		case <-inst.done:
		default:
			cmd.Process.Kill()
			<-inst.done
		}
		if t.Failed() {
			t.Logf("nexus-echo stderr:\n%s", inst.logs)
		}
		if strings.Contains(inst.logs.String(), "WARNING: DATA RACE") {
			t.Errorf("nexus-echo reported a data race:\n%s", inst.logs)
		}
		if strings.Contains(inst.logs.String(), testSecret) {
			t.Errorf("nexus-echo logged the spawn secret:\n%s", inst.logs)
		}
	})
	return inst
}

// wait returns the exit code (-1 for death by signal).
func (i *instance) wait(t *testing.T) int {
	t.Helper()
	select {
	case <-i.done:
		return i.code
	case <-time.After(waitTimeout):
		t.Fatal("nexus-echo did not exit")
		return 0
	}
}

func (i *instance) expectExit(t *testing.T, want int) {
	t.Helper()
	if got := i.wait(t); got != want {
		t.Fatalf("exit code %d, want %d", got, want)
	}
}

func (i *instance) transcript(t *testing.T, sid string) []turnRecord {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(sessionsRoot(i.home), sid, transcriptName))
	if err != nil {
		t.Fatal(err)
	}
	turns, valid, err := parseTranscript(data)
	if err != nil || valid != len(data) {
		t.Fatalf("transcript %q: valid %d of %d bytes, err %v", data, valid, len(data), err)
	}
	return turns
}

// logBuffer collects stderr and lets a test wait for a line.
type logBuffer struct {
	mu      sync.Mutex
	buf     bytes.Buffer
	changed chan struct{} // closed and replaced on every write
}

func newLogBuffer() *logBuffer {
	return &logBuffer{changed: make(chan struct{})}
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.buf.Write(p)
	close(l.changed)
	l.changed = make(chan struct{})
	return len(p), nil
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

func (l *logBuffer) waitFor(t *testing.T, substr string) {
	t.Helper()
	deadline := time.After(waitTimeout)
	for {
		l.mu.Lock()
		found := strings.Contains(l.buf.String(), substr)
		changed := l.changed
		l.mu.Unlock()
		if found {
			return
		}
		select {
		case <-changed:
		case <-deadline:
			t.Fatalf("stderr never contained %q", substr)
		}
	}
}
