package spawnclient

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/go-plugin"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/encoding"
	protocodec "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

const waitLong = 15 * time.Second

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// rawConn dials ep with our client credentials but without Dial's probe, as
// a client that skipped it would.
func rawConn(t *testing.T, ep spawnrpc.Endpoint) *grpc.ClientConn {
	t.Helper()
	cc, err := grpc.NewClient("passthrough:///spawnd",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", ep.Addr)
		}),
		grpc.WithTransportCredentials(&clientCreds{pid: ep.Pid, uid: os.Getuid()}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return cc
}

// TestRPCsCarryNoBandwidthProbe: with the options both ends use, an RPC
// is its request and its answer. gRPC's dynamic flow-control window would
// add a PING after each DATA frame either side receives (and its ACK):
// two more wake-ups of each process per RPC, for messages far smaller
// than any window.
func TestRPCsCarryNoBandwidthProbe(t *testing.T) {
	runDir := shortTempDir(t)
	startFakeServer(t, runDir)
	ep, err := spawnrpc.ReadEndpoint(runDir)
	if err != nil {
		t.Fatal(err)
	}
	var pc *pingCounter
	cc, err := grpc.NewClient("passthrough:///spawnd", append(dialOptions(ep.Pid, os.Getuid()),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) {
			var d net.Dialer
			c, err := d.DialContext(ctx, "unix", ep.Addr)
			if err != nil {
				return nil, err
			}
			pc = &pingCounter{UnixConn: c.(*net.UnixConn), in: frameScan{line: true}, out: frameScan{skip: len(http2Preface)}}
			return pc, nil
		}))...)
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	client := spawnpb.NewSpawnerClient(cc)
	for range 5 {
		if _, err := client.Status(ctxT(t, waitLong), &spawnpb.StatusRequest{}); err != nil {
			t.Fatal(err)
		}
	}
	pc.mu.Lock()
	defer pc.mu.Unlock()
	if pc.in.pings != 0 || pc.out.pings != 0 {
		t.Fatalf("5 Status RPCs carried %d PING frames from spawnd and %d to it; want none", pc.in.pings, pc.out.pings)
	}
	if pc.in.frames == 0 || pc.out.frames == 0 {
		t.Fatalf("no HTTP/2 frame seen (%d in, %d out): the count proves nothing", pc.in.frames, pc.out.frames)
	}
}

// http2Preface is what an HTTP/2 client writes before its first frame.
const http2Preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

// pingCounter counts the HTTP/2 frames, and the PINGs among them that are
// not ACKs, a connection to spawnd carries each way.
type pingCounter struct {
	*net.UnixConn
	mu      sync.Mutex
	in, out frameScan
}

func (c *pingCounter) Read(p []byte) (int, error) {
	n, err := c.UnixConn.Read(p)
	c.mu.Lock()
	c.in.scan(p[:n])
	c.mu.Unlock()
	return n, err
}

func (c *pingCounter) Write(p []byte) (int, error) {
	n, err := c.UnixConn.Write(p)
	c.mu.Lock()
	c.out.scan(p[:n])
	c.mu.Unlock()
	return n, err
}

// frameScan follows HTTP/2 frame headers through a byte stream.
type frameScan struct {
	line          bool // a text line comes first: spawnd's verdict
	skip          int  // bytes to pass over: a payload, or the client preface
	hdr           []byte
	frames, pings int
}

func (f *frameScan) scan(p []byte) {
	for len(p) > 0 {
		switch {
		case f.skip > 0:
			n := min(f.skip, len(p))
			f.skip -= n
			p = p[n:]
		case f.line:
			i := strings.IndexByte(string(p), '\n')
			if i < 0 {
				return
			}
			p = p[i+1:]
			f.line = false
		default:
			n := min(9-len(f.hdr), len(p))
			f.hdr = append(f.hdr, p[:n]...)
			p = p[n:]
			if len(f.hdr) == 9 {
				f.frames++
				// type 0x6 is PING, flag 0x1 its ACK
				if f.hdr[3] == 0x6 && f.hdr[4]&0x1 == 0 {
					f.pings++
				}
				f.skip = int(f.hdr[0])<<16 | int(f.hdr[1])<<8 | int(f.hdr[2])
				f.hdr = f.hdr[:0]
			}
		}
	}
}

