package e2e

// Benchmarks of the broker against baselines taken in the same run, so that
// every figure is a ratio or a difference on the same machine under the same
// load rather than an absolute number that only means something on the
// machine it was taken on. Each benchmark records one sample per iteration
// and reports percentiles with b.ReportMetric; the built-in ns/op is
// suppressed because one iteration pairs a broker measurement with its
// baseline and its cleanup, so its mean is nobody's figure. Each benchmark
// logs whether its issue target is met; none of them fails on timing.
//
// Run them with the binaries built without -race:
//
//	E2E_NORACE=1 go test -run '^$' -bench . -benchtime 2s ./internal/e2e/

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
	"github.com/nexus-broker/nexus-broker/pkg/dialenv"
)

// benchConfig is the engine config every benchmark claim sends; nexus-echo
// ignores its content.
const benchConfig = "engine:\n  name: example\n"

// rttDeadline bounds one round trip or handshake in a benchmark: far above
// any plausible figure, so it only turns a hang into a failure.
const rttDeadline = 30 * time.Second

// benchEcho is the payload the relay benchmarks send. nexus-echo sends any
// type it does not handle back verbatim, so n identifies the echo.
type benchEcho struct {
	Type string `json:"type"`
	N    int    `json:"n"`
}

// benchPreflight skips a benchmark whose figures would measure the race
// detector instead of the broker.
func benchPreflight(b *testing.B) {
	b.Helper()
	if os.Getenv("E2E_NORACE") == "" {
		b.Skip("the binaries under test are built with -race; rerun with E2E_NORACE=1 (make bench sets it)")
	}
	if benchRace {
		b.Skip("this test binary is built with -race, which slows the benchmark's own client side; run benchmarks without -race")
	}
	// The suppressed ns/op: see the package comment above.
	b.Cleanup(func() { b.ReportMetric(0, "ns/op") })
}

