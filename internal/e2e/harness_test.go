// Package e2e tests nexus-broker from outside, as its users drive it: the
// real nexus-spawnd, nexus-broker and nexus-echo binaries, started as
// processes on loopback, talked to over real HTTP and WebSocket.
package e2e

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/config/core"
	"github.com/nexus-broker/nexus-broker/internal/sockdir"
	"github.com/nexus-broker/nexus-broker/internal/spawnd"
	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc"
)

// binDir holds the binaries TestMain builds once for the whole package.
var binDir string

// buildTags are the Makefile's TAGS, so that the binaries tested are the
// binaries `make build` ships (TestBuildTagsAreTheMakefiles).
const buildTags = "netgo,osusergo"

func TestMain(m *testing.M) {
	if os.Getenv(relayFloorRole) != "" {
		runRelayFloor()
		return
	}
	if path := os.Getenv(rpcFloorRole); path != "" {
		runRPCFloor(path)
		return
	}
	run, err := runTmp()
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e: the run's temp directory:", err)
		os.Exit(1)
	}
	code := buildAndRun(m, run)
	os.RemoveAll(run)
	os.Exit(code)
}

// runTmp creates the run's temp directory, which every temp path of the
// tests is under (TMPDIR for the test process and what it starts): in
// $TMPDIR when another user can reach it, else in /tmp (a root-owned 0700
// $TMPDIR, say), and mode 0755. The tests that drop to uid 65534 plant
// files and exec binaries under it.
func runTmp() (string, error) {
	root := os.TempDir()
	if !reachable(root) {
		root = "/tmp"
	}
	dir, err := os.MkdirTemp(root, "nexus-e2e-run-")
	if err != nil {
		return "", err
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		os.RemoveAll(dir)
		return "", err
	}
	return dir, os.Setenv("TMPDIR", dir)
}

// reachable reports whether any user may search every directory of path.
func reachable(path string) bool {
	for p := filepath.Clean(path); ; p = filepath.Dir(p) {
		st, err := os.Stat(p)
		if err != nil || !st.IsDir() || st.Mode().Perm()&0o001 == 0 {
			return false
		}
		if p == "/" || p == "." {
			return true
		}
	}
}

// buildAndRun builds the binaries under test in run and runs the tests.
func buildAndRun(m *testing.M, run string) int {
	dir := filepath.Join(run, "bin")
	// run_as tests exec nexus-echo as another uid, which must reach it.
	err := os.Mkdir(dir, 0o755)
	if err == nil {
		err = os.Chmod(dir, 0o755) // whatever the umask
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e: the binaries' directory:", err)
		return 1
	}
	binDir = dir
	args := []string{"build", "-tags", buildTags, "-o", dir + "/", "../../cmd/nexus-broker", "../../cmd/nexus-spawnd", "../../cmd/nexus-echo", "../../cmd/nexus-client"}
	if os.Getenv("E2E_NORACE") == "" {
		args = append([]string{"build", "-race"}, args[1:]...)
	}
	cmd := exec.Command("go", args...)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building the binaries under test:", err)
		return 1
	}
	return m.Run()
}

// bin names a built binary.
func bin(name string) string { return filepath.Join(binDir, name) }

// logBuffer collects a process's output and lets a test wait for a line.
type logBuffer struct {
	mu   sync.Mutex
	buf  bytes.Buffer
	wake chan struct{}
}

func newLogBuffer() *logBuffer { return &logBuffer{wake: make(chan struct{})} }

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf.Write(p)
	close(b.wake)
	b.wake = make(chan struct{})
	return len(p), nil
}

