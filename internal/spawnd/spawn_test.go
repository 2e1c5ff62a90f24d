package spawnd

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/nexus-broker/nexus-broker/internal/spawnproof"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// TestSpawnEnvironmentArgvAndConfig checks everything an instance is handed:
// argv in the contract's order, exactly the allowed environment with the
// dial-back trio winning, a 0600 config it can read, its own process group,
// HOME as working directory, and output in its log file. It then checks the
// config is removed once the instance is gone.
func TestSpawnEnvironmentArgvAndConfig(t *testing.T) {
	t.Setenv("SPAWND_TEST_INHERITED", "inherited")
	t.Setenv("SPAWND_TEST_LEAK", "must not reach the instance")
	h := newHarness(t, `
state_dir: STATE
inherit_env: [SPAWND_TEST_INHERITED]
binaries:
  nexus:
    path: FAKE
    args: [-report, REPORT, -mode, block]
    env:
      ENTRY_VAR: from-entry
      SPAWND_TEST_INHERITED: overridden-by-entry
      NEXUS_BROKER_SPAWN_SECRET: forged
`)
	stream := h.watch()
	resp, err := h.client.Spawn(h.ctx(), &spawnpb.SpawnRequest{
		LeaseId:         "lease-env",
		Entry:           "nexus",
		Config:          []byte("core:\n  name: env test\n"),
		RecallSessionId: "sess-1",
		Principal:       "alice",
		ListenPort:      8080, // the gateway's bound port, as listen_addr (:8080) names it
	})
	if err != nil {
		t.Fatal(err)
	}
	f := h.accept()
	r := f.report

	configPath := filepath.Join(h.d.configDir, "lease-env.yaml")
	wantArgs := []string{fakeBin, "-config", configPath, "-recall", "sess-1", "-report", h.reportPath, "-mode", "block"}
	if !slices.Equal(r.Args, wantArgs) {
		t.Errorf("argv = %q\nwant   %q", r.Args, wantArgs)
	}
	if r.Config != "core:\n  name: env test\n" || r.ConfigMode != 0o600 {
		t.Errorf("config read by the instance = %q mode %v, want the claim's text mode 0600", r.Config, r.ConfigMode)
	}

	env := f.env()
	if len(env) != len(r.Env) {
		t.Errorf("environment repeats a name: %q", r.Env)
	}
	want := []string{"ENTRY_VAR", "NEXUS_BROKER_ADDR", "NEXUS_BROKER_LEASE_ID", "NEXUS_BROKER_SPAWN_SECRET", "SPAWND_TEST_INHERITED"}
	for _, name := range alwaysPass {
		if _, ok := os.LookupEnv(name); ok {
			want = append(want, name)
		}
	}
	slices.Sort(want)
	if got := slices.Sorted(maps.Keys(env)); !slices.Equal(got, want) {
		t.Errorf("environment names = %q\nwant                %q", got, want)
	}
	secret := hex.EncodeToString(hmacSHA256(h.d.key, "lease-env"))
	for name, v := range map[string]string{
		"NEXUS_BROKER_ADDR":         testBrokerAddr,
		"NEXUS_BROKER_LEASE_ID":     "lease-env",
		"NEXUS_BROKER_SPAWN_SECRET": secret,
		"SPAWND_TEST_INHERITED":     "overridden-by-entry",
		"ENTRY_VAR":                 "from-entry",
		"HOME":                      os.Getenv("HOME"),
	} {
		if env[name] != v {
			t.Errorf("%s = %q, want %q", name, env[name], v)
		}
	}
	if r.Cwd != workingDir(os.Getenv("HOME")) {
		t.Errorf("working directory = %q, want spawnd's HOME %q", r.Cwd, os.Getenv("HOME"))
	}
	if r.PGID != r.PID {
		t.Errorf("instance pid %d is in process group %d, want its own", r.PID, r.PGID)
	}
	if resp.CreatedUnixNano == 0 {
		t.Error("Spawn returned no created time")
	}

	f.send("exit 0")
	if ev := h.nextExit(stream); ev.LeaseId != "lease-env" || ev.ExitCode != 0 || ev.Signal != "" || ev.Terminated {
		t.Errorf("exit = %v, want lease-env exit code 0, not terminated", ev)
	}
	if _, err := os.Stat(configPath); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("temp config still there after the instance exited: %v", err)
	}
	out, err := os.ReadFile(filepath.Join(h.stateDir, "logs", "lease-env.log"))
	if err != nil || !strings.Contains(string(out), "fake instance started") {
		t.Errorf("instance log = %q (%v), want the instance's stdout", out, err)
	}
	if strings.Contains(h.logs.text(), secret) {
		t.Error("spawnd logged a spawn secret")
	}
}

