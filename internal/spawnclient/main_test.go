package spawnclient

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
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
	"google.golang.org/grpc/peer"

	"github.com/nexus-broker/nexus-broker/internal/sockdir"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// The test binary re-executes itself in one of these roles; the role
// travels in the environment so a launched spawnd inherits it.
const (
	roleEnv       = "SPAWNRPC_TEST_ROLE"
	allowedUIDEnv = "SPAWNRPC_TEST_ALLOWED_UID"
	bootErrEnv    = "SPAWNRPC_TEST_BOOT_ERROR"
	roleServer    = "server"
	roleLauncher  = "launcher"
)

func TestMain(m *testing.M) {
	switch os.Getenv(roleEnv) {
	case roleServer:
		os.Exit(fakeSpawndMain())
	case roleLauncher:
		os.Exit(launcherMain())
	}
	os.Exit(m.Run())
}

// fakeSpawndMain is nexus-spawnd with a fake Spawner: the same flags, the
// same Serve, no processes spawned.
func fakeSpawndMain() int {
	fs := flag.NewFlagSet("fake-spawnd", flag.ContinueOnError)
	fs.String("config", "", "ignored")
	fs.Duration("idle-exit", 0, "ignored: a fake spawnd is stopped by its test")
	runDir := fs.String("run-dir", "", "")
	if err := fs.Parse(os.Args[1:]); err != nil {
		return 2
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	if msg := os.Getenv(bootErrEnv); msg != "" {
		// As the real one refuses a config: one record, then a stray line.
		log.Error("failed to load config", "path", "test.yaml", "error", msg)
		fmt.Fprintln(os.Stderr, "goroutine 1 [running]:")
		return 1
	}
	allowed := os.Getuid()
	if v := os.Getenv(allowedUIDEnv); v != "" {
		allowed, _ = strconv.Atoi(v)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	lock, err := spawnrpc.ClaimRunDir(*runDir, -1)
	if err == nil {
		defer lock.Close()
		err = spawnrpc.Serve(ctx, spawnrpc.ServeOptions{RunDir: *runDir, AllowedUID: allowed, SocketGID: -1, Impl: &fakeSpawner{log: log}, Logger: log})
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "nexus-spawnd:", err)
		return 1
	}
	return 0
}

// launcherMain is a gateway that launches spawnd, reports its pid on
// stdout (a pipe to the test) and waits to be killed.
func launcherMain() int {
	runDir := os.Args[1]
	exe, _ := os.Executable()
	os.Setenv(roleEnv, roleServer) // what the launched spawnd will be
	c, err := Dial(context.Background(), DialOptions{RunDir: runDir, ConfigPath: "test.yaml", Launch: true, SpawndPath: exe,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, nil))})
	if err != nil {
		fmt.Fprintln(os.Stderr, "launcher:", err)
		return 1
	}
	fmt.Println(c.Endpoint().Pid)
	select {}
}

// fakeSpawner answers Status and Spawn with its pid and Record with
// nothing, logs each call with its peer's uid (so a test can see it write
// to its stderr, and whose credentials it got), and holds Watch streams
// open.
type fakeSpawner struct {
	spawnpb.UnimplementedSpawnerServer
	log *slog.Logger
}

func (f *fakeSpawner) logCall(ctx context.Context, verb string) {
	uid := -1
	if p, ok := peer.FromContext(ctx); ok {
		if pc, ok := p.AuthInfo.(spawnrpc.PeerCred); ok {
			uid = pc.UID
		}
	}
	f.log.Info("fake "+verb, "peer_uid", uid)
}

func (f *fakeSpawner) Status(ctx context.Context, _ *spawnpb.StatusRequest) (*spawnpb.StatusResponse, error) {
	f.logCall(ctx, "Status")
	return &spawnpb.StatusResponse{Pid: int64(os.Getpid()), BrokerId: "fake"}, nil
}

func (f *fakeSpawner) Spawn(ctx context.Context, _ *spawnpb.SpawnRequest) (*spawnpb.SpawnResponse, error) {
	f.logCall(ctx, "Spawn")
	return &spawnpb.SpawnResponse{Pid: int64(os.Getpid())}, nil
}

func (f *fakeSpawner) Record(ctx context.Context, _ *spawnpb.RecordRequest) (*spawnpb.RecordResponse, error) {
	f.logCall(ctx, "Record")
	return &spawnpb.RecordResponse{}, nil
}

func (f *fakeSpawner) Watch(_ *spawnpb.WatchRequest, s grpc.ServerStreamingServer[spawnpb.ExitEvent]) error {
	<-s.Context().Done()
	return nil
}

// shortTempDir is a run directory whose socket paths fit sun_path.
func shortTempDir(t *testing.T) string { return sockdir.New(t, "srpc") }

