package spawnd

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/nexus-broker/nexus-broker/internal/config/core"
	"github.com/nexus-broker/nexus-broker/internal/sockdir"
	"github.com/nexus-broker/nexus-broker/internal/spawnclient"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// waitLimit bounds every wait for an event. It is a failure deadline, never
// a synchronisation delay: nothing in these tests sleeps to let time pass.
const waitLimit = 20 * time.Second

// fakeName is the name this test binary answers to when spawnd execs it as
// an instance; TestMain then runs fakeMain instead of the tests.
const fakeName = "fake-instance"

// fakeBin is a copy of this test binary named fakeName, in a directory any
// user may read, so that a run_as instance can exec it too.
var fakeBin string

func TestMain(m *testing.M) {
	if filepath.Base(os.Args[0]) == fakeName {
		// syscall.Exit, not os.Exit: under -race, os.Exit first sleeps a
		// second for race reports, which would delay every exit spawnd sees.
		syscall.Exit(fakeMain(os.Args[1:]))
	}
	dir, err := setUpFakeBin()
	if err != nil {
		fmt.Fprintln(os.Stderr, "setting up the fake instance:", err)
		os.Exit(1)
	}
	// The host-wide uid range lock of tenancy's tests is this run's own,
	// removed with it (the host's /run is left alone).
	os.Setenv(LockDirEnv, dir)
	code := m.Run()
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

func setUpFakeBin() (string, error) {
	self, err := os.Executable()
	if err != nil {
		return "", err
	}
	dir, err := os.MkdirTemp("", "spawnd-fake-")
	if err != nil {
		return "", err
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		return dir, err
	}
	src, err := os.Open(self)
	if err != nil {
		return dir, err
	}
	defer src.Close()
	fakeBin = filepath.Join(dir, fakeName)
	dst, err := os.OpenFile(fakeBin, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o755)
	if err != nil {
		return dir, err
	}
	if _, err := io.Copy(dst, src); err != nil {
		dst.Close()
		return dir, err
	}
	return dir, dst.Close()
}

// fakeReport is what a fake instance tells the test about itself.
type fakeReport struct {
	Args       []string
	Env        []string
	PID, PGID  int
	UID, GID   int
	Groups     []int
	Cwd        string
	Config     string
	ConfigMode fs.FileMode
	Grandchild int
}

// fakeMain is the fake instance. It reports itself over the unix socket
// named by -report, then, by -mode:
//
//	block        wait for "exit N" from the test (or its hang-up); SIGTERM kills it
//	ignore-term  the same, ignoring SIGTERM
//	notify-term  the same, but on SIGTERM it answers "sigterm" and exits 0
//	exit         exit -code at once
//	grandchild   (internal) ignore SIGTERM and SIGHUP and never exit
//
// In every waiting mode, "write N" makes it write N bytes to stdout (its
// log) and answer "wrote".
//
// -grandchild first starts a grandchild in its process group, which only a
// SIGKILL to the group can end.
func fakeMain(args []string) int {
	flags := flag.NewFlagSet(fakeName, flag.ContinueOnError)
	configPath := flags.String("config", "", "")
	flags.String("recall", "", "")
	report := flags.String("report", "", "")
	mode := flags.String("mode", "block", "")
	code := flags.Int("code", 0, "")
	grandchild := flags.Bool("grandchild", false, "")
	if err := flags.Parse(args); err != nil {
		return 2
	}
	terms := make(chan os.Signal, 1)
	switch *mode {
	case "grandchild":
		signal.Ignore(syscall.SIGTERM, syscall.SIGHUP)
		for {
			time.Sleep(time.Hour) // blocks forever; the runtime would call select{} a deadlock
		}
	case "ignore-term":
		signal.Ignore(syscall.SIGTERM)
	case "notify-term":
		signal.Notify(terms, syscall.SIGTERM)
	}

	r := fakeReport{Args: os.Args, Env: os.Environ(), PID: os.Getpid(), UID: os.Getuid(), GID: os.Getgid()}
	r.PGID, _ = syscall.Getpgid(0)
	r.Groups, _ = os.Getgroups()
	r.Cwd, _ = os.Getwd()
	if info, err := os.Stat(*configPath); err == nil {
		r.ConfigMode = info.Mode().Perm()
	}
	data, _ := os.ReadFile(*configPath)
	r.Config = string(data)
	if *grandchild {
		cmd := exec.Command("/proc/self/exe", "-mode", "grandchild")
		cmd.Args[0] = fakeName
		if err := cmd.Start(); err != nil {
			fmt.Fprintln(os.Stderr, "starting grandchild:", err)
			return 3
		}
		r.Grandchild = cmd.Process.Pid
	}
	fmt.Println("fake instance started") // lands in the lease's log file

	conn, err := net.Dial("unix", *report)
	if err != nil {
		fmt.Fprintln(os.Stderr, "dialing the test:", err)
		return 4
	}
	if err := json.NewEncoder(conn).Encode(r); err != nil {
		return 5
	}
	if *mode == "exit" {
		return *code
	}
	lines := make(chan string)
	go func() {
		sc := bufio.NewScanner(conn)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	for {
		select {
		case <-terms:
			fmt.Fprintln(conn, "sigterm")
			return 0
		case line, ok := <-lines:
			if !ok {
				return 0 // the test hung up
			}
			if n, ok := strings.CutPrefix(line, "exit "); ok {
				c, _ := strconv.Atoi(n)
				return c
			}
			if n, ok := strings.CutPrefix(line, "write "); ok {
				total, _ := strconv.Atoi(n)
				chunk := bytes.Repeat([]byte("x"), 64<<10)
				for left := total; left > 0; left -= len(chunk) {
					_, _ = os.Stdout.Write(chunk[:min(left, len(chunk))])
				}
				fmt.Fprintln(conn, "wrote")
			}
		}
	}
}

// fakeConn is the test's end of one fake instance's report socket.
type fakeConn struct {
	t      *testing.T
	conn   net.Conn
	r      *bufio.Reader
	report fakeReport
}

func (f *fakeConn) send(line string) {
	f.t.Helper()
	if _, err := fmt.Fprintln(f.conn, line); err != nil {
		f.t.Fatalf("telling the fake instance %q: %v", line, err)
	}
}

// readLine waits for the fake instance's next line. It does not fail the
// test, so it may be called from any goroutine.
func (f *fakeConn) readLine() (string, error) {
	_ = f.conn.SetReadDeadline(time.Now().Add(waitLimit))
	line, err := f.r.ReadString('\n')
	return strings.TrimSpace(line), err
}

// expectLine waits for the fake instance to say want.
func (f *fakeConn) expectLine(want string) {
	f.t.Helper()
	if got, err := f.readLine(); got != want {
		f.t.Fatalf("fake instance said %q (%v), want %q", got, err, want)
	}
}

func (f *fakeConn) env() map[string]string {
	m := map[string]string{}
	for _, kv := range f.report.Env {
		k, v, _ := strings.Cut(kv, "=")
		m[k] = v
	}
	return m
}

// logBuffer captures spawnd's JSON log and wakes waiters on every record.
type logBuffer struct {
	mu      sync.Mutex
	raw     bytes.Buffer
	records []map[string]any
	changed chan struct{} // closed and replaced on every write
}

func newLogBuffer() *logBuffer { return &logBuffer{changed: make(chan struct{})} }

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.raw.Write(p)
	var rec map[string]any
	if err := json.Unmarshal(p, &rec); err != nil {
		return 0, err
	}
	b.records = append(b.records, rec)
	close(b.changed)
	b.changed = make(chan struct{})
	return len(p), nil
}

// find returns the records with message msg whose attributes match the
// key, value pairs in attrs (compared as printed).
func (b *logBuffer) find(msg string, attrs ...any) []map[string]any {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []map[string]any
next:
	for _, rec := range b.records {
		if rec["msg"] != msg {
			continue
		}
		for i := 0; i+1 < len(attrs); i += 2 {
			if fmt.Sprint(rec[attrs[i].(string)]) != fmt.Sprint(attrs[i+1]) {
				continue next
			}
		}
		out = append(out, rec)
	}
	return out
}

// await waits for a record find would return.
func (b *logBuffer) await(t *testing.T, msg string, attrs ...any) map[string]any {
	t.Helper()
	deadline := time.After(waitLimit)
	for {
		b.mu.Lock()
		changed := b.changed
		b.mu.Unlock()
		if recs := b.find(msg, attrs...); len(recs) > 0 {
			return recs[0]
		}
		select {
		case <-changed:
		case <-deadline:
			t.Fatalf("no log record %q %v within %s; log:\n%s", msg, attrs, waitLimit, b.text())
		}
	}
}

func (b *logBuffer) text() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.raw.String()
}