func hmacSHA256(key []byte, msg string) []byte {
	mac := hmac.New(sha256.New, key)
	mac.Write([]byte(msg))
	return mac.Sum(nil)
}

// TestLeaderExitKillsItsGroup: when the instance exits on its own, what it
// started goes with it, and every Watch stream hears of the exit.
func TestLeaderExitKillsItsGroup(t *testing.T) {
	h := newHarness(t, defaultYAML)
	first, second := h.watch(), h.watch()
	_, f := h.spawn("lease-family", "family")
	gpgid, err := unix.Getpgid(f.report.Grandchild)
	if err != nil || gpgid != f.report.PID {
		t.Fatalf("grandchild is in group %d (%v), want the instance's %d", gpgid, err, f.report.PID)
	}
	grandchild := pidfdOf(t, f.report.Grandchild)

	f.send("exit 7")
	for _, stream := range []grpc.ServerStreamingClient[spawnpb.ExitEvent]{first, second} {
		if ev := h.nextExit(stream); ev.LeaseId != "lease-family" || ev.ExitCode != 7 || ev.Terminated {
			t.Errorf("exit = %v, want lease-family code 7, not terminated", ev)
		}
	}
	awaitGone(t, grandchild)
	h.logs.await(t, "instance exited", "lease_id", "lease-family", "exit_code", 7, "reason", reasonCrashed)
}

func TestExitCodeIsReported(t *testing.T) {
	h := newHarness(t, defaultYAML)
	stream := h.watch()
	h.spawn("lease-3", "exit3")
	if ev := h.nextExit(stream); ev.ExitCode != 3 || ev.Signal != "" {
		t.Errorf("exit = %v, want code 3", ev)
	}
}

func TestSpawnRefusals(t *testing.T) {
	h := newHarness(t, defaultYAML)
	stream := h.watch()
	h.spawn("lease-once", "exit3")
	h.nextExit(stream)
	_, live := h.spawn("lease-live", "nexus")

	for _, tc := range []struct {
		name string
		req  *spawnpb.SpawnRequest
		code codes.Code
		msg  string
	}{
		{"empty lease id", &spawnpb.SpawnRequest{Entry: "nexus"}, codes.InvalidArgument, "lease id"},
		{"lease id with a path", &spawnpb.SpawnRequest{LeaseId: "../x", Entry: "nexus"}, codes.InvalidArgument, "lease id"},
		{"unknown entry", &spawnpb.SpawnRequest{LeaseId: "lease-new", Entry: "vision"}, codes.NotFound,
			`unknown entry "vision"; this nexus-spawnd spawns: exit3, family, ignore, nexus, notify`},
		{"live lease id", &spawnpb.SpawnRequest{LeaseId: "lease-live", Entry: "nexus"}, codes.AlreadyExists, "is running"},
		{"spent lease id", &spawnpb.SpawnRequest{LeaseId: "lease-once", Entry: "nexus"}, codes.AlreadyExists, "is gone"},
		{"a port listen_addr does not name", &spawnpb.SpawnRequest{LeaseId: "lease-new", Entry: "nexus", ListenPort: 9090}, codes.InvalidArgument,
			`the gateway reports listening on port 9090, but listen_addr ":8080" names port 8080`},
		{"no TCP port", &spawnpb.SpawnRequest{LeaseId: "lease-new", Entry: "nexus", ListenPort: 1 << 20}, codes.InvalidArgument, "which is no TCP port"},
		{"oversize principal", &spawnpb.SpawnRequest{LeaseId: "lease-new", Entry: "nexus", Principal: strings.Repeat("p", maxPrincipalLen+1)}, codes.InvalidArgument,
			"principal of 1025 bytes is longer than 1024"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := h.client.Spawn(h.ctx(), tc.req)
			if status.Code(err) != tc.code || !strings.Contains(err.Error(), tc.msg) {
				t.Errorf("Spawn = %v, want %s containing %q", err, tc.code, tc.msg)
			}
		})
	}
	// None of the refusals spawned anything or disturbed the live lease.
	list, err := h.client.List(h.ctx(), &spawnpb.ListRequest{})
	if err != nil || len(list.Leases) != 1 || list.Leases[0].LeaseId != "lease-live" {
		t.Errorf("List = %v (%v), want only lease-live", list, err)
	}
	live.send("exit 0")
}