// pct is the nearest-rank percentile p (0 < p <= 100) of samples.
func pct[T cmp.Ordered](samples []T, p float64) T {
	if len(samples) == 0 {
		var zero T
		return zero
	}
	s := slices.Clone(samples)
	slices.Sort(s)
	i := int(math.Ceil(p/100*float64(len(s)))) - 1
	return s[max(0, min(i, len(s)-1))]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// verdict logs one issue target as met or not. Benchmarks report; they
// never fail on timing.
func verdict(b *testing.B, target string, met bool, format string, args ...any) {
	b.Helper()
	word := "NOT met"
	if met {
		word = "met"
	}
	b.Logf("target %s: %s (%s)", target, word, fmt.Sprintf(format, args...))
}

// --- baselines --------------------------------------------------------------

// instanceRig stands in for the gateway's /instance route: a bare gorilla
// listener that nexus-echo, exec'd directly by the benchmark, dials back to.
// It is the floor a claim cannot beat (exec, boot, dial, handshake) and the
// way to reach an instance with no broker in between.
type instanceRig struct {
	url    string // NEXUS_BROKER_ADDR
	home   string
	config string

	mu      sync.Mutex
	waiting map[string]chan rigArrival // by lease id
	live    map[*rigInstance]bool      // killed at cleanup if a benchmark fails
}

// rigArrival is one instance's completed handshake.
type rigArrival struct {
	ws *websocket.Conn
	// at is when the session-id-report was read: the point a claim also
	// waits for before it answers.
	at time.Time
	// registered is when the register frame was read.
	registered time.Time
	err        error
}

// rigInstance is one nexus-echo the rig exec'd.
type rigInstance struct {
	rig     *instanceRig
	leaseID string
	cmd     *exec.Cmd
	started time.Time
	execd   time.Time // when cmd.Start returned
	// registered is when its register frame was read (set by await).
	registered time.Time
	arrived    chan rigArrival
	exited     chan struct{}
	ws         *websocket.Conn // set by await
}

func newInstanceRig(b *testing.B) *instanceRig {
	b.Helper()
	dir := b.TempDir()
	r := &instanceRig{
		home:    filepath.Join(dir, "home"),
		config:  filepath.Join(dir, "engine.yaml"),
		waiting: map[string]chan rigArrival{},
		live:    map[*rigInstance]bool{},
	}
	if err := os.MkdirAll(r.home, 0o755); err != nil {
		b.Fatal(err)
	}
	if err := os.WriteFile(r.config, []byte(benchConfig), 0o600); err != nil {
		b.Fatal(err)
	}
	srv := httptest.NewServer(http.HandlerFunc(r.serve))
	r.url = "ws" + strings.TrimPrefix(srv.URL, "http") + "/instance"
	b.Cleanup(func() {
		r.mu.Lock()
		for inst := range r.live {
			_ = syscall.Kill(-inst.cmd.Process.Pid, syscall.SIGKILL)
		}
		r.mu.Unlock()
		srv.CloseClientConnections()
		srv.Close()
	})
	return r
}

// serve reads the dial-back handshake as the gateway does (register, ready,
// session-id-report) and hands the socket to whoever spawned that lease.
func (r *instanceRig) serve(w http.ResponseWriter, req *http.Request) {
	ws, err := (&websocket.Upgrader{}).Upgrade(w, req, nil)
	if err != nil {
		return
	}
	_ = ws.SetReadDeadline(time.Now().Add(rttDeadline))
	var leaseID string
	var arr rigArrival
	for _, want := range []brokerframe.Signal{brokerframe.SignalRegister, brokerframe.SignalReady, brokerframe.SignalSessionIDReport} {
		_, data, err := ws.ReadMessage()
		if err != nil {
			arr.err = fmt.Errorf("reading the %s frame: %w", want, err)
			break
		}
		f, err := brokerframe.Decode(data)
		if err == nil && f.Signal != want {
			err = fmt.Errorf("got %s, want %s", f.Signal, want)
		}
		if err != nil {
			arr.err = err
			break
		}
		leaseID = f.LeaseID
		if want == brokerframe.SignalRegister {
			arr.registered = time.Now()
		}
	}
	arr.at = time.Now()
	_ = ws.SetReadDeadline(time.Time{})
	r.mu.Lock()
	ch := r.waiting[leaseID]
	delete(r.waiting, leaseID)
	r.mu.Unlock()
	if ch == nil {
		ws.Close()
		return
	}
	arr.ws = ws
	ch <- arr
}

// spawn execs nexus-echo as spawnd would (its own process group, HOME as the
// working directory, the three dial-back variables) and starts its clock.
func (r *instanceRig) spawn(b *testing.B, leaseID string) *rigInstance {
	b.Helper()
	inst := &rigInstance{rig: r, leaseID: leaseID, arrived: make(chan rigArrival, 1), exited: make(chan struct{})}
	r.mu.Lock()
	r.waiting[leaseID] = inst.arrived
	r.mu.Unlock()
	cmd := exec.Command(bin("nexus-echo"), "-config", r.config)
	cmd.Env = []string{
		"HOME=" + r.home, "PATH=" + os.Getenv("PATH"),
		dialenv.BrokerAddr + "=" + r.url,
		dialenv.LeaseID + "=" + leaseID,
		dialenv.SpawnSecret + "=floor-secret",
	}
	cmd.Dir = r.home
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	inst.cmd = cmd
	inst.started = time.Now()
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	inst.execd = time.Now()
	r.mu.Lock()
	r.live[inst] = true
	r.mu.Unlock()
	go func() {
		_ = cmd.Wait()
		close(inst.exited)
	}()
	return inst
}

// await waits for the instance's handshake and returns when it completed.
func (inst *rigInstance) await(b *testing.B) time.Time {
	b.Helper()
	t := time.NewTimer(rttDeadline)
	defer t.Stop()
	select {
	case arr := <-inst.arrived:
		if arr.err != nil {
			b.Fatalf("nexus-echo %s dial-back: %v", inst.leaseID, arr.err)
		}
		inst.ws = arr.ws
		inst.registered = arr.registered
		return arr.at
	case <-inst.exited:
		b.Fatalf("nexus-echo %s exited before its handshake: %v", inst.leaseID, inst.cmd.ProcessState)
	case <-t.C:
		b.Fatalf("nexus-echo %s did not dial back within %s", inst.leaseID, rttDeadline)
	}
	return time.Time{}
}

// stop ends the instance the way the gateway's release does (a shutdown
// frame, then the close handshake it starts) and waits for its exit.
func (inst *rigInstance) stop(b *testing.B) {
	b.Helper()
	data, _ := brokerframe.Encode(brokerframe.Frame{LeaseID: inst.leaseID, Signal: brokerframe.SignalShutdown})
	_ = inst.ws.SetWriteDeadline(time.Now().Add(rttDeadline))
	_ = inst.ws.WriteMessage(websocket.TextMessage, data)
	// Reading lets gorilla answer the instance's close frame; the read ends
	// with that close.
	_ = inst.ws.SetReadDeadline(time.Now().Add(rttDeadline))
	for {
		if _, _, err := inst.ws.ReadMessage(); err != nil {
			break
		}
	}
	inst.ws.Close()
	t := time.NewTimer(rttDeadline)
	defer t.Stop()
	select {
	case <-inst.exited:
	case <-t.C:
		b.Fatalf("nexus-echo %s did not exit within %s of its shutdown frame", inst.leaseID, rttDeadline)
	}
	inst.rig.mu.Lock()
	delete(inst.rig.live, inst)
	inst.rig.mu.Unlock()
}

// newDirectEcho is the relay baseline: a gorilla WebSocket server in this
// process that writes every message it reads straight back.
func newDirectEcho(b *testing.B) string {
	b.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ws, err := (&websocket.Upgrader{}).Upgrade(w, r, nil)
		if err != nil {
			return
		}
		defer ws.Close()
		for {
			kind, data, err := ws.ReadMessage()
			if err != nil {
				return
			}
			if err := ws.WriteMessage(kind, data); err != nil {
				return
			}
		}
	}))
	b.Cleanup(func() {
		srv.CloseClientConnections()
		srv.Close()
	})
	// The last path segment is what brokerclient takes for the lease id.
	return "ws" + strings.TrimPrefix(srv.URL, "http") + "/lease/direct"
}