func TestServeAndDial(t *testing.T) {
	runDir := shortTempDir(t)
	srv := startFakeServer(t, runDir)

	ep, err := spawnrpc.ReadEndpoint(runDir)
	if err != nil {
		t.Fatal(err)
	}
	want := spawnrpc.Endpoint{Protocol: "grpc", ProtocolVersion: spawnrpc.ProtocolVersion, Network: "unix", Addr: ep.Addr, Pid: srv.cmd.Process.Pid}
	if ep != want || filepath.Dir(ep.Addr) != runDir {
		t.Fatalf("spawnd.json = %+v, want %+v with the socket in %s", ep, want, runDir)
	}
	for path, mode := range map[string]os.FileMode{runDir: 0o750, filepath.Join(runDir, spawnrpc.EndpointFile): 0o640} {
		st, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode().Perm() != mode {
			t.Errorf("%s mode %v, want %v", path, st.Mode().Perm(), mode)
		}
	}

	_, log := newLogSink(t)
	c, err := Dial(ctxT(t, waitLong), DialOptions{RunDir: runDir, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	st, err := c.Spawner().Status(ctxT(t, waitLong), &spawnpb.StatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if int(st.Pid) != ep.Pid {
		t.Fatalf("Status answered by pid %d, want %d", st.Pid, ep.Pid)
	}
	// Spawn and Record ride their lanes, connections of their own behind
	// the same check.
	sp, err := c.Spawner().Spawn(ctxT(t, waitLong), &spawnpb.SpawnRequest{LeaseId: "lease-1"})
	if err != nil || int(sp.Pid) != ep.Pid {
		t.Fatalf("Spawn on its lane: %v, %v; want pid %d", sp, err, ep.Pid)
	}
	if _, err := c.Spawner().Record(ctxT(t, waitLong), &spawnpb.RecordRequest{LeaseId: "lease-1"}); err != nil {
		t.Fatalf("Record on its lane: %v", err)
	}
	// spawnd saw our uid through SO_PEERCRED, on gRPC and on each lane.
	l := readFile(t, srv.logPath)
	for _, verb := range []string{"Status", "Spawn", "Record"} {
		if want := fmt.Sprintf("msg=\"fake %s\" peer_uid=%d", verb, os.Getuid()); !strings.Contains(l, want) {
			t.Errorf("server log lacks %s:\n%s", want, l)
		}
	}

	// go-plugin's controller would let a gateway stop spawnd; spawnd does
	// not serve it.
	cc := rawConn(t, ep)
	err = cc.Invoke(ctxT(t, waitLong), "/plugin.GRPCController/Shutdown", &emptypb.Empty{}, &emptypb.Empty{})
	if status.Code(err) != codes.Unimplemented {
		t.Fatalf("Shutdown: %v, want Unimplemented", err)
	}
	if _, err := c.Spawner().Status(ctxT(t, waitLong), &spawnpb.StatusRequest{}); err != nil {
		t.Fatalf("Status after the refused Shutdown: %v", err)
	}

	// SIGTERM: spawnd withdraws spawnd.json and its socket.
	c.Close()
	if err := srv.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-srv.exited:
		srv.exited <- err
		if err != nil {
			t.Fatalf("fake spawnd exited with %v", err)
		}
	case <-time.After(waitLong):
		t.Fatal("fake spawnd did not stop on SIGTERM")
	}
	for _, p := range []string{filepath.Join(runDir, spawnrpc.EndpointFile), ep.Addr} {
		if _, err := os.Lstat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s left behind after SIGTERM (%v)", p, err)
		}
	}
	if l := readFile(t, srv.logPath); strings.Contains(l, "level=ERROR") || !strings.Contains(l, "spawnrpc stopped") {
		t.Errorf("a clean stop should log no ERROR and say it stopped:\n%s", l)
	}
}

func TestRefusesOtherUID(t *testing.T) {
	runDir := shortTempDir(t)
	other := os.Getuid() + 1
	srv := startFakeServer(t, runDir, allowedUIDEnv+"="+strconv.Itoa(other))
	wantMsg := fmt.Sprintf("uid %d is not allowed: spawnd accepts only uid %d", os.Getuid(), other)

	_, log := newLogSink(t)
	_, err := Dial(ctxT(t, waitLong), DialOptions{RunDir: runDir, Logger: log})
	if !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), wantMsg) {
		t.Fatalf("Dial: %v; want ErrRefused saying %q", err, wantMsg)
	}

	// A client that skips Dial's probe sees the same reason on its call.
	_, err = spawnpb.NewSpawnerClient(rawConn(t, srv.ep)).Status(ctxT(t, waitLong), &spawnpb.StatusRequest{})
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), wantMsg) {
		t.Fatalf("Status: %v; want Unavailable saying %q", err, wantMsg)
	}

	// Written before the verdict, so it is there by now.
	wantLog := fmt.Sprintf("level=WARN msg=\"refused spawnrpc connection\" peer_uid=%d peer_pid=%d allowed_uid=%d", os.Getuid(), os.Getpid(), other)
	l := readFile(t, srv.logPath)
	if !strings.Contains(l, wantLog) {
		t.Fatalf("server log lacks %q:\n%s", wantLog, l)
	}
	// Serve's own readiness probe is refused too, but not logged as an
	// intruder: every refusal logged is one of ours.
	for _, line := range strings.Split(l, "\n") {
		if strings.Contains(line, "refused spawnrpc connection") && !strings.Contains(line, fmt.Sprintf("peer_pid=%d ", os.Getpid())) {
			t.Errorf("refusal of a peer other than the test logged: %s", line)
		}
	}
}