func TestVerify(t *testing.T) {
	h := newHarness(t, defaultYAML)
	stream := h.watch()
	resp, f := h.spawn("lease-v", "nexus")
	secret := f.env()["NEXUS_BROKER_SPAWN_SECRET"]
	if want := hex.EncodeToString(hmacSHA256(h.d.key, "lease-v")); secret != want {
		t.Fatalf("instance secret %q is not hex(HMAC-SHA256(spawn-key, lease id)) %q", secret, want)
	}
	// The verifier Spawn answers checks the instance's secret and no other,
	// and holds neither the secret nor the key.
	v := resp.GetVerifier()
	if !spawnproof.Matches(v, secret) || spawnproof.Matches(v, strings.Repeat("0", len(secret))) || spawnproof.Matches(v, secret[:10]) {
		t.Fatalf("Spawn's verifier %x does not check the instance's secret, or checks others too", v)
	}
	if bytes.Contains(v, h.d.key) || bytes.Contains([]byte(secret), []byte(hex.EncodeToString(v))) || bytes.Equal(v, hmacSHA256(h.d.key, "lease-v")) {
		t.Fatal("Spawn's verifier is the spawn-key or the secret")
	}
	verify := func(id, secret string) spawnpb.VerifyResult {
		t.Helper()
		resp, err := h.client.Verify(h.ctx(), &spawnpb.VerifyRequest{LeaseId: id, Secret: secret})
		if err != nil {
			t.Fatal(err)
		}
		return resp.Result
	}
	for _, tc := range []struct {
		id, secret string
		want       spawnpb.VerifyResult
	}{
		{"lease-v", secret, spawnpb.VerifyResult_VERIFY_RESULT_OK},
		{"lease-v", "", spawnpb.VerifyResult_VERIFY_RESULT_NO_SECRET},
		{"lease-v", strings.Repeat("0", len(secret)), spawnpb.VerifyResult_VERIFY_RESULT_WRONG_SECRET},
		{"lease-v", secret[:10], spawnpb.VerifyResult_VERIFY_RESULT_WRONG_SECRET},
		{"lease-other", secret, spawnpb.VerifyResult_VERIFY_RESULT_UNKNOWN_LEASE},
		{"", secret, spawnpb.VerifyResult_VERIFY_RESULT_UNKNOWN_LEASE},
	} {
		if got := verify(tc.id, tc.secret); got != tc.want {
			t.Errorf("Verify(%q, %q) = %v, want %v", tc.id, tc.secret, got, tc.want)
		}
	}
	f.send("exit 0")
	h.nextExit(stream)
	if got := verify("lease-v", secret); got != spawnpb.VerifyResult_VERIFY_RESULT_UNKNOWN_LEASE {
		t.Errorf("Verify after exit = %v, want UNKNOWN_LEASE", got)
	}
}