// dialBench opens a client socket and closes it at cleanup.
func dialBench(b *testing.B, url string) *brokerclient.Conn {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), rttDeadline)
	defer cancel()
	c, err := brokerclient.Dial(ctx, url, brokerclient.DialOptions{})
	if err != nil {
		b.Fatalf("dial %s: %v", url, err)
	}
	b.Cleanup(func() { c.Close() })
	return c
}

// checkEcho verifies that payload is the echo of frame n.
func checkEcho(payload json.RawMessage, n int) error {
	var p benchEcho
	if err := json.Unmarshal(payload, &p); err != nil || p.Type != "echo" || p.N != n {
		return fmt.Errorf("got %s, want the echo of frame %d", payload, n)
	}
	return nil
}

// clientRoundTrip sends frame n as a client and waits for its echo.
func clientRoundTrip(c *brokerclient.Conn, n int) (time.Duration, error) {
	_ = c.Underlying().SetReadDeadline(time.Now().Add(rttDeadline))
	start := time.Now()
	if err := c.Send(benchEcho{Type: "echo", N: n}); err != nil {
		return 0, err
	}
	f, err := c.Next()
	d := time.Since(start)
	if err != nil {
		return 0, err
	}
	return d, checkEcho(f.Payload, n)
}

// instanceRoundTrip does what clientRoundTrip does, on the instance's own
// dial-back socket: the same encode and decode, no broker in between.
func instanceRoundTrip(inst *rigInstance, n int) (time.Duration, error) {
	_ = inst.ws.SetReadDeadline(time.Now().Add(rttDeadline))
	start := time.Now()
	p, err := json.Marshal(benchEcho{Type: "echo", N: n})
	if err != nil {
		return 0, err
	}
	data, err := brokerframe.Encode(brokerframe.Frame{LeaseID: inst.leaseID, Signal: brokerframe.SignalIO, Payload: p})
	if err != nil {
		return 0, err
	}
	if err := inst.ws.WriteMessage(websocket.TextMessage, data); err != nil {
		return 0, err
	}
	_, msg, err := inst.ws.ReadMessage()
	d := time.Since(start)
	if err != nil {
		return 0, err
	}
	f, err := brokerframe.Decode(msg)
	if err != nil {
		return 0, err
	}
	return d, checkEcho(f.Payload, n)
}

// --- 1. claim latency ---------------------------------------------------------