func (b *logBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// wait blocks until re matches the output, or the deadline passes. It
// returns the submatches.
func (b *logBuffer) wait(t testing.TB, re *regexp.Regexp, within time.Duration) []string {
	t.Helper()
	deadline := time.After(within)
	for {
		b.mu.Lock()
		m := re.FindStringSubmatch(b.buf.String())
		wake := b.wake
		b.mu.Unlock()
		if m != nil {
			return m
		}
		select {
		case <-wake:
		case <-deadline:
			t.Fatalf("no log line matching %q within %s; log so far:\n%s", re, within, b.String())
		}
	}
}

// count is how many times re matches the output.
func (b *logBuffer) count(re *regexp.Regexp) int { return len(re.FindAllStringIndex(b.String(), -1)) }

// Broker is one running nexus-spawnd + nexus-broker pair.
type Broker struct {
	t          testing.TB
	Dir        string
	ConfigPath string
	RunDir     string
	Home       string
	// Tmp is both processes' TMPDIR, where spawnd keeps claim configs.
	Tmp    string
	Base   string
	Addr   string
	Client *brokerclient.Client
	// Token is the bearer the harness's own requests carry (an operator's,
	// on a broker with an auth: block).
	Token      string
	GatewayLog *logBuffer
	SpawndLog  *logBuffer
	gateway    *proc
	spawnd     *proc
	env        []string
	spawndOpts Options
	launch     bool
}

// proc is a started process with exactly one Wait, so a test and its
// cleanup can both wait for the exit.
type proc struct {
	cmd  *exec.Cmd
	done chan struct{}
}

func startProc(t testing.TB, cmd *exec.Cmd) *proc {
	t.Helper()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &proc{cmd: cmd, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		close(p.done)
	}()
	return p
}

// signal sends sig and waits for the exit.
func (p *proc) signal(sig syscall.Signal) {
	_ = p.cmd.Process.Signal(sig)
	<-p.done
}

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Options shape a test broker.
type Options struct {
	// YAML is appended to the base broker.yaml (listen on 127.0.0.1:0, the
	// run dir, nexus-echo as nexus). It may redeclare binaries: entirely.
	YAML string
	// SpawndYAML is added inside the spawnd: block (indented two spaces).
	SpawndYAML string
	// NoNexusEntry leaves binaries: to YAML.
	NoNexusEntry bool
	// Env is added to both processes' environment.
	Env []string
	// GatewayEnv is added to nexus-broker's alone.
	GatewayEnv []string
	// Token is the harness's bearer: see Broker.Token.
	Token string
	// StateDir gives the broker a state_dir (journal, spawn-key, indexes).
	StateDir bool
	// SpawndWrapper runs nexus-spawnd under a command (setpriv, say).
	SpawndWrapper []string
	// SpawndStdin, SpawndExtraFiles and SpawndAttr start nexus-spawnd
	// with a terminal or descriptors an instance must not inherit.
	SpawndStdin      *os.File
	SpawndExtraFiles []*os.File
	SpawndAttr       *syscall.SysProcAttr
	// Launch starts only the gateway, which launches nexus-spawnd itself
	// (make run's way); the test's cleanup stops that spawnd.
	Launch bool
	// XDGRuntimeDir, when set, leaves spawnd.run_dir out of the config:
	// the run directory is then the default one for the config file, under
	// this $XDG_RUNTIME_DIR, which brokers of one test may share.
	XDGRuntimeDir string
	// Dir, when set, is the directory of broker.yaml (else a fresh one).
	Dir string
	// BinDir, when set, holds the nexus-broker and nexus-spawnd to run
	// (another build's, for a benchmark's before column); instances are
	// this build's nexus-echo either way.
	BinDir string
	// Advertise writes advertise_addr: the listen address (cluster mode
	// needs one).
	Advertise bool
}

// startBroker writes the config and starts spawnd, then the gateway.
func startBroker(t testing.TB, o Options) *Broker {
	t.Helper()
	b := newBroker(t, o)
	b.StartGateway(o.GatewayEnv...)
	return b
}

// startBrokersTogether starts one broker per Options with every gateway
// started before any is awaited, so they boot (and, in Launch mode, launch
// their spawnds) at the same time.
func startBrokersTogether(t testing.TB, opts ...Options) []*Broker {
	t.Helper()
	bs := make([]*Broker, len(opts))
	for i, o := range opts {
		bs[i] = newBroker(t, o)
	}
	for i, b := range bs {
		b.spawnGateway(opts[i].GatewayEnv...)
	}
	for _, b := range bs {
		b.awaitGateway()
	}
	return bs
}

// newBroker writes the config and, unless in Launch mode, starts spawnd.
func newBroker(t testing.TB, o Options) *Broker {
	t.Helper()
	dir := o.Dir
	if dir == "" {
		dir = t.TempDir()
	}
	// The run directory holds spawnd's socket: short whatever TMPDIR is.
	b := &Broker{t: t, Dir: dir, RunDir: filepath.Join(sockdir.New(t, "nxe"), "run"), Home: filepath.Join(dir, "home"), spawndOpts: o, launch: o.Launch, Token: o.Token}
	if err := os.MkdirAll(b.Home, 0o755); err != nil {
		t.Fatal(err)
	}
	// A fixed port, as an operator's would be: instances redial the address
	// they were spawned with, so a restarted gateway must come back on it.
	port := freePort(t)
	yaml := fmt.Sprintf("listen_addr: \"127.0.0.1:%d\"\n", port)
	if o.Advertise {
		yaml += fmt.Sprintf("advertise_addr: \"127.0.0.1:%d\"\n", port)
	}
	if o.XDGRuntimeDir == "" || o.SpawndYAML != "" {
		yaml += "spawnd:\n"
		if o.XDGRuntimeDir == "" {
			yaml += fmt.Sprintf("  run_dir: %q\n", b.RunDir)
		}
		yaml += o.SpawndYAML
	}
	if o.StateDir {
		yaml += fmt.Sprintf("state_dir: %q\n", filepath.Join(dir, "state"))
	}
	if !o.NoNexusEntry {
		yaml += fmt.Sprintf("binaries:\n  nexus:\n    path: %q\n", bin("nexus-echo"))
	}
	yaml += o.YAML
	b.ConfigPath = filepath.Join(dir, "broker.yaml")
	if err := os.WriteFile(b.ConfigPath, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	b.Tmp = privateTmp(t)
	// The uid range lock of tenancy: is this run's, removed with binDir,
	// and shared by every spawnd of the run as on a host.
	b.env = append([]string{"HOME=" + b.Home, "PATH=" + os.Getenv("PATH"), "LANG=C.UTF-8", "TZ=UTC", "TMPDIR=" + b.Tmp,
		spawnd.LockDirEnv + "=" + binDir}, o.Env...)
	if o.XDGRuntimeDir != "" {
		b.env = append(b.env, "XDG_RUNTIME_DIR="+o.XDGRuntimeDir)
		t.Setenv("XDG_RUNTIME_DIR", o.XDGRuntimeDir)
		real, err := core.Canonical(b.ConfigPath)
		if err != nil {
			t.Fatal(err)
		}
		b.RunDir = spawnrpc.RunDir("", real)
	}
	t.Cleanup(b.cleanup)
	if !o.Launch {
		b.StartSpawnd()
	}
	return b
}

// privateTmp is the TMPDIR the test's processes get: a directory of the
// test's own, on tmpfs where the host has one, as spawnd's temp configs are
// in production. It is removed after the processes are killed, so the
// directory a killed spawnd never got to remove goes with it.
func privateTmp(t testing.TB) string {
	root := "/dev/shm"
	if st, err := os.Stat(root); err != nil || !st.IsDir() {
		root = "" // the test's own TMPDIR
	}
	dir, err := os.MkdirTemp(root, "nexus-e2e-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	// A run_as instance opens its config by name in spawnd's directory here.
	if err := os.Chmod(dir, 0o711); err != nil {
		t.Fatal(err)
	}
	return dir
}

// freePort asks the kernel for a loopback port nobody is using.
func freePort(t testing.TB) int {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// StartSpawnd starts nexus-spawnd and waits for its reattach file.
func (b *Broker) StartSpawnd() {
	b.t.Helper()
	b.SpawndLog = newLogBuffer()
	reattach := filepath.Join(b.RunDir, "spawnd.json")
	old, _ := os.ReadFile(reattach)
	o := b.spawndOpts
	argv := append(append([]string{}, o.SpawndWrapper...), b.bin("nexus-spawnd"), "-config", b.ConfigPath)
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = b.env
	cmd.ExtraFiles, cmd.SysProcAttr = o.SpawndExtraFiles, o.SpawndAttr
	if o.SpawndStdin != nil { // a nil *os.File in the io.Reader would not read as nil
		cmd.Stdin = o.SpawndStdin
	}
	cmd.Stdout, cmd.Stderr = b.SpawndLog, b.SpawndLog
	b.spawnd = startProc(b.t, cmd)
	deadline := time.Now().Add(30 * time.Second)
	for {
		data, err := os.ReadFile(reattach)
		if err == nil && !bytes.Equal(data, old) && bytes.Contains(data, []byte(strconv.Itoa(cmd.Process.Pid))) {
			return
		}
		if b.spawnd.exited() || time.Now().After(deadline) {
			b.t.Fatalf("nexus-spawnd did not publish %s; its log:\n%s", reattach, b.SpawndLog)
		}
		time.Sleep(20 * time.Millisecond) // polling a file with a deadline; no event to wait on
	}
}

var listeningRE = regexp.MustCompile(`msg="nexus-broker listening" addr=(\S+)`)

// StartGateway starts nexus-broker (attaching to the running spawnd) and
// waits until it listens.
func (b *Broker) StartGateway(extraEnv ...string) {
	b.t.Helper()
	b.spawnGateway(extraEnv...)
	b.awaitGateway()
}

// spawnGateway starts nexus-broker without waiting for it.
func (b *Broker) spawnGateway(extraEnv ...string) {
	b.t.Helper()
	b.GatewayLog = newLogBuffer()
	cmd := exec.Command(b.bin("nexus-broker"), "-config", b.ConfigPath, "-launch-spawnd="+strconv.FormatBool(b.launch))
	cmd.Env = append(append([]string{}, b.env...), extraEnv...)
	cmd.Stdout, cmd.Stderr = b.GatewayLog, b.GatewayLog
	b.gateway = startProc(b.t, cmd)
}

// awaitGateway waits until the gateway spawnGateway started listens.
func (b *Broker) awaitGateway() {
	b.t.Helper()
	m := b.GatewayLog.wait(b.t, listeningRE, 30*time.Second)
	b.Addr = m[1]
	b.Base = "http://" + b.Addr
	checkResponsesOf(b.t, b.Addr)
	b.Client = &brokerclient.Client{Base: b.Base, Token: b.Token}
	if _, bench := b.t.(*testing.B); bench {
		b.Client.HTTP = unchecked // a benchmark times the broker, not the check
	}
}

// bin names the broker's own binary: Options.BinDir's, else this build's.
func (b *Broker) bin(name string) string {
	if b.spawndOpts.BinDir != "" {
		return filepath.Join(b.spawndOpts.BinDir, name)
	}
	return bin(name)
}

// KillGateway sends sig to the gateway and waits for it to exit.
func (b *Broker) KillGateway(sig syscall.Signal) { b.gateway.signal(sig) }

// KillSpawnd sends sig to spawnd and waits for it to exit.
func (b *Broker) KillSpawnd(sig syscall.Signal) { b.spawnd.signal(sig) }

// Instances lists the pids of live nexus-echo processes spawned for this
// broker (found by the dial-back address in their environment).
func (b *Broker) Instances() []int {
	return processesOf(bin("nexus-echo"), b.Home)
}

// processesOf scans /proc for processes of the executable exe whose HOME
// is home ("": any HOME).
func processesOf(exe string, home string) []int {
	return pidsWhere(func(pid int) bool {
		got, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid))
		if err != nil || got != exe {
			return false
		}
		if home == "" {
			return true
		}
		env, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid))
		return err == nil && bytes.Contains(env, []byte("HOME="+home+"\x00"))
	})
}