func TestReattachAfterKill(t *testing.T) {
	runDir := shortTempDir(t)
	a := startFakeServer(t, runDir)
	sink, log := newLogSink(t)
	c, err := Dial(ctxT(t, waitLong), DialOptions{RunDir: runDir, ConfigPath: "test.yaml", Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	watch, err := c.Spawner().Watch(ctxT(t, waitLong), &spawnpb.WatchRequest{})
	if err != nil {
		t.Fatal(err)
	}
	watchErr := make(chan error, 1)
	go func() {
		_, err := watch.Recv()
		watchErr <- err
	}()

	a.kill9(t)
	sink.waitFor(t, "lost connection to nexus-spawnd", waitLong)
	select {
	case err := <-watchErr:
		if status.Code(err) != codes.Unavailable {
			t.Fatalf("Watch after kill -9: %v, want Unavailable", err)
		}
	case <-time.After(waitLong):
		t.Fatal("Watch stream outlived its spawnd")
	}
	// While no spawnd runs, a call waits within its ctx and says why.
	short, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	_, err = c.Spawner().Status(short, &spawnpb.StatusRequest{})
	cancel()
	if status.Code(err) != codes.DeadlineExceeded || !strings.Contains(err.Error(), "waiting for nexus-spawnd") {
		t.Fatalf("Status while spawnd is down: %v", err)
	}
	// A call made now completes against the next spawnd.
	type res struct {
		st  *spawnpb.StatusResponse
		err error
	}
	pending := make(chan res, 1)
	go func() {
		st, err := c.Spawner().Status(ctxT(t, waitLong), &spawnpb.StatusRequest{})
		pending <- res{st, err}
	}()

	b := startFakeServer(t, runDir)
	if b.ep.Addr == a.ep.Addr {
		t.Fatalf("restarted spawnd reused socket %s", a.ep.Addr)
	}
	if _, err := os.Lstat(a.ep.Addr); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the killed spawnd's socket %s was not cleaned up (%v)", a.ep.Addr, err)
	}
	select {
	case <-c.Reconnected():
	case <-time.After(waitLong):
		t.Fatal("no Reconnected after spawnd restarted")
	}
	if got := c.Endpoint(); got != b.ep {
		t.Fatalf("attached to %+v, want %+v", got, b.ep)
	}
	r := <-pending
	if r.err != nil || int(r.st.Pid) != b.ep.Pid {
		t.Fatalf("call made during the outage: %v, %v; want pid %d", r.st, r.err, b.ep.Pid)
	}
	st, err := c.Spawner().Status(ctxT(t, waitLong), &spawnpb.StatusRequest{})
	if err != nil || int(st.Pid) != b.ep.Pid {
		t.Fatalf("Status after reattach: %v, %v", st, err)
	}
	if _, err := c.Spawner().Watch(ctxT(t, waitLong), &spawnpb.WatchRequest{}); err != nil {
		t.Fatalf("Watch after reattach: %v", err)
	}
	if n := sink.count("lost connection to nexus-spawnd"); n != 1 {
		t.Errorf("loss logged %d times, want once:\n%s", n, sink)
	}
	if n := sink.count("reattached to nexus-spawnd"); n != 1 {
		t.Errorf("reattach logged %d times, want once", n)
	}
}

func TestSecondSpawndRefused(t *testing.T) {
	runDir := shortTempDir(t)
	a := startFakeServer(t, runDir)
	cmd := exec.Command(testExe(t), "-run-dir", runDir)
	cmd.Env = append(os.Environ(), roleEnv+"="+roleServer)
	out, err := cmd.CombinedOutput()
	want := fmt.Sprintf("another nexus-spawnd (pid %d) is already serving run directory %s", a.ep.Pid, runDir)
	if err == nil || !strings.Contains(string(out), want) {
		t.Fatalf("second spawnd: %v, output %q; want it refused with %q", err, out, want)
	}
	if ep, err := spawnrpc.ReadEndpoint(runDir); err != nil || ep != a.ep {
		t.Fatalf("spawnd.json after the refused second spawnd: %+v, %v", ep, err)
	}
}

func TestDialWithoutSpawnd(t *testing.T) {
	runDir := shortTempDir(t)
	const hint = "start `nexus-spawnd -config /etc/nexus/broker.yaml` first"
	_, err := Dial(ctxT(t, waitLong), DialOptions{RunDir: runDir, ConfigPath: "/etc/nexus/broker.yaml"})
	if err == nil || !strings.Contains(err.Error(), hint) {
		t.Fatalf("Dial with no spawnd.json: %v; want it to say %q", err, hint)
	}

	// A spawnd.json left by a spawnd that is gone.
	srv := startFakeServer(t, runDir)
	srv.kill9(t)
	_, err = Dial(ctxT(t, waitLong), DialOptions{RunDir: runDir, ConfigPath: "/etc/nexus/broker.yaml"})
	if err == nil || !strings.Contains(err.Error(), hint) || !strings.Contains(err.Error(), strconv.Itoa(srv.ep.Pid)) {
		t.Fatalf("Dial with a stale spawnd.json: %v; want it to name pid %d and say %q", err, srv.ep.Pid, hint)
	}
}

func TestLaunch(t *testing.T) {
	t.Setenv(roleEnv, roleServer) // inherited by the launched spawnd
	runDir := shortTempDir(t)
	opts := func(log *slog.Logger) DialOptions {
		return DialOptions{RunDir: runDir, ConfigPath: "test.yaml", Launch: true, SpawndPath: testExe(t), Logger: log}
	}
	sink, log1 := newLogSink(t)
	c1, err := Dial(ctxT(t, waitLong), opts(log1))
	if err != nil {
		t.Fatal(err)
	}
	defer c1.Close()
	pid := c1.Endpoint().Pid
	t.Cleanup(func() { stopSpawnd(t, pid) })
	if n := sink.count("launched nexus-spawnd"); n != 1 {
		t.Fatalf("first Dial launched %d spawnds", n)
	}
	checkDetached(t, pid, runDir)

	// A second gateway attaches to the same spawnd.
	_, log2 := newLogSink(t)
	c2, err := Dial(ctxT(t, waitLong), opts(log2))
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	if got := c2.Endpoint().Pid; got != pid {
		t.Fatalf("second Dial attached to pid %d, want %d", got, pid)
	}
	if n := strings.Count(readFile(t, filepath.Join(runDir, LogFile)), "launching"); n != 1 {
		t.Fatalf("spawnd.log records %d launches, want 1", n)
	}

	// Supervision: spawnd dies for good, the gateway starts another.
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	select {
	case <-c1.Reconnected():
	case <-time.After(waitLong):
		t.Fatalf("no relaunch after spawnd died:\n%s", sink)
	}
	select {
	case <-c2.Reconnected():
	case <-time.After(waitLong):
		t.Fatal("second client did not reattach")
	}
	pid2 := c1.Endpoint().Pid
	t.Cleanup(func() { stopSpawnd(t, pid2) })
	if pid2 == pid || c2.Endpoint().Pid != pid2 {
		t.Fatalf("after relaunch: clients on pids %d and %d, old pid %d", pid2, c2.Endpoint().Pid, pid)
	}
	if n := strings.Count(readFile(t, filepath.Join(runDir, LogFile)), "launching"); n != 2 {
		t.Fatalf("spawnd.log records %d launches, want 2 (the two gateways raced to relaunch)", n)
	}
	if st, err := c2.Spawner().Status(ctxT(t, waitLong), &spawnpb.StatusRequest{}); err != nil || int(st.Pid) != pid2 {
		t.Fatalf("Status after relaunch: %v, %v", st, err)
	}
}

func TestLaunchRace(t *testing.T) {
	t.Setenv(roleEnv, roleServer)
	runDir := shortTempDir(t)
	const n = 4
	var wg sync.WaitGroup
	pids := make([]int, n)
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, log := newLogSink(t)
			c, err := Dial(ctxT(t, waitLong), DialOptions{RunDir: runDir, ConfigPath: "test.yaml", Launch: true, SpawndPath: testExe(t), Logger: log})
			errs[i] = err
			if err == nil {
				pids[i] = c.Endpoint().Pid
				c.Close()
			}
		}()
	}
	wg.Wait()
	for i := range n {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
	}
	t.Cleanup(func() { stopSpawnd(t, pids[0]) })
	for i := range n {
		if pids[i] != pids[0] {
			t.Fatalf("gateways attached to pids %v, want one spawnd", pids)
		}
	}
	if c := strings.Count(readFile(t, filepath.Join(runDir, LogFile)), "launching"); c != 1 {
		t.Fatalf("%d racing gateways launched %d spawnds", n, c)
	}
}