// BenchmarkClaim measures POST /claim → 200 against the floor: the same
// nexus-echo exec'd directly, from exec until its register, ready and
// session-id-report have reached a bare listener (a claim with no session
// id waits for the session-id-report too). Each iteration takes one floor
// sample and one claim sample per broker back to back, so all see the same
// machine; the release and the floor instance's shutdown are not in either
// sample. CPU per claim is the gateway's and spawnd's user + system time
// over the whole loop, claim and release, divided by the claims.
func BenchmarkClaim(b *testing.B) {
	benchPreflight(b)
	subjects := benchSubjects(b, Options{YAML: "idle_timeout: 0s\n"})
	rig := newInstanceRig(b)
	ctx := context.Background()
	// floorExec and spawn split each figure at the exec: how long the
	// benchmark's own fork/exec took, and how long the claim took to get
	// its instance exec'd (the gateway logs "instance spawned" once
	// spawnd's Spawn returns).
	// The trace of one claim, from the gateway's log lines: spawned (claim
	// start to spawnd's Spawn answered: HTTP, admission, the RPC, the temp
	// config, the exec) and registered (the instance dialled back and
	// the gateway checked its secret); the rest is ready, the session-id
	// report, its Record RPC and the answer. The floor's own split is
	// exec, then register.
	var floor, floorExec, floorRegister, rpcIdle []time.Duration
	rpc := startRPCFloor(b)
	claim := make([][]time.Duration, len(subjects))
	spawn := make([][]time.Duration, len(subjects))
	registered := make([][]time.Duration, len(subjects))
	tails := make([]*logTail, len(subjects))
	for i, s := range subjects {
		tails[i] = tailLog(b, s.br.GatewayLog)
	}
	sample := func(i int) {
		inst := rig.spawn(b, fmt.Sprintf("floor-%d", i))
		floorExec = append(floorExec, inst.execd.Sub(inst.started))
		floor = append(floor, inst.await(b).Sub(inst.started))
		floorRegister = append(floorRegister, inst.registered.Sub(inst.started))
		inst.stop(b)
		// The RPC floor's socket idled through the floor's claim, as
		// spawnd's does before a Spawn and through an instance's boot
		// before its Record.
		rpcIdle = append(rpcIdle, rpc.roundTrip(b))

		for k, s := range subjects {
			mark := tails[k].mark()
			start := time.Now()
			c, err := s.br.Client.Claim(ctx, brokerclient.ClaimRequest{Config: benchConfig})
			d := time.Since(start)
			if err != nil {
				b.Fatalf("%sclaim: %v", s.prefix, err)
			}
			claim[k] = append(claim[k], d)
			spawn[k] = append(spawn[k], tails[k].await(b, mark, regexp.MustCompile(`msg="instance spawned" lease_id=`+c.LeaseID)).Sub(start))
			registered[k] = append(registered[k], tails[k].await(b, mark, regexp.MustCompile(`msg="instance registered" lease_id=`+c.LeaseID)).Sub(start))
			if err := s.br.Client.Release(ctx, c.LeaseID); err != nil {
				b.Fatalf("%srelease: %v", s.prefix, err)
			}
		}
	}
	// The first claim of a gateway also dials spawnd's socket and warms
	// the page cache with a freshly built nexus-echo: a cold start, which
	// is a different figure from the claim latency in service.
	sample(-1)
	b.Logf("cold start, not in the figures: first claim %.3f ms, first floor %.3f ms", ms(claim[0][0]), ms(floor[0]))
	floor, floorExec, floorRegister, rpcIdle = floor[:0], floorExec[:0], floorRegister[:0], rpcIdle[:0]
	cpu0 := make([]cpuSample, len(subjects))
	for k, s := range subjects {
		claim[k], spawn[k], registered[k] = claim[k][:0], spawn[k][:0], registered[k][:0]
		cpu0[k] = s.br.pair().cpu(b)
	}
	for i := 0; b.Loop(); i++ {
		sample(i)
	}
	f50, f99 := pct(floor, 50), pct(floor, 99)
	b.ReportMetric(ms(f50), "floor-p50-ms")
	b.ReportMetric(ms(f99), "floor-p99-ms")
	b.ReportMetric(ms(pct(floorExec, 50)), "floor-exec-p50-ms")
	b.ReportMetric(ms(pct(floorRegister, 50)), "floor-register-p50-ms")
	rpc50 := 2 * pct(rpcIdle, 50)
	b.ReportMetric(ms(rpc50), "two-rpcs-p50-ms")
	b.Logf("bound: two gRPC round trips between two processes here (each after the socket idled, p50 %.3f ms) take %.3f ms, however little each RPC does",
		ms(pct(rpcIdle, 50)), ms(rpc50))
	for k, s := range subjects {
		p50, p99 := pct(claim[k], 50), pct(claim[k], 99)
		b.ReportMetric(ms(p50), s.prefix+"p50-ms")
		b.ReportMetric(ms(p99), s.prefix+"p99-ms")
		b.ReportMetric(ms(p50-f50), s.prefix+"overhead-p50-ms")
		b.ReportMetric(ms(p99-f99), s.prefix+"overhead-p99-ms")
		b.ReportMetric(float64(p50)/float64(f50), s.prefix+"ratio-p50")
		b.ReportMetric(ms(pct(spawn[k], 50)), s.prefix+"spawn-p50-ms")
		b.ReportMetric(ms(pct(registered[k], 50)), s.prefix+"registered-p50-ms")
		b.Logf("%sclaim trace, p50 from the claim's start: spawned %.3f ms, registered %.3f ms, answered %.3f ms; floor from its exec: exec'd %.3f ms, registered %.3f ms, session reported %.3f ms",
			s.prefix, ms(pct(spawn[k], 50)), ms(pct(registered[k], 50)), ms(p50), ms(pct(floorExec, 50)), ms(pct(floorRegister, 50)), ms(f50))
		s.br.pair().cpu(b).since(cpu0[k]).report(b, s.prefix, "claim", len(claim[k]))
		verdict(b, s.prefix+"claim overhead over the floor ≤ 0.5 ms at p50", p50-f50 <= time.Millisecond/2,
			"overhead p50 %.3f ms = claim %.3f ms − floor %.3f ms; p99 %.3f vs %.3f ms; %d samples each",
			ms(p50-f50), ms(p50), ms(f50), ms(p99), ms(f99), len(claim[k]))
	}
}