// harness is a Daemon served over a real gRPC unix socket, with a listener
// its fake instances report to. stop and start replace the Daemon with a
// new one on the same config and state_dir, as a nexus-spawnd restart does.
type harness struct {
	t        *testing.T
	d        *Daemon // nil while stopped
	client   *spawnclient.RPC
	logs     *logBuffer
	cfgPath  string
	stateDir string
	report   *net.UnixListener
	// reportPath is where fake instances dial; tests write it into entry
	// args as REPORT.
	reportPath string
	dir        string // world-writable, for sockets
	boots      int
	conn       *grpc.ClientConn
	stopServer func()
}

// defaultYAML registers the fake instance under one entry per behaviour.
const defaultYAML = `
state_dir: STATE
release_grace: 10s
binaries:
  nexus:
    path: FAKE
    args: [-report, REPORT]
  ignore:
    path: FAKE
    args: [-report, REPORT, -mode, ignore-term, -grandchild]
  notify:
    path: FAKE
    args: [-report, REPORT, -mode, notify-term]
  family:
    path: FAKE
    args: [-report, REPORT, -grandchild]
  exit3:
    path: FAKE
    args: [-report, REPORT, -mode, exit, -code, "3"]
`

// worldDir is a fresh directory every user may write, for sockets a run_as
// instance must reach. Short, so socket paths stay under 108 bytes.
func worldDir(t *testing.T) string {
	t.Helper()
	dir := sockdir.New(t, "sdw")
	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	return dir
}