func TestLaunchBootRefusal(t *testing.T) {
	t.Setenv(roleEnv, roleServer)
	t.Setenv(bootErrEnv, "broker config: binaries.vision.path: /nope does not exist")
	runDir := shortTempDir(t)
	sink, log := newLogSink(t)
	_, err := Dial(ctxT(t, waitLong), DialOptions{RunDir: runDir, ConfigPath: "test.yaml", Launch: true, SpawndPath: testExe(t), Logger: log})
	if err == nil || !strings.Contains(err.Error(), "exited during startup") || !strings.Contains(err.Error(), "it also wrote: goroutine 1 [running]:") {
		t.Fatalf("Dial: %v; want the exit, quoting the line of spawnd.log that is not a record", err)
	}
	// spawnd's own record of why, relayed as itself before Dial returned.
	want := "ERROR failed to load config path=test.yaml error=broker config: binaries.vision.path: /nope does not exist spawnd_pid="
	if !strings.Contains(sink.String(), want) {
		t.Fatalf("the gateway's log does not relay spawnd's refusal %q:\n%s", want, sink.String())
	}
}

// TestLaunchedSurvivesLauncher kills the gateway that launched spawnd: the
// spawnd keeps serving and keeps writing its log, having no pipe for stdio.
func TestLaunchedSurvivesLauncher(t *testing.T) {
	runDir := shortTempDir(t)
	launcher := exec.Command(testExe(t), runDir)
	launcher.Env = append(os.Environ(), roleEnv+"="+roleLauncher)
	stdout, err := launcher.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	launcherLog := filepath.Join(t.TempDir(), "launcher.log")
	lf, err := os.Create(launcherLog)
	if err != nil {
		t.Fatal(err)
	}
	defer lf.Close()
	launcher.Stderr = lf
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("launcher log:\n%s", readFile(t, launcherLog))
		}
	})
	if err := launcher.Start(); err != nil {
		t.Fatal(err)
	}
	line := readLine(t, stdout, waitLong)
	pid, err := strconv.Atoi(line)
	if err != nil {
		launcher.Process.Kill()
		t.Fatalf("launcher said %q", line)
	}
	t.Cleanup(func() { stopSpawnd(t, pid) })
	checkDetached(t, pid, runDir)

	if err := launcher.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = launcher.Wait() // also closes our end of its stdout pipe
	if !alive(pid) {
		t.Fatal("spawnd died with its launcher")
	}
	_, log := newLogSink(t)
	c, err := Dial(ctxT(t, waitLong), DialOptions{RunDir: runDir, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	st, err := c.Spawner().Status(ctxT(t, waitLong), &spawnpb.StatusRequest{})
	if err != nil || int(st.Pid) != pid {
		t.Fatalf("Status after the launcher died: %v, %v", st, err)
	}
	// fakeSpawner logged the Status to its stderr before answering: the
	// write went to spawnd.log and did not kill it.
	if l := readFile(t, filepath.Join(runDir, LogFile)); !strings.Contains(l, "fake Status") {
		t.Fatalf("spawnd.log lacks the Status served after the launcher died:\n%s", l)
	}
	if !alive(pid) {
		t.Fatal("spawnd died writing its log after the launcher died")
	}
}

// checkDetached checks a launched spawnd: its own session, stdin
// /dev/null, stdout and stderr the log file.
func checkDetached(t *testing.T, pid int, runDir string) {
	t.Helper()
	stat := statFields(readFile(t, fmt.Sprintf("/proc/%d/stat", pid)))
	if len(stat) < 4 || stat[3] != strconv.Itoa(pid) {
		t.Errorf("spawnd pid %d is not a session leader (stat %v)", pid, stat)
	}
	want := []string{os.DevNull, filepath.Join(runDir, LogFile), filepath.Join(runDir, LogFile)}
	for fd, w := range want {
		got, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%d", pid, fd))
		if err != nil {
			t.Fatal(err)
		}
		if got != w {
			t.Errorf("spawnd fd %d is %s, want %s", fd, got, w)
		}
	}
}

// stopSpawnd stops a spawnd the test launched (not necessarily our child).
func stopSpawnd(t *testing.T, pid int) {
	if pid <= 0 || !alive(pid) {
		return
	}
	_ = syscall.Kill(pid, syscall.SIGTERM)
	waitExit(t, pid, waitLong)
}

// protoCodecUses counts the messages gRPC's protobuf codec, which marshals
// by reflection, handled in this process: the test binary registers a
// counting wrapper in its place.
var protoCodecUses atomic.Int64

type countingCodec struct{ encoding.CodecV2 }

func (c countingCodec) Marshal(v any) (mem.BufferSlice, error) {
	protoCodecUses.Add(1)
	return c.CodecV2.Marshal(v)
}

func (c countingCodec) Unmarshal(data mem.BufferSlice, v any) error {
	protoCodecUses.Add(1)
	return c.CodecV2.Unmarshal(data, v)
}

func init() { encoding.RegisterCodecV2(countingCodec{encoding.GetCodecV2(protocodec.Name)}) }

// TestRPCsLeaveProtobufReflectionAlone: with the gateway's dial options, a
// verb and the health probe marshal without protobuf's reflective code,
// whose pages would otherwise stay resident (docs/performance.md).
func TestRPCsLeaveProtobufReflectionAlone(t *testing.T) {
	runDir := shortTempDir(t)
	srv := startFakeServer(t, runDir)
	cc, err := grpc.NewClient("passthrough:///spawnd", append(dialOptions(srv.ep.Pid, os.Getuid()),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", srv.ep.Addr)
		}))...)
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	call := func(opts ...grpc.CallOption) {
		t.Helper()
		if _, err := spawnpb.NewSpawnerClient(cc).Status(ctxT(t, waitLong), &spawnpb.StatusRequest{}, opts...); err != nil {
			t.Fatal(err)
		}
		req := &grpc_health_v1.HealthCheckRequest{Service: plugin.GRPCServiceName}
		if _, err := grpc_health_v1.NewHealthClient(cc).Check(ctxT(t, waitLong), req, opts...); err != nil {
			t.Fatal(err)
		}
	}
	before := protoCodecUses.Load()
	call()
	if n := protoCodecUses.Load() - before; n != 0 {
		t.Fatalf("a Status RPC and a health check went through protobuf's codec %d times; want none", n)
	}
	// The same calls with protobuf's codec forced: the count sees them.
	call(grpc.ForceCodecV2(encoding.GetCodecV2(protocodec.Name)))
	if n := protoCodecUses.Load() - before; n != 4 {
		t.Fatalf("with protobuf's codec forced, the count saw %d messages; want 4", n)
	}
}