func TestRecordAndList(t *testing.T) {
	h := newHarness(t, defaultYAML)
	if _, err := h.client.Record(h.ctx(), &spawnpb.RecordRequest{LeaseId: "lease-none", SessionId: "s"}); status.Code(err) != codes.NotFound {
		t.Errorf("Record of an unknown lease = %v, want NotFound", err)
	}
	first, _ := h.spawn("lease-b", "nexus")
	second, _ := h.spawn("lease-a", "notify")
	if _, err := h.client.Record(h.ctx(), &spawnpb.RecordRequest{LeaseId: "lease-b", SessionId: "sess-b"}); err != nil {
		t.Fatal(err)
	}
	list, err := h.client.List(h.ctx(), &spawnpb.ListRequest{})
	if err != nil {
		t.Fatal(err)
	}
	want := []*spawnpb.Lease{
		{LeaseId: "lease-b", Principal: "alice", SessionId: "sess-b", Entry: "nexus", Pid: first.Pid, CreatedUnixNano: first.CreatedUnixNano, Verifier: first.Verifier},
		{LeaseId: "lease-a", Principal: "alice", Entry: "notify", Pid: second.Pid, CreatedUnixNano: second.CreatedUnixNano, Verifier: second.Verifier},
	}
	if len(list.Leases) != len(want) {
		t.Fatalf("List = %v, want %v", list.Leases, want)
	}
	for i := range want {
		if got := list.Leases[i]; !proto.Equal(got, want[i]) {
			t.Errorf("List[%d] = %v, want %v", i, got, want[i])
		}
	}
}

// TestAnUnwritableTempConfigIsItsOwnFailure: a config that cannot be written
// is not an exec failure, and the error says which step failed.
func TestAnUnwritableTempConfigIsItsOwnFailure(t *testing.T) {
	h := newHarness(t, defaultYAML)
	if err := os.RemoveAll(h.d.configDir); err != nil {
		t.Fatal(err)
	}
	_, err := h.client.Spawn(h.ctx(), &spawnpb.SpawnRequest{
		LeaseId: "lease-noconf", Entry: "nexus", Config: []byte("core: {}\n"),
	})
	st, step := status.Convert(err), stepOf(err)
	if st.Code() != codes.Internal || step != spawnpb.SpawnStep_SPAWN_STEP_TEMP_CONFIG || !strings.Contains(st.Message(), "writing temp config") {
		t.Errorf("Spawn with no temp-config directory = %v (step %v), want INTERNAL, step TEMP_CONFIG, naming writing temp config", err, step)
	}
}

// verifyRefusals is a Daemon of just what Verify reads (the key and the
// lease tables, which keeps process noise out of a measurement) and two
// register frames it refuses: a live lease with a wrong secret, and an id
// of the same length spawnd never held.
func verifyRefusals() (d *Daemon, wrongSecret, unknownLease *spawnpb.VerifyRequest) {
	d = &Daemon{
		key:    make([]byte, spawnKeySize),
		leases: map[string]*lease{"lease-bench": {state: stateRunning}},
		spent:  map[string]struct{}{"lease-bench": {}},
	}
	wrong := strings.Repeat("0", len(secretFor(d.key, "lease-bench")))
	return d, &spawnpb.VerifyRequest{LeaseId: "lease-bench", Secret: wrong},
		&spawnpb.VerifyRequest{LeaseId: "lease-stray", Secret: wrong}
}