// expand fills the placeholders of a test config.
func (h *harness) expand(yaml string) string {
	return strings.NewReplacer("FAKE", fakeBin, "REPORT", h.reportPath, "STATE", h.stateDir).Replace(yaml)
}

// writeConfig writes (or rewrites) the harness's broker.yaml.
// writeConfig replaces the config file and returns the new content's
// digest.
func (h *harness) writeConfig(yaml string) string {
	h.t.Helper()
	data := []byte(h.expand(yaml))
	if err := os.WriteFile(h.cfgPath, data, 0o600); err != nil {
		h.t.Fatal(err)
	}
	sum := sha256.Sum256(data)
	return hex.EncodeToString(sum[:])
}

// newHarness boots a Daemon from yaml (placeholders FAKE, REPORT, STATE).
func newHarness(t *testing.T, yaml string) *harness {
	t.Helper()
	return newHarnessAt(t, yaml, filepath.Join(t.TempDir(), "state"))
}

// newHarnessAt is newHarness with STATE at stateDir.
func newHarnessAt(t *testing.T, yaml, stateDir string) *harness {
	t.Helper()
	dir := worldDir(t)
	h := &harness{
		t:          t,
		logs:       newLogBuffer(),
		cfgPath:    filepath.Join(t.TempDir(), "broker.yaml"),
		stateDir:   stateDir,
		reportPath: filepath.Join(dir, "r.sock"),
		dir:        dir,
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: h.reportPath, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	if err := os.Chmod(h.reportPath, 0o777); err != nil {
		t.Fatal(err)
	}
	h.report = ln

	h.writeConfig(yaml)
	h.start()
	t.Cleanup(func() {
		if h.d == nil {
			return
		}
		// Close never signals an instance, so tear down whatever a test left.
		ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
		defer cancel()
		if list, err := h.d.List(ctx, &spawnpb.ListRequest{}); err == nil {
			for _, l := range list.Leases {
				_, _ = h.d.Terminate(ctx, &spawnpb.TerminateRequest{LeaseId: l.LeaseId, SkipGrace: true})
			}
		}
		h.stop()
	})
	return h
}

// start boots a Daemon on the harness's config and serves it on a fresh
// socket.
func (h *harness) start() {
	h.t.Helper()
	cfg, err := core.Load(h.cfgPath)
	if err != nil {
		h.t.Fatal(err)
	}
	h.d, err = New(h.cfgPath, cfg, slog.New(slog.NewJSONHandler(h.logs, nil)))
	if err != nil {
		h.t.Fatal(err)
	}
	h.boots++
	sockPath := filepath.Join(h.dir, fmt.Sprintf("s%d.sock", h.boots))
	rpcLn, err := net.Listen("unix", sockPath)
	if err != nil {
		h.t.Fatal(err)
	}
	// As nexus-spawnd serves it: gRPC and the lanes behind the peer check,
	// each Spawn lane's thread with no_new_privs.
	h.stopServer = spawnrpc.ServeListener(rpcLn, h.d, os.Getuid(), SetNoNewPrivs, slog.New(slog.NewJSONHandler(h.logs, nil)))
	dial := func(ctx context.Context) (net.Conn, error) { return spawnrpc.DialVerdict(ctx, sockPath) }
	h.conn, err = grpc.NewClient("passthrough:///spawnd", grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return dial(ctx) }))
	if err != nil {
		h.t.Fatal(err)
	}
	h.client = spawnclient.NewRPC(h.conn, dial)
}