func testExe(t *testing.T) string {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	return exe
}

// fakeServer is a fake spawnd subprocess.
type fakeServer struct {
	cmd     *exec.Cmd
	logPath string
	exited  chan error
	ep      spawnrpc.Endpoint
}

// startFakeServer runs a fake spawnd on runDir and waits until it has
// published spawnd.json.
func startFakeServer(t *testing.T, runDir string, env ...string) *fakeServer {
	t.Helper()
	logPath := filepath.Join(t.TempDir(), "server.log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	cmd := exec.Command(testExe(t), "-config", "test.yaml", "-run-dir", runDir)
	cmd.Env = append(append(os.Environ(), roleEnv+"="+roleServer), env...)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	s := &fakeServer{cmd: cmd, logPath: logPath, exited: make(chan error, 1)}
	go func() { s.exited <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-s.exited:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
		}
		if t.Failed() {
			t.Logf("fake spawnd pid %d log:\n%s", cmd.Process.Pid, readFile(t, logPath))
		}
	})
	l := &launched{pid: cmd.Process.Pid, logPath: logPath, exited: s.exited}
	s.ep, err = l.awaitEndpoint(context.Background(), runDir)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// kill9 kills the server and waits for it to be gone.
func (s *fakeServer) kill9(t *testing.T) {
	t.Helper()
	if err := s.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-s.exited:
		s.exited <- nil // for the cleanup
	case <-time.After(10 * time.Second):
		t.Fatal("fake spawnd did not die of SIGKILL")
	}
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(data)
}

// logSink is a slog handler a test can wait on.
type logSink struct {
	mu      sync.Mutex
	lines   []string
	changed chan struct{}
}

func newLogSink(t *testing.T) (*logSink, *slog.Logger) {
	s := &logSink{changed: make(chan struct{})}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("client log:\n%s", s.String())
		}
	})
	return s, slog.New(s)
}

func (s *logSink) Enabled(context.Context, slog.Level) bool { return true }
func (s *logSink) WithAttrs([]slog.Attr) slog.Handler       { return s }
func (s *logSink) WithGroup(string) slog.Handler            { return s }

func (s *logSink) Handle(_ context.Context, r slog.Record) error {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s", r.Level, r.Message)
	r.Attrs(func(a slog.Attr) bool {
		fmt.Fprintf(&b, " %s=%v", a.Key, a.Value)
		return true
	})
	s.mu.Lock()
	s.lines = append(s.lines, b.String())
	close(s.changed)
	s.changed = make(chan struct{})
	s.mu.Unlock()
	return nil
}

func (s *logSink) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return strings.Join(s.lines, "\n")
}

// count returns how many lines contain substr.
func (s *logSink) count(substr string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, l := range s.lines {
		if strings.Contains(l, substr) {
			n++
		}
	}
	return n
}

// waitFor waits until a line containing substr has been logged.
func (s *logSink) waitFor(t *testing.T, substr string, timeout time.Duration) {
	t.Helper()
	deadline := time.After(timeout)
	for {
		s.mu.Lock()
		changed := s.changed
		s.mu.Unlock()
		if s.count(substr) > 0 {
			return
		}
		select {
		case <-changed:
		case <-deadline:
			t.Fatalf("no log line containing %q within %v", substr, timeout)
		}
	}
}

// waitExit waits for any process (child or not) to exit, via a pidfd.
func waitExit(t *testing.T, pid int, timeout time.Duration) {
	t.Helper()
	fd, err := unix.PidfdOpen(pid, 0)
	if err == unix.ESRCH {
		return
	}
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	for {
		n, err := unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}, int(timeout.Milliseconds()))
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			t.Fatalf("pid %d still running after %v", pid, timeout)
		}
		return
	}
}

// alive reports whether pid is running (not exited, not a zombie).
func alive(pid int) bool {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	f := statFields(string(data))
	return len(f) > 0 && f[0] != "Z" && f[0] != "X"
}

// statFields are /proc/<pid>/stat's fields after "(comm)": state, ppid,
// pgrp, session, …
func statFields(stat string) []string {
	i := strings.LastIndexByte(stat, ')')
	if i < 0 {
		return nil
	}
	return strings.Fields(stat[i+1:])
}

// readLine reads one line from r within timeout.
func readLine(t *testing.T, r io.Reader, timeout time.Duration) string {
	t.Helper()
	ch := make(chan string, 1)
	go func() {
		line, _ := bufio.NewReader(r).ReadString('\n')
		ch <- strings.TrimSpace(line)
	}()
	select {
	case l := <-ch:
		return l
	case <-time.After(timeout):
		t.Fatalf("no line within %v", timeout)
		return ""
	}
}