// BenchmarkInstanceOwnSession is what leading a session of its own costs an
// instance's start, apart from the broker: the benchmark execs nexus-echo
// with no arguments (its runtime starts, it prints its usage and exits)
// alternately as spawnd does, in a new session, and as the floor's rig
// does, in a new process group only, and times each from fork to exit.
// Where the kernel groups scheduling by session (autogroup, on by default
// and under any cpu cgroup at the root), a new session competes with the
// rest of a busy machine as a group of its own; the claim pays that on its
// instance's boot, and the floor does not.
func BenchmarkInstanceOwnSession(b *testing.B) {
	benchPreflight(b)
	run := func(setsid bool) time.Duration {
		cmd := exec.Command(bin("nexus-echo"))
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: setsid, Setpgid: !setsid}
		start := time.Now()
		err := cmd.Run()
		if _, exited := err.(*exec.ExitError); err != nil && !exited {
			b.Fatal(err)
		}
		return time.Since(start)
	}
	var own, group []time.Duration
	for i := 0; b.Loop(); i++ {
		first := i%2 == 0 // neither always runs first
		for _, setsid := range []bool{first, !first} {
			if d := run(setsid); setsid {
				own = append(own, d)
			} else {
				group = append(group, d)
			}
		}
	}
	o50, g50 := pct(own, 50), pct(group, 50)
	b.ReportMetric(ms(o50), "own-session-p50-ms")
	b.ReportMetric(ms(g50), "own-group-p50-ms")
	b.ReportMetric(float64(o50)/float64(g50), "session-ratio-p50")
	b.Logf("nexus-echo fork to exit, p50 (p90): own session %.3f ms (%.3f), own process group %.3f ms (%.3f); %d runs each; /proc/sys/kernel/sched_autogroup_enabled = %s",
		ms(o50), ms(pct(own, 90)), ms(g50), ms(pct(group, 90)), len(own), autogroupSetting())
}

// autogroupSetting is the kernel's autogroup switch, as read.
func autogroupSetting() string {
	data, err := os.ReadFile("/proc/sys/kernel/sched_autogroup_enabled")
	if err != nil {
		return "unreadable (" + err.Error() + ")"
	}
	return strings.TrimSpace(string(data))
}

// --- 2. relay round trip ------------------------------------------------------