// stop closes the Daemon and its server, leaving every instance running, as
// nexus-spawnd's own shutdown does.
func (h *harness) stop() {
	h.t.Helper()
	h.client.Close()
	h.conn.Close()
	h.stopServer()
	if err := h.d.Close(); err != nil {
		h.t.Error(err)
	}
	h.d = nil
}

// testBrokerAddr is the NEXUS_BROKER_ADDR spawnd builds from the default
// listen_addr, ":8080".
const testBrokerAddr = "ws://127.0.0.1:8080/instance"

func (h *harness) ctx() context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	h.t.Cleanup(cancel)
	return ctx
}

// spawn spawns lease id from entry and waits for its fake instance's report.
func (h *harness) spawn(id, entry string) (*spawnpb.SpawnResponse, *fakeConn) {
	h.t.Helper()
	resp, err := h.client.Spawn(h.ctx(), &spawnpb.SpawnRequest{
		LeaseId:   id,
		Entry:     entry,
		Config:    []byte("core: {}\n"),
		Principal: "alice",
	})
	if err != nil {
		h.t.Fatalf("Spawn(%s, %s): %v", id, entry, err)
	}
	f := h.accept()
	if got := f.env()["NEXUS_BROKER_LEASE_ID"]; got != id {
		h.t.Fatalf("the instance that reported is lease %q, want %q", got, id)
	}
	if int64(f.report.PID) != resp.Pid {
		h.t.Fatalf("Spawn returned pid %d, the instance is pid %d", resp.Pid, f.report.PID)
	}
	return resp, f
}

// accept waits for the next fake instance to report.
func (h *harness) accept() *fakeConn {
	h.t.Helper()
	_ = h.report.SetDeadline(time.Now().Add(waitLimit))
	conn, err := h.report.Accept()
	if err != nil {
		h.t.Fatalf("no fake instance reported within %s: %v", waitLimit, err)
	}
	h.t.Cleanup(func() { conn.Close() })
	f := &fakeConn{t: h.t, conn: conn, r: bufio.NewReader(conn)}
	_ = conn.SetReadDeadline(time.Now().Add(waitLimit))
	line, err := f.r.ReadBytes('\n')
	if err != nil {
		h.t.Fatalf("reading the fake instance's report: %v", err)
	}
	if err := json.Unmarshal(line, &f.report); err != nil {
		h.t.Fatalf("decoding the fake instance's report: %v", err)
	}
	return f
}

// watch opens a Watch stream and waits until spawnd has subscribed it.
func (h *harness) watch() grpc.ServerStreamingClient[spawnpb.ExitEvent] {
	h.t.Helper()
	stream, err := h.client.Watch(h.ctx(), &spawnpb.WatchRequest{})
	if err != nil {
		h.t.Fatal(err)
	}
	if _, err := stream.Header(); err != nil {
		h.t.Fatalf("Watch never subscribed: %v", err)
	}
	return stream
}

// nextExit reads one exit from a Watch stream.
func (h *harness) nextExit(stream grpc.ServerStreamingClient[spawnpb.ExitEvent]) *spawnpb.ExitEvent {
	h.t.Helper()
	ev, err := stream.Recv()
	if err != nil {
		h.t.Fatalf("Watch: %v", err)
	}
	return ev
}

// awaitGone waits until the process pid has exited. It must be called while
// pid is still alive or a zombie, so pid cannot belong to anyone else.
func awaitGone(t *testing.T, pidfd int) {
	t.Helper()
	fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
	deadline := time.Now().Add(waitLimit)
	for {
		n, err := unix.Poll(fds, int(time.Until(deadline).Milliseconds()))
		switch {
		case err == unix.EINTR:
		case err != nil:
			t.Fatal(err)
		case n == 0:
			t.Fatalf("process still alive after %s", waitLimit)
		default:
			return
		}
	}
}

// pidfdOf opens a pidfd for a process this test did not start.
func pidfdOf(t *testing.T, pid int) int {
	t.Helper()
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		t.Fatalf("pidfd_open(%d): %v", pid, err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}

// stepOf is the step a Spawn error's SpawnFailure detail names.
func stepOf(err error) spawnpb.SpawnStep {
	for _, d := range status.Convert(err).Details() {
		if f, ok := d.(*spawnpb.SpawnFailure); ok {
			return f.GetStep()
		}
	}
	return spawnpb.SpawnStep_SPAWN_STEP_UNSPECIFIED
}