// TestVerifyRefusalsDoTheSameWork: refusing an unknown lease allocates
// exactly what refusing a wrong secret does (formatting admit's refusal
// for the unknown one alone is what made it slower).
func TestVerifyRefusalsDoTheSameWork(t *testing.T) {
	d, wrong, unknown := verifyRefusals()
	allocs := func(req *spawnpb.VerifyRequest, want spawnpb.VerifyResult) float64 {
		res, err := d.Verify(context.Background(), req)
		if err != nil || res.Result != want {
			t.Fatalf("Verify(%s) = %v, %v; want %v", req.LeaseId, res, err, want)
		}
		return testing.AllocsPerRun(200, func() { _, _ = d.Verify(context.Background(), req) })
	}
	w := allocs(wrong, spawnpb.VerifyResult_VERIFY_RESULT_WRONG_SECRET)
	u := allocs(unknown, spawnpb.VerifyResult_VERIFY_RESULT_UNKNOWN_LEASE)
	if w != u {
		t.Errorf("Verify allocates %v times for a wrong secret, %v for an unknown lease", w, u)
	}
}

// BenchmarkVerifyRefusal measures how long Verify takes to refuse an unknown
// lease against its baseline, a live lease with a wrong secret, in the same
// run: batches of each alternate so drift hits both alike, and the ratio is
// of the median batches, so a batch another process preempted does not
// count. It should be 1.00: the time a refusal takes must not tell a dialer
// whether a lease id is live.
func BenchmarkVerifyRefusal(b *testing.B) {
	d, wrong, unknown := verifyRefusals()
	reqs := [2]*spawnpb.VerifyRequest{wrong, unknown}
	const batch = 64
	var spent [2][]time.Duration
	b.ResetTimer()
	for done := 0; done < b.N; done += batch {
		for k, req := range reqs {
			began := time.Now()
			for range batch {
				if _, err := d.Verify(context.Background(), req); err != nil {
					b.Fatal(err)
				}
			}
			spent[k] = append(spent[k], time.Since(began))
		}
	}
	b.StopTimer()
	median := func(ds []time.Duration) float64 {
		slices.Sort(ds)
		return float64(ds[len(ds)/2].Nanoseconds()) / batch
	}
	wrongNs, unknownNs := median(spent[0]), median(spent[1])
	b.ReportMetric(wrongNs, "wrong-secret-ns/op")
	b.ReportMetric(unknownNs, "unknown-lease-ns/op")
	b.ReportMetric(unknownNs/wrongNs, "unknown-vs-wrong")
}

// TestDialBackComesFromSpawndsConfig: NEXUS_BROKER_ADDR is built from
// spawnd's own listen_addr; the gateway's reported port fills in only a
// port-0 listen_addr, and without one the spawn is refused.
func TestDialBackComesFromSpawndsConfig(t *testing.T) {
	h := newHarness(t, "listen_addr: \"0.0.0.0:0\"\n"+defaultYAML)
	_, err := h.client.Spawn(h.ctx(), &spawnpb.SpawnRequest{LeaseId: "lease-noport", Entry: "nexus"})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "asks for any free port, and the gateway reported no port it bound") {
		t.Errorf("Spawn without a bound port under listen_addr port 0 = %v, want InvalidArgument", err)
	}
	if _, err := h.client.Spawn(h.ctx(), &spawnpb.SpawnRequest{LeaseId: "lease-port", Entry: "nexus", ListenPort: 41234}); err != nil {
		t.Fatal(err)
	}
	if got := h.accept().env()["NEXUS_BROKER_ADDR"]; got != "ws://127.0.0.1:41234/instance" {
		t.Errorf("NEXUS_BROKER_ADDR = %q, want the loopback dial of the reported port", got)
	}
}