// BenchmarkRelayRoundTrip measures one {"type":"echo"} frame from a client
// through the broker to nexus-echo and back, sequentially, against the same
// client code talking to a gorilla echo server in this process (the issue's
// baseline). A third sample per iteration talks to a directly exec'd
// nexus-echo on its own dial-back socket: what the instance itself costs,
// so that broker minus instance is what the relay adds. (The issue's
// baseline runs in this process, so its round trip crosses no process
// boundary; through the broker a frame crosses four.)
func BenchmarkRelayRoundTrip(b *testing.B) {
	benchPreflight(b)
	subjects := benchSubjects(b, Options{YAML: "idle_timeout: 0s\n"})
	ctx, cancel := context.WithTimeout(context.Background(), rttDeadline)
	defer cancel()
	viaBroker := make([]*brokerclient.Conn, len(subjects))
	for k, s := range subjects {
		claim, err := s.br.Client.Claim(ctx, brokerclient.ClaimRequest{Config: benchConfig})
		if err != nil {
			b.Fatal(err)
		}
		viaBroker[k] = dialBench(b, claim.WSURL)
	}
	direct := dialBench(b, newDirectEcho(b))
	rig := newInstanceRig(b)
	inst := rig.spawn(b, "instance-direct")
	inst.await(b)
	viaFloor := startRelayFloor(b, 1)[0]

	relay := make([][]time.Duration, len(subjects))
	cpu0 := make([]cpuSample, len(subjects))
	for k, s := range subjects {
		cpu0[k] = s.br.pair().cpu(b)
	}
	var base, instance, floor []time.Duration
	for n := 0; b.Loop(); n++ {
		for k, s := range subjects {
			d, err := clientRoundTrip(viaBroker[k], n)
			if err != nil {
				b.Fatalf("through the %sbroker: %v", s.prefix, err)
			}
			relay[k] = append(relay[k], d)
		}
		d, err := clientRoundTrip(direct, n)
		if err != nil {
			b.Fatalf("direct: %v", err)
		}
		base = append(base, d)
		if d, err = instanceRoundTrip(inst, n); err != nil {
			b.Fatalf("instance direct: %v", err)
		}
		instance = append(instance, d)
		if d, err = clientRoundTrip(viaFloor, n); err != nil {
			b.Fatalf("relay floor: %v", err)
		}
		floor = append(floor, d)
	}
	inst.stop(b)
	// "Direct" is the same nexus-echo with no broker in between: the client's
	// WebSocket goes straight to the echo server the relay fronts. The
	// in-process echo server (no process hop at all) and a copy-only relay
	// process are reported beside it as the two bounds.
	i50, i99 := pct(instance, 50), pct(instance, 99)
	d50, f50 := pct(base, 50), pct(floor, 50)
	b.ReportMetric(ms(i50), "direct-p50-ms")
	b.ReportMetric(ms(i99), "direct-p99-ms")
	b.ReportMetric(ms(f50), "copy-relay-p50-ms")
	b.ReportMetric(ms(d50), "inprocess-echo-p50-ms")
	for k, s := range subjects {
		p50, p99 := pct(relay[k], 50), pct(relay[k], 99)
		b.ReportMetric(ms(p50), s.prefix+"p50-ms")
		b.ReportMetric(ms(p99), s.prefix+"p99-ms")
		b.ReportMetric(float64(p50)/float64(i50), s.prefix+"ratio-p50")
		b.ReportMetric(float64(p99)/float64(i99), s.prefix+"ratio-p99")
		// An echo is two relayed frames, one each way.
		s.br.pair().cpu(b).since(cpu0[k]).report(b, s.prefix, "echo", len(relay[k]))
		b.Logf("%sbounds: an in-process echo server %.3f ms; the same nexus-echo behind a copy-only relay process %.3f ms (%.2f× direct); the broker is %.2f× that copy-only relay",
			s.prefix, ms(d50), ms(f50), float64(f50)/float64(i50), float64(p50)/float64(f50))
		verdict(b, s.prefix+"relay round trip ≤ 1.6× direct", p50*5 <= i50*8,
			"p50 %.3f ms vs direct %.3f ms = %.2f×; p99 %.3f vs %.3f ms = %.2f×; %d samples each",
			ms(p50), ms(i50), float64(p50)/float64(i50), ms(p99), ms(i99), float64(p99)/float64(i99), len(relay[k]))
	}
}