// killGroupsOf SIGKILLs each process of pids and the process group it is
// in (its own for a spawned instance, bwrap's for a sandboxed one).
func killGroupsOf(pids []int) {
	for _, pid := range pids {
		if data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid)); err == nil {
			f := strings.Fields(string(data[bytes.LastIndexByte(data, ')')+1:]))
			if pgid, err := strconv.Atoi(f[2]); err == nil && pgid > 1 {
				_ = syscall.Kill(-pgid, syscall.SIGKILL)
			}
		}
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
}

// pidsWhere lists the live (not zombie) processes match accepts.
func pidsWhere(match func(pid int) bool) []int {
	var pids []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || !match(pid) {
			continue
		}
		if st, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid)); err == nil && zombie(st) {
			continue
		}
		pids = append(pids, pid)
	}
	return pids
}

func zombie(stat []byte) bool {
	i := bytes.LastIndexByte(stat, ')')
	return i > 0 && i+2 < len(stat) && stat[i+2] == 'Z'
}

// cleanup stops both processes and kills any instance a failed test left.
func (b *Broker) cleanup() {
	for _, p := range []*proc{b.gateway, b.spawnd} {
		if p != nil {
			p.signal(syscall.SIGKILL)
		}
	}
	if pid := b.launchedSpawnd(); pid > 0 {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
	killGroupsOf(b.Instances())
	if b.t.Failed() {
		b.t.Logf("gateway log:\n%s\nspawnd log:\n%s", b.GatewayLog, b.SpawndLog)
		if b.launch {
			data, _ := os.ReadFile(filepath.Join(b.RunDir, "spawnd.log"))
			b.t.Logf("launched spawnd's log:\n%s", data)
		}
	}
}

// launchedSpawnd is the pid of the spawnd a launch-mode gateway started, 0
// for none.
func (b *Broker) launchedSpawnd() int {
	if !b.launch {
		return 0
	}
	ep, err := spawnrpc.ReadEndpoint(b.RunDir)
	if err != nil {
		return 0
	}
	return ep.Pid
}

// claim claims with a trivial engine config and fails the test on error.
func (b *Broker) claim(req brokerclient.ClaimRequest) *brokerclient.Claim {
	b.t.Helper()
	if req.Config == "" {
		req.Config = "engine:\n  name: example\n"
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c, err := b.Client.Claim(ctx, req)
	if err != nil {
		b.t.Fatalf("claim: %v", err)
	}
	return c
}

// dial connects to a claim's ws_url.
func (b *Broker) dial(c *brokerclient.Claim, o brokerclient.DialOptions) *brokerclient.Conn {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := brokerclient.Dial(ctx, c.WSURL, o)
	if err != nil {
		b.t.Fatalf("dial %s: %v", c.WSURL, err)
	}
	b.t.Cleanup(func() { conn.Close() })
	return conn
}

// metrics scrapes GET /metrics into name{labels} → value.
func (b *Broker) metrics() map[string]float64 {
	b.t.Helper()
	_, text := b.get("/metrics")
	out := map[string]float64{}
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, _ := strconv.ParseFloat(line[i+1:], 64)
		out[line[:i]] = v
	}
	return out
}

// get fetches a route and returns its status and body.
func (b *Broker) get(path string) (int, string) {
	return b.do(http.MethodGet, path, "")
}

// do sends one request with the harness's token and returns the status and
// body.
func (b *Broker) do(method, path, body string) (int, string) {
	b.t.Helper()
	return b.doAs(b.Token, method, path, body)
}

// doAs sends one request with token as its bearer ("" for none) and
// header's name, value pairs.
func (b *Broker) doAs(token, method, path, body string, header ...string) (int, string) {
	b.t.Helper()
	req, err := http.NewRequest(method, b.Base+path, strings.NewReader(body))
	if err != nil {
		b.t.Fatal(err)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		b.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(data)
}