// TestInstanceLogIsCappedInPlace: an instance that writes 24 MiB, twice,
// keeps running and answering, leaves a log of at most maxInstanceLog that
// holds the marker, and costs one WARN.
func TestInstanceLogIsCappedInPlace(t *testing.T) {
	h := newHarness(t, defaultYAML)
	_, f := h.spawn("lease-loud", "nexus")
	path := filepath.Join(h.d.logDir, "lease-loud.log")
	for range 2 {
		f.send(fmt.Sprint("write ", 24<<20))
		f.expectLine("wrote")
	}
	h.logs.await(t, "an instance log passed its cap and was truncated in place; its instance writes on after a marker", "path", path)
	// The cap acts on inotify events, which may still be queued when the
	// writes end; the log settles with the marker in it and no more than
	// the cap. Nothing to wait on from here but the file itself.
	deadline := time.Now().Add(waitLimit)
	for {
		data, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if len(data) <= maxInstanceLog && bytes.Contains(data, []byte(logTruncated)) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the log holds %d bytes %s after the writes ended (marker present: %v); want at most %d, with the marker",
				len(data), waitLimit, bytes.Contains(data, []byte(logTruncated)), maxInstanceLog)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if n := len(h.logs.find("an instance log passed its cap and was truncated in place; its instance writes on after a marker")); n != 1 {
		t.Errorf("%d WARNs for one loud log, want 1", n)
	}
}

// TestLogsOfEndedLeasesArePruned: past maxLogsTotal the oldest logs of
// ended leases go, at boot; a live lease's log stays.
func TestLogsOfEndedLeasesArePruned(t *testing.T) {
	h := newHarness(t, defaultYAML)
	_, live := h.spawn("lease-live", "nexus")
	defer live.send("exit 0")
	h.stop()
	logDir := filepath.Join(h.stateDir, "logs")
	old := time.Now().Add(-time.Hour)
	for i := range 40 {
		p := filepath.Join(logDir, fmt.Sprintf("lease-old-%02d.log", i))
		if err := os.WriteFile(p, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(p, 8<<20); err != nil { // sparse: size without the disk
			t.Fatal(err)
		}
		if err := os.Chtimes(p, old, old.Add(time.Duration(i)*time.Second)); err != nil {
			t.Fatal(err)
		}
	}
	h.start()
	ents, err := os.ReadDir(logDir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	var total int64
	for _, e := range ents {
		info, _ := e.Info()
		total += info.Size()
		names = append(names, e.Name())
	}
	if total > maxLogsTotal || !slices.Contains(names, "lease-live.log") || slices.Contains(names, "lease-old-00.log") || !slices.Contains(names, "lease-old-39.log") {
		t.Errorf("after boot the log directory holds %d bytes in %v; want at most %d, the live lease's log kept and the oldest gone", total, names, maxLogsTotal)
	}
}

// TestAnExecFailureHarmsNothing: an entry whose binary went away after boot
// fails at the exec step, leaves no temp config, and signals nobody (an
// exec failure once made spawnd SIGKILL its own process group).
func TestAnExecFailureHarmsNothing(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "vanishing")
	if err := os.Symlink(fakeBin, bin); err != nil {
		t.Fatal(err)
	}
	h := newHarness(t, defaultYAML+"  vanishing:\n    path: "+bin+"\n")
	if h.d.cgroups != nil {
		t.Skip("this tests the process-group path; a delegated cgroup tree is in use")
	}
	if err := os.Remove(bin); err != nil {
		t.Fatal(err)
	}
	_, err := h.client.Spawn(h.ctx(), &spawnpb.SpawnRequest{LeaseId: "lease-noexec", Entry: "vanishing", Config: []byte("core: {}\n")})
	st, step := status.Convert(err), stepOf(err)
	if st.Code() != codes.Internal || step != spawnpb.SpawnStep_SPAWN_STEP_EXEC || !strings.Contains(st.Message(), "exec "+bin) {
		t.Errorf("Spawn of a vanished binary = %v (step %v), want INTERNAL, step EXEC, naming the exec of %s", err, step, bin)
	}
	if _, err := os.Stat(h.d.configFor("lease-noexec")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the failed spawn's temp config is left behind (%v)", err)
	}
	// Still serving, and a healthy entry still spawns.
	h.spawn("lease-after", "nexus")
}