// --- 3. relay throughput ------------------------------------------------------

// BenchmarkRelayThroughput has every client pipeline its frames while
// reading them back, one lease alone and fifty at once, against the same
// clients on the direct echo server. An iteration is one burst through the
// broker and one direct; frames/s is all frames over all burst time. A
// third burst goes through a copy-only relay process to as many nexus-echo
// instances (runRelayFloor): the bound any relay process meets here.
//
// Bursts stay under client_replay_buffer_bytes (1 MiB) and nexus-echo's
// 1 MiB outbound buffer, so backpressure, never eviction, paces them and
// every frame must come back; a lost frame fails the benchmark.
func BenchmarkRelayThroughput(b *testing.B) {
	benchPreflight(b)
	subjects := benchSubjects(b, Options{YAML: "max_concurrent: 0\nidle_timeout: 0s\n"})
	directURL := newDirectEcho(b)
	for _, tc := range []struct {
		leases, frames int
		target         float64
	}{{1, 5000, 0.7}, {50, 400, 0.6}} {
		b.Run(fmt.Sprintf("leases=%d", tc.leases), func(b *testing.B) {
			b.Cleanup(func() { b.ReportMetric(0, "ns/op") })
			viaBroker := make([][]*brokerclient.Conn, len(subjects))
			leases := make([][]*brokerclient.Claim, len(subjects))
			for k, s := range subjects {
				leases[k] = claimMany(b, s.br, tc.leases, 8)
				for _, c := range leases[k] {
					viaBroker[k] = append(viaBroker[k], dialBench(b, c.WSURL))
				}
			}
			direct := make([]*brokerclient.Conn, tc.leases)
			for i := range direct {
				direct[i] = dialBench(b, directURL)
			}
			viaFloor := startRelayFloor(b, tc.leases)
			relayTime := make([]time.Duration, len(subjects))
			cpu := make([]cpuSample, len(subjects))
			var directTime, floorTime time.Duration
			bursts := 0
			for b.Loop() {
				for k, s := range subjects {
					p := s.br.pair()
					c0 := p.cpu(b)
					relayTime[k] += pump(b, viaBroker[k], tc.frames)
					d := p.cpu(b).since(c0)
					cpu[k].gateway += d.gateway
					cpu[k].spawnd += d.spawnd
				}
				directTime += pump(b, direct, tc.frames)
				floorTime += pump(b, viaFloor, tc.frames)
				bursts++
			}
			frames := float64(bursts * tc.leases * tc.frames)
			directRate, floorRate := frames/directTime.Seconds(), frames/floorTime.Seconds()
			b.ReportMetric(directRate, "direct-frames/s")
			b.ReportMetric(floorRate/directRate, "copy-relay-ratio")
			b.Logf("bound: the same clients through a copy-only relay process to as many nexus-echo instances: %.0f frames/s, %.2f of direct",
				floorRate, floorRate/directRate)
			for k, s := range subjects {
				releaseMany(b, s.br, leases[k])
				relayRate := frames / relayTime[k].Seconds()
				b.ReportMetric(relayRate, s.prefix+"frames/s")
				b.ReportMetric(relayRate/directRate, s.prefix+"ratio")
				cpu[k].report(b, s.prefix, "echo", int(frames))
				verdict(b, fmt.Sprintf("%spipelined throughput on %d lease(s) ≥ %.1f× direct", s.prefix, tc.leases, tc.target), relayRate >= tc.target*directRate,
					"%d lease(s) × %d frames per burst, %d bursts: %.0f frames/s through the broker, %.0f direct (%.2f of direct); gateway %.1f µs CPU per echo",
					tc.leases, tc.frames, bursts, relayRate, directRate, relayRate/directRate, float64(cpu[k].gateway)/float64(time.Microsecond)/frames)
			}
			if len(subjects) > 1 && cpu[1].gateway > 0 {
				r := float64(cpu[0].gateway) / float64(cpu[1].gateway)
				b.ReportMetric(r, "gateway-cpu-vs-base")
				verdict(b, "gateway CPU per relayed frame ≤ 60% of the base build's", r <= 0.6, "%.2f of base", r)
			}
		})
	}
}

// pump has every conn send frames echo frames while it reads them back, and
// returns how long it took until every conn had all of its own back.
func pump(b *testing.B, conns []*brokerclient.Conn, frames int) time.Duration {
	b.Helper()
	var wg sync.WaitGroup
	errs := make(chan error, 2*len(conns))
	start := time.Now()
	for _, c := range conns {
		deadline := time.Now().Add(rttDeadline)
		_ = c.Underlying().SetWriteDeadline(deadline)
		_ = c.Underlying().SetReadDeadline(deadline)
		wg.Add(2)
		go func() {
			defer wg.Done()
			for n := 0; n < frames; n++ {
				if err := c.Send(benchEcho{Type: "echo", N: n}); err != nil {
					errs <- fmt.Errorf("sending frame %d: %w", n, err)
					return
				}
			}
		}()
		go func() {
			defer wg.Done()
			for n := 0; n < frames; n++ {
				f, err := c.Next()
				if err == nil {
					err = checkEcho(f.Payload, n)
				}
				if err != nil {
					errs <- fmt.Errorf("frame %d of %d: %w", n, frames, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	d := time.Since(start)
	close(errs)
	if err := <-errs; err != nil {
		b.Fatal(err)
	}
	return d
}

// claimMany claims n leases, parallel claims at a time.
func claimMany(b *testing.B, br *Broker, n, parallel int) []*brokerclient.Claim {
	b.Helper()
	out := make([]*brokerclient.Claim, n)
	errs := make([]error, n)
	next := make(chan int)
	var wg sync.WaitGroup
	for range parallel {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
				out[i], errs[i] = br.Client.Claim(ctx, brokerclient.ClaimRequest{Config: benchConfig})
				cancel()
			}
		}()
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			b.Fatalf("claim %d of %d: %v", i+1, n, err)
		}
	}
	return out
}

// releaseMany releases leases concurrently.
func releaseMany(b *testing.B, br *Broker, leases []*brokerclient.Claim) {
	b.Helper()
	var wg sync.WaitGroup
	errs := make(chan error, len(leases))
	for _, c := range leases {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			if err := br.Client.Release(ctx, c.LeaseID); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		b.Fatalf("release: %v", err)
	}
}

// --- gateway log arrival times ----------------------------------------------

// logTail follows a process's log and stamps each line with when it reached
// this process. The gateway's own timestamps have millisecond resolution;
// arrival over the pipe is within microseconds of the write.
type logTail struct {
	mu    sync.Mutex
	lines []stampedLine
	wake  chan struct{} // closed and replaced when lines grows
}

type stampedLine struct {
	at   time.Time
	text string
}

func tailLog(b *testing.B, lb *logBuffer) *logTail {
	t := &logTail{wake: make(chan struct{})}
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		off, partial := 0, ""
		for {
			lb.mu.Lock()
			all := lb.buf.Bytes()
			chunk := string(all[off:])
			off = len(all)
			wake := lb.wake
			lb.mu.Unlock()
			now := time.Now()
			if chunk != "" {
				text := partial + chunk
				i := strings.LastIndexByte(text, '\n')
				partial = text[i+1:]
				if i >= 0 {
					t.mu.Lock()
					for _, line := range strings.Split(text[:i], "\n") {
						t.lines = append(t.lines, stampedLine{at: now, text: line})
					}
					close(t.wake)
					t.wake = make(chan struct{})
					t.mu.Unlock()
				}
			}
			select {
			case <-wake:
			case <-stop:
				return
			}
		}
	}()
	b.Cleanup(func() {
		close(stop)
		<-done
	})
	return t
}

// mark is the index of the next line to arrive.
func (t *logTail) mark() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.lines)
}

// await returns the arrival time of the first line at or after from that
// matches re.
func (t *logTail) await(b *testing.B, from int, re *regexp.Regexp) time.Time {
	b.Helper()
	deadline := time.NewTimer(rttDeadline)
	defer deadline.Stop()
	for {
		t.mu.Lock()
		for _, l := range t.lines[min(from, len(t.lines)):] {
			if re.MatchString(l.text) {
				t.mu.Unlock()
				return l.at
			}
		}
		from = len(t.lines)
		wake := t.wake
		t.mu.Unlock()
		select {
		case <-wake:
		case <-deadline.C:
			b.Fatalf("no gateway log line matching %q within %s", re, rttDeadline)
		}
	}
}
