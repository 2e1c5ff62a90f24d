package e2e

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/sockdir"
	"github.com/nexus-broker/nexus-broker/internal/spawnclient"
	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// runToExit runs a binary that is expected to refuse its boot, and returns
// its exit code and output. It fails the test if the binary is still
// running after a minute.
func runToExit(t *testing.T, env []string, name string, args ...string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin(name), args...)
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), "HOME=" + t.TempDir()}, env...)
	out, err := cmd.CombinedOutput()
	if ctx.Err() != nil {
		t.Fatalf("%s %v still running after a minute; output:\n%s", name, args, out)
	}
	if err == nil {
		return 0, string(out)
	}
	if ee, ok := err.(*exec.ExitError); ok {
		return ee.ExitCode(), string(out)
	}
	t.Fatalf("%s: %v", name, err)
	return 0, ""
}

// writeConfig writes broker.yaml text into dir and returns its path.
func writeConfig(t *testing.T, dir, yaml string) string {
	t.Helper()
	path := filepath.Join(dir, "broker.yaml")
	if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestOverlongSocketPathRefused: a run_dir whose socket path cannot bind is
// refused at boot, by spawnd and by a launching gateway, naming the path,
// its length and the limit, instead of bind's "invalid argument".
func TestOverlongSocketPathRefused(t *testing.T) {
	runDir := filepath.Join(sockdir.New(t, "nxl"), strings.Repeat("r", 100))
	cfg := writeConfig(t, t.TempDir(), fmt.Sprintf("listen_addr: \"127.0.0.1:%d\"\nspawnd:\n  run_dir: %q\nbinaries:\n  nexus:\n    path: %q\n", freePort(t), runDir, bin("nexus-echo")))
	n := len(runDir) + len("/plugin") + 10
	for _, name := range []string{"nexus-spawnd", "nexus-broker"} {
		code, out := runToExit(t, nil, name, "-config", cfg)
		if code == 0 {
			t.Fatalf("%s booted with an over-long run_dir:\n%s", name, out)
		}
		for _, want := range []string{runDir, fmt.Sprintf("would be %d bytes", n), "over the limit of 107"} {
			if !strings.Contains(out, want) {
				t.Errorf("%s refused, but does not say %q:\n%s", name, want, out)
			}
		}
		if strings.Contains(out, "invalid argument") {
			t.Errorf("%s still reports bind's error:\n%s", name, out)
		}
	}
	if _, err := os.Stat(runDir); err == nil {
		t.Errorf("the over-long run_dir was created")
	}
}

// TestConfigLoadFailureIsOneRecord: a config that fails to load is, on
// stderr, upstream's one record and nothing else, from the gateway and from
// spawnd alike: level=ERROR msg="failed to load config", the path as given
// and our error text as error=, then exit status 1.
func TestConfigLoadFailureIsOneRecord(t *testing.T) {
	dir := t.TempDir()
	cfg := writeConfig(t, dir, fmt.Sprintf("listen_addr: \"127.0.0.1:%d\"\nbogus_key: 1\nbinaries:\n  nexus:\n    path: %q\n", freePort(t), bin("nexus-echo")))
	missing := filepath.Join(dir, "missing.yaml")
	// A value this machine refuses once the file has parsed is a config
	// that did not load too (upstream checks its registry on load).
	refusedEnv := filepath.Join(t.TempDir(), "broker.yaml")
	writeConfig(t, filepath.Dir(refusedEnv), fmt.Sprintf("spawnd:\n  run_dir: %q\ninherit_env: [NEXUS_BROKER_SPAWN_SECRET]\nbinaries:\n  nexus:\n    path: %q\n",
		filepath.Join(sockdir.New(t, "nxc"), "run"), bin("nexus-echo")))
	// auth: is part of the file: nothing is logged before its refusal.
	unsetToken := writeConfig(t, t.TempDir(), fmt.Sprintf("listen_addr: \"127.0.0.1:%d\"\nauth:\n  validators: [{type: static, tokens: [{token_env: NEXUS_E2E_SURELY_UNSET, principal: p}]}]\n", freePort(t)))
	for _, c := range []struct {
		name, path, err string
	}{
		{"nexus-broker", unsetToken, "broker config: auth.validators[0].tokens[0].token_env: the environment variable NEXUS_E2E_SURELY_UNSET is not set or empty"},
		{"nexus-spawnd", refusedEnv, "broker config: inherit_env[0]: NEXUS_BROKER_SPAWN_SECRET is set by the broker on every spawn"},
		{"nexus-broker", cfg, "broker config: bogus_key: unknown key; the keys allowed here are "},
		{"nexus-spawnd", cfg, "broker config: bogus_key: unknown key; the keys allowed here are "},
		{"nexus-broker", missing, "broker config: lstat " + missing + ": no such file or directory (check the -config path)"},
		{"nexus-spawnd", missing, "broker config: lstat " + missing + ": no such file or directory (check the -config path)"},
	} {
		code, out := runToExit(t, nil, c.name, "-config", c.path)
		record := regexp.MustCompile(`^time=\S+ level=ERROR msg="failed to load config" path=` + regexp.QuoteMeta(c.path) + ` error=("[^\n]*")\n$`)
		m := record.FindStringSubmatch(out)
		if code != 1 || m == nil {
			t.Errorf("%s -config %s: exit %d, stderr not the one failed to load config record:\n%s", c.name, c.path, code, out)
			continue
		}
		if got, _ := strconv.Unquote(m[1]); !strings.HasPrefix(got, c.err) {
			t.Errorf("%s -config %s: error=%s, want it to start %q", c.name, c.path, m[1], c.err)
		}
	}
}

// TestMissingBinaryRefusedBeforeListening: a config naming a binary that
// does not exist never has the gateway open its port. It exits non-zero
// quoting spawnd's message for this attempt, and only this attempt's: the
// first attempt's complaint is in spawnd.log, but not in the second's error.
func TestMissingBinaryRefusedBeforeListening(t *testing.T) {
	runDir := filepath.Join(sockdir.New(t, "nxm"), "run")
	dir := t.TempDir()
	port := freePort(t)
	for _, missing := range []string{"/nonexistent/first-nexus", "/nonexistent/second-nexus"} {
		cfg := writeConfig(t, dir, fmt.Sprintf("listen_addr: \"127.0.0.1:%d\"\nspawnd:\n  run_dir: %q\nbinaries:\n  nexus:\n    path: %q\n", port, runDir, missing))
		code, out := runToExit(t, nil, "nexus-broker", "-config", cfg)
		if code == 0 {
			t.Fatalf("the gateway booted on a missing binary:\n%s", out)
		}
		if strings.Contains(out, "nexus-broker listening") {
			t.Errorf("the gateway listened before spawnd's verdict:\n%s", out)
		}
		// spawnd's refusal, relayed as upstream's record of a registry
		// entry that does not resolve.
		relayed := regexp.MustCompile(`level=ERROR msg="failed to load config" path=\S+ error="broker config: binaries: nexus: path \\"` + missing + `\\" \(resolved ` + missing + `\) does not exist; [^"]*" spawnd_pid=\d+\n`)
		if !relayed.MatchString(out) {
			t.Errorf("the refusal does not relay spawnd's record about %s:\n%s", missing, out)
		}
		if missing == "/nonexistent/second-nexus" && strings.Contains(out, "first-nexus") {
			t.Errorf("the second attempt's refusal quotes the first attempt's lines:\n%s", out)
		}
	}
	log, _ := os.ReadFile(filepath.Join(runDir, "spawnd.log"))
	if !strings.Contains(string(log), "first-nexus") {
		t.Errorf("spawnd.log lost the first attempt (so the check above proves nothing):\n%s", log)
	}
	if c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port), time.Second); err == nil {
		c.Close()
		t.Errorf("something listens on the refused gateway's port")
	}
}

// twoConfigs are the Options of two brokers of one user with a config
// file each and no spawnd.run_dir, launched the make-run way: entries
// alpha and beta, default run directories under one $XDG_RUNTIME_DIR.
func twoConfigs(t *testing.T) []Options {
	xdg := sockdir.New(t, "nxx")
	var opts []Options
	for _, entry := range []string{"alpha", "beta"} {
		opts = append(opts, Options{Launch: true, XDGRuntimeDir: xdg,
			YAML: fmt.Sprintf("  %s:\n    path: %q\n", entry, bin("nexus-echo"))})
	}
	return opts
}

// TestTwoConfigsOneUserNoRunDir: two brokers of one user, two config files,
// no spawnd.run_dir, started one after the other: each gets a spawnd of its
// own (the default run directory is per config file), serves its own
// registry and claims its own entries, and restarting one never touches
// the other's leases: the first's client stays attached throughout.
func TestTwoConfigsOneUserNoRunDir(t *testing.T) {
	opts := twoConfigs(t)
	twoBrokersApart(t, startBroker(t, opts[0]), startBroker(t, opts[1]))
}

// TestTwoConfigsOneUserStartedTogether: the same two brokers started at the
// same time, both gateways (and so both spawnd launches and both default
// run directories' creation) under way before either listens, a few times
// over on a fresh $XDG_RUNTIME_DIR; and restarted at the same time with
// their leases live: each comes back to its own spawnd and leases.
func TestTwoConfigsOneUserStartedTogether(t *testing.T) {
	for round := range 3 {
		t.Run(fmt.Sprint("round", round), func(t *testing.T) {
			bs := startBrokersTogether(t, twoConfigs(t)...)
			a, b := bs[0], bs[1]
			claimA, claimB := twoBrokersApart(t, a, b)
			pids := [][]int{a.Instances(), b.Instances()}
			for _, br := range bs {
				br.KillGateway(syscall.SIGKILL)
			}
			for _, br := range bs {
				br.spawnGateway()
			}
			for i, br := range bs {
				br.awaitGateway()
				id := []string{claimA.LeaseID, claimB.LeaseID}[i]
				br.waitStates([]string{id}, "active", 20*time.Second)
				if after := br.Instances(); len(after) != 1 || after[0] != pids[i][0] {
					t.Fatalf("broker %d's instances were %v, after both restarted %v", i, pids[i], after)
				}
			}
		})
	}
}

// twoBrokersApart checks two running brokers of twoConfigs: each has its
// own run directory and spawnd, serves and claims only its own entry, and
// two restarts of the second leave the first's lease and client alone. It
// returns the two brokers' leases, both live.
func twoBrokersApart(t *testing.T, a, b *Broker) (claimA, claimB *brokerclient.Claim) {
	t.Helper()
	if a.RunDir == b.RunDir {
		t.Fatalf("both configs resolved to run directory %s", a.RunDir)
	}
	if a.launchedSpawnd() == b.launchedSpawnd() {
		t.Fatalf("both gateways attached to spawnd pid %d", a.launchedSpawnd())
	}
	for _, c := range []struct {
		b          *Broker
		own, other string
	}{{a, "alpha", "beta"}, {b, "beta", "alpha"}} {
		_, body := c.b.get("/binaries")
		if !strings.Contains(body, `"`+c.own+`"`) || strings.Contains(body, `"`+c.other+`"`) {
			t.Fatalf("GET /binaries of the %s broker: %s", c.own, body)
		}
		if e := c.b.claimErr(brokerclient.ClaimRequest{Binary: c.other}); e.Status != 400 {
			t.Fatalf("the %s broker claimed the other's entry %s: %v", c.own, c.other, e)
		}
	}
	claimA = a.claim(brokerclient.ClaimRequest{Binary: "alpha"})
	connA := a.dial(claimA, brokerclient.DialOptions{})
	if got := say(t, connA, "one"); got != "echo #1: one" {
		t.Fatalf("answer = %q", got)
	}
	claimB = b.claim(brokerclient.ClaimRequest{Binary: "beta"})
	pidsA := a.Instances()
	for i := range 2 {
		b.KillGateway(syscall.SIGKILL)
		b.StartGateway()
		if got, want := say(t, connA, fmt.Sprintf("through restart %d", i)), fmt.Sprintf("echo #%d: through restart %d", i+2, i); !strings.HasPrefix(got, want) {
			t.Fatalf("the first broker's client after the second's restart %d: %q", i, got)
		}
	}
	if after := a.Instances(); len(after) != len(pidsA) || after[0] != pidsA[0] {
		t.Fatalf("the first broker's instances were %v, now %v", pidsA, after)
	}
	if st, ok := a.lease(claimA.LeaseID); !ok || st.State != "active" {
		t.Fatalf("the first broker's lease after the second's restarts: %+v %v", st, ok)
	}
	b.waitStates([]string{claimB.LeaseID}, "active", 20*time.Second)
	return claimA, claimB
}

// TestEditedConfigOnGatewayRestart: the operator edits broker.yaml and
// restarts the gateway, the spec's way to apply boot-only keys. spawnd is
// reloaded onto the edited file on attach, so the new registry is served
// at once, never the old one, and a lease live through the edit stays
// live; an edit spawnd cannot apply without a restart of its own
// (state_dir, listen_addr) refuses the gateway's start, naming it.
func TestEditedConfigOnGatewayRestart(t *testing.T) {
	b := startBroker(t, Options{})
	live := b.claim(brokerclient.ClaimRequest{})
	b.KillGateway(syscall.SIGTERM)
	orig, err := os.ReadFile(b.ConfigPath)
	if err != nil {
		t.Fatal(err)
	}
	writeConfig(t, b.Dir, string(orig)+fmt.Sprintf("  gamma:\n    path: %q\n", bin("nexus-echo")))
	b.StartGateway()
	b.GatewayLog.wait(t, regexp.MustCompile(`nexus-spawnd reloaded onto the edited config`), 10*time.Second)
	if _, body := b.get("/binaries"); !strings.Contains(body, `"gamma"`) {
		t.Fatalf("GET /binaries after the edit: %s", body)
	}
	b.waitStates([]string{live.LeaseID}, "active", 20*time.Second)
	if got := say(t, b.dial(live, brokerclient.DialOptions{}), "still here"); got != "echo #1: still here" {
		t.Fatalf("the lease live through the edit answers %q", got)
	}
	claim := b.claim(brokerclient.ClaimRequest{Binary: "gamma"})
	if got := say(t, b.dial(claim, brokerclient.DialOptions{}), "hi"); got != "echo #1: hi" {
		t.Fatalf("answer = %q", got)
	}
	b.KillGateway(syscall.SIGTERM)

	// spawnd builds every dial-back address from its boot listen_addr: a
	// gateway moved to another port must not attach to it either.
	edited, _ := os.ReadFile(b.ConfigPath)
	moved := regexp.MustCompile(`listen_addr: "127\.0\.0\.1:\d+"`).ReplaceAllString(string(edited), fmt.Sprintf(`listen_addr: "127.0.0.1:%d"`, freePort(t)))
	for key, text := range map[string]string{
		"state_dir":   string(edited) + fmt.Sprintf("state_dir: %q\n", filepath.Join(b.Dir, "state")),
		"listen_addr": moved,
	} {
		writeConfig(t, b.Dir, text)
		code, out := runToExit(t, b.env, "nexus-broker", "-config", b.ConfigPath, "-launch-spawnd=false")
		if code == 0 || !strings.Contains(out, key+", which nexus-spawnd reads only at boot") {
			t.Fatalf("a gateway whose edit changed %s: exit %d, output:\n%s", key, code, out)
		}
		if strings.Contains(out, "nexus-broker listening") {
			t.Errorf("the gateway refused over %s listened:\n%s", key, out)
		}
	}
}

// TestReattachAfterSIGHUP: a gateway that reloaded on SIGHUP re-attaches
// to a restarted spawnd, which runs the version the gateway reloaded (not
// the one it booted with); and one whose file was edited again without a
// SIGHUP re-attaches too, warning that the two run different versions,
// rather than retrying for ever.
func TestReattachAfterSIGHUP(t *testing.T) {
	b := startBroker(t, Options{StateDir: true})
	live := b.claim(brokerclient.ClaimRequest{})
	orig, err := os.ReadFile(b.ConfigPath)
	if err != nil {
		t.Fatal(err)
	}
	reattached := regexp.MustCompile(`msg="reattached to nexus-spawnd"`)
	for i, entry := range []string{"gamma", "delta"} {
		orig = append(orig, fmt.Sprintf("  %s:\n    path: %q\n", entry, bin("nexus-echo"))...)
		writeConfig(t, b.Dir, string(orig))
		if entry == "gamma" {
			if got := b.reload(t); got != "applied" {
				t.Fatalf("SIGHUP reload: %s", got)
			}
		}
		b.KillSpawnd(syscall.SIGKILL)
		b.StartSpawnd()
		eventually(t, 20*time.Second, func() string { return "the gateway did not reattach" }, func() bool {
			return b.GatewayLog.count(reattached) > i
		})
		if code, body := b.get("/readyz"); code != 200 {
			t.Fatalf("GET /readyz after spawnd's restart %d: %d %s", i, code, body)
		}
		b.waitStates([]string{live.LeaseID}, "active", 20*time.Second)
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="nexus-spawnd runs another version of the config file than this gateway`), 5*time.Second)
	if strings.Contains(b.GatewayLog.String(), "cannot switch to this one") {
		t.Errorf("a re-attach tried to switch spawnd back to an older version:\n%s", b.GatewayLog)
	}
	claim := b.claim(brokerclient.ClaimRequest{Binary: "gamma"})
	if got := say(t, b.dial(claim, brokerclient.DialOptions{}), "hi"); got != "echo #1: hi" {
		t.Fatalf("answer = %q", got)
	}
}

// TestAnotherConfigOnTheSameRunDirRefused: a gateway whose config file is
// not the one the spawnd of its run directory runs refuses to start, naming
// both paths, in launch mode as without it; it never serves that spawnd's
// registry.
func TestAnotherConfigOnTheSameRunDirRefused(t *testing.T) {
	b := startBroker(t, Options{})
	other := writeConfig(t, t.TempDir(), fmt.Sprintf("listen_addr: \"127.0.0.1:%d\"\nspawnd:\n  run_dir: %q\nbinaries:\n  nexus:\n    path: %q\n", freePort(t), b.RunDir, bin("nexus-echo")))
	for _, launch := range []string{"-launch-spawnd=false", "-launch-spawnd=true"} {
		code, out := runToExit(t, b.env, "nexus-broker", "-config", other, launch)
		if code == 0 || !strings.Contains(out, "runs "+b.ConfigPath+", this gateway "+other) {
			t.Fatalf("%s: a gateway on another config file: exit %d, output:\n%s", launch, code, out)
		}
		if strings.Contains(out, "nexus-broker listening") || strings.Contains(out, "launched nexus-spawnd") {
			t.Errorf("%s: the refused gateway listened or launched:\n%s", launch, out)
		}
	}
}

// TestLaunchedSpawndLifecycle: a spawnd launched by a gateway stays while it
// holds a lease, even with no gateway attached, and the lease reattaches
// when a gateway comes back; nexus-broker -stop releases every lease; with
// no lease and no gateway the spawnd exits on its own about 10 s later.
// Mostly waiting out those idle exits, it runs beside the other parallel
// tests (TestA2AKeepalive's 20 s wait) rather than adding to the suite.
func TestLaunchedSpawndLifecycle(t *testing.T) {
	t.Parallel()
	b := startBroker(t, Options{Launch: true})
	pid := b.launchedSpawnd()
	if pid <= 0 {
		t.Fatal("no launched spawnd published")
	}
	// What the launched spawnd said at boot reaches the gateway's log, and
	// one boot line says what is in force, entries as spawnd resolved them.
	// The registry line reads as the spec shows it.
	b.GatewayLog.wait(t, regexp.MustCompile(fmt.Sprintf(`level=INFO msg="binary registry entry" name=nexus path=%s resolved_path=%s spawn_env=HOME,LANG,NEXUS_BROKER_ADDR,NEXUS_BROKER_LEASE_ID,NEXUS_BROKER_SPAWN_SECRET,PATH,TZ spawnd_pid=%d\n`,
		regexp.QuoteMeta(bin("nexus-echo")), regexp.QuoteMeta(bin("nexus-echo")), pid)), 5*time.Second)
	if os.Geteuid() == 0 {
		b.GatewayLog.wait(t, regexp.MustCompile(fmt.Sprintf(`level=WARN msg="these entries have no run_as and nexus-spawnd runs as root[^"]*" entries=nexus spawnd_pid=%d\n`, pid)), 5*time.Second)
	}
	b.GatewayLog.wait(t, regexp.MustCompile(fmt.Sprintf(`msg="nexus-broker listening" .* entries="nexus=%s" .* state_dir="" run_dir=%s spawnd_pid=%d`,
		regexp.QuoteMeta(bin("nexus-echo")), regexp.QuoteMeta(b.RunDir), pid)), 5*time.Second)
	// Upstream's two boot lines, with its keys.
	b.GatewayLog.wait(t, regexp.MustCompile(`level=INFO msg="nexus-broker starting" listen_addr=127\.0\.0\.1:\d+ advertise_addr="" binaries=1 state_dir="" max_concurrent=\d+ idle_timeout=\S+ max_turn_duration=\S+ queue_wait_timeout=\S+ release_grace=\S+ ready_timeout=\S+ reattach_window=\S+ admin_scope=""\n`), time.Second)
	b.GatewayLog.wait(t, regexp.MustCompile(`level=INFO msg="http gateway listening" addr=`+regexp.QuoteMeta(b.Addr)+`\n`), time.Second)
	claim := b.claim(brokerclient.ClaimRequest{})
	b.KillGateway(syscall.SIGTERM)
	// Held for longer than the idle exit: a lease keeps spawnd up.
	held := time.Now().Add(spawnclient.LaunchedIdleExit + 3*time.Second)
	for time.Now().Before(held) {
		if !alive(pid) {
			t.Fatalf("the launched spawnd exited while it held a lease")
		}
		time.Sleep(100 * time.Millisecond) // watching for an exit that must not come
	}
	b.StartGateway()
	b.waitStates([]string{claim.LeaseID}, "active", 20*time.Second)
	conn := b.dial(claim, brokerclient.DialOptions{})
	if got := say(t, conn, "back"); got != "echo #1: back" {
		t.Fatalf("answer after the reattach = %q", got)
	}

	// An edit spawnd could apply only by restarting (state_dir) does not
	// keep -stop from releasing, nor is spawnd reloaded by it. The running
	// gateway takes the exit for the release it is, not a crash: its
	// client is told the lease closed.
	orig, _ := os.ReadFile(b.ConfigPath)
	writeConfig(t, b.Dir, string(orig)+fmt.Sprintf("state_dir: %q\n", filepath.Join(b.Dir, "state")))
	code, out := runToExit(t, b.env, "nexus-broker", "-stop", "-config", b.ConfigPath)
	if code != 0 || !strings.Contains(out, "released 1 of 1 leases") || strings.Contains(out, "reloaded") {
		t.Fatalf("nexus-broker -stop: exit %d, output:\n%s", code, out)
	}
	if code, text := closeCode(t, conn); code != 1001 || text != "lease closed" {
		t.Errorf("the client of a lease -stop released closed with %d %q, want 1001 \"lease closed\"", code, text)
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`level=INFO msg="lease released" lease_id=`+claim.LeaseID+` reason="manual release"`), 10*time.Second)
	if crash := regexp.MustCompile(`treating as crash" lease_id=` + claim.LeaseID); crash.MatchString(b.GatewayLog.String()) {
		t.Errorf("the gateway took -stop's release for a crash:\n%s", b.GatewayLog)
	}
	b.waitNoInstances(10 * time.Second)
	b.KillGateway(syscall.SIGTERM)
	stopped := time.Now()
	eventually(t, spawnclient.LaunchedIdleExit+10*time.Second, func() string { return "the launched spawnd is still running" }, func() bool { return !alive(pid) })
	if took := time.Since(stopped); took < spawnclient.LaunchedIdleExit-time.Second {
		t.Errorf("the launched spawnd exited %s after its gateway stopped, before the idle exit of %s", took, spawnclient.LaunchedIdleExit)
	}
	// make stop again, with nothing left running: not an error.
	code, out = runToExit(t, b.env, "nexus-broker", "-stop", "-config", b.ConfigPath)
	if code != 0 || !strings.Contains(out, "nothing to stop: no nexus-spawnd is running for "+b.ConfigPath) {
		t.Errorf("nexus-broker -stop with no spawnd: exit %d, output:\n%s", code, out)
	}
}

// TestExitBeforeReadyIsExplained: an instance that exits before it is ready
// has the gateway log name the lease, the exit status, the instance's log
// and the end of its output, quoted: a line the instance printed cannot
// pose as one of the gateway's. The 502 body stays as the spec words it.
func TestExitBeforeReadyIsExplained(t *testing.T) {
	script := filepath.Join(sockdir.New(t, "nxs"), "broken-nexus")
	if err := os.WriteFile(script, []byte("#!/bin/sh\necho 'fatal: no model configured'\nprintf 'time=x level=ERROR msg=forged\\n' >&2\nexit 3\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(filepath.Dir(script), 0o755); err != nil {
		t.Fatal(err)
	}
	b := startBroker(t, Options{StateDir: true, YAML: fmt.Sprintf("  broken:\n    path: %q\n", script)})
	e := b.claimErr(brokerclient.ClaimRequest{Binary: "broken", Config: "engine:\n  name: example\n"})
	if e.Status != 502 || e.Message != "instance exited before signalling ready" {
		t.Fatalf("claim of an entry that exits at once = %d %q", e.Status, e.Message)
	}
	m := b.GatewayLog.wait(t, regexp.MustCompile(`level=ERROR msg="instance exited before signalling ready" lease_id=(\S+) exit_code=3 signal="" log=(\S+) output_tail="([^"]*)`), 10*time.Second)
	if !strings.HasSuffix(m[2], m[1]+".log") || !strings.Contains(m[3], "fatal: no model configured") {
		t.Errorf("the log line's lease, log path or tail: %q", m[0])
	}
	for _, line := range strings.Split(b.GatewayLog.String(), "\n") {
		if strings.HasPrefix(line, "time=x") {
			t.Errorf("the instance's output forged a gateway log line: %q", line)
		}
	}
}

// TestNothingLeftInTMPDIR: without a state_dir, an instance's log goes with
// its lease, and a spawnd that stops with no lease removes its temp
// directory: nothing is left in TMPDIR.
func TestNothingLeftInTMPDIR(t *testing.T) {
	b := startBroker(t, Options{})
	c := b.claim(brokerclient.ClaimRequest{})
	say(t, b.dial(c, brokerclient.DialOptions{}), "hi")
	logs, _ := filepath.Glob(filepath.Join(b.Tmp, "nexus-spawnd-*", "logs", "*.log"))
	if len(logs) != 1 {
		t.Fatalf("instance logs while the lease lives: %v", logs)
	}
	if code, _ := b.do("POST", "/release/"+c.LeaseID, ""); code != 200 {
		t.Fatal("release")
	}
	b.waitNoInstances(10 * time.Second)
	eventually(t, 5*time.Second, func() string {
		l, _ := filepath.Glob(filepath.Join(b.Tmp, "nexus-spawnd-*", "logs", "*"))
		return fmt.Sprint(l)
	},
		func() bool {
			l, _ := filepath.Glob(filepath.Join(b.Tmp, "nexus-spawnd-*", "logs", "*"))
			return len(l) == 0
		})
	b.KillSpawnd(syscall.SIGTERM)
	if left, _ := os.ReadDir(b.Tmp); len(left) != 0 {
		t.Errorf("spawnd left %d entries in TMPDIR, the first %s", len(left), left[0].Name())
	}
}

// TestNoStateDirWarnedOncePerLog: without a state_dir, a gateway that
// launched its spawnd says so once, in upstream's words (spawnd's own WARN
// stays in spawnd.log, not relayed); run separately, as under systemd, each
// process says it in its own log.
func TestNoStateDirWarnedOncePerLog(t *testing.T) {
	gatewayWarn := regexp.MustCompile(`level=WARN msg="state_dir is not set: lease state is in-memory only and a restart will lose track of every instance this broker spawned" restart=`)
	spawndWarn := regexp.MustCompile(`level=WARN msg="state_dir is not set: leases are kept in memory only`)
	anyWarn := regexp.MustCompile(`msg="state_dir is not set`)
	launched := startBroker(t, Options{Launch: true})
	if n := launched.GatewayLog.count(anyWarn); n != 1 || launched.GatewayLog.count(gatewayWarn) != 1 {
		t.Errorf("launch mode: the gateway's log has %d state_dir WARNs, want upstream's once:\n%s", n, launched.GatewayLog)
	}
	if log, _ := os.ReadFile(filepath.Join(launched.RunDir, spawnclient.LogFile)); len(spawndWarn.FindAll(log, -1)) != 1 {
		t.Errorf("launch mode: spawnd.log does not keep spawnd's own WARN once:\n%s", log)
	}
	split := startBroker(t, Options{})
	if n := split.GatewayLog.count(anyWarn); n != 1 || split.GatewayLog.count(gatewayWarn) != 1 {
		t.Errorf("split: the gateway's log has %d state_dir WARNs, want upstream's once:\n%s", n, split.GatewayLog)
	}
	if n := split.SpawndLog.count(anyWarn); n != 1 || split.SpawndLog.count(spawndWarn) != 1 {
		t.Errorf("split: spawnd's log has %d state_dir WARNs, want its own once:\n%s", n, split.SpawndLog)
	}
}

// TestShutdownLinesAreUpstreams: SIGTERM has the gateway log upstream's
// drain and stop lines, in that order, the stop line last, and exit 0; a
// listen_addr it cannot bind is upstream's "http gateway failed" record
// and exit status 1.
func TestShutdownLinesAreUpstreams(t *testing.T) {
	b := startBroker(t, Options{})
	b.KillGateway(syscall.SIGTERM)
	if code := b.gateway.cmd.ProcessState.ExitCode(); code != 0 {
		t.Errorf("SIGTERM: the gateway exited %d", code)
	}
	drain := regexp.MustCompile(`(?m)^time=\S+ level=INFO msg="shutdown signal received, draining" instances="keep running for the next gateway to reattach" release_them_with="nexus-broker -stop -config ` + regexp.QuoteMeta(b.ConfigPath) + `"\n(?:.*\n)*time=\S+ level=INFO msg="nexus-broker stopped"\n$`)
	if !drain.MatchString(b.GatewayLog.String()) {
		t.Errorf("SIGTERM: the log does not end with the drain line and, last, nexus-broker stopped:\n%s", b.GatewayLog)
	}

	text, err := os.ReadFile(b.ConfigPath)
	if err != nil {
		t.Fatal(err)
	}
	addr := regexp.MustCompile(`listen_addr: "([^"]+)"`).FindSubmatch(text)
	ln, err := net.Listen("tcp", string(addr[1]))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	code, out := runToExit(t, b.env, "nexus-broker", "-config", b.ConfigPath, "-launch-spawnd=false")
	failed := regexp.MustCompile(`(?m)^time=\S+ level=ERROR msg="http gateway failed" error="listen_addr \\"` + regexp.QuoteMeta(string(addr[1])) + `\\": listen tcp ` + regexp.QuoteMeta(string(addr[1])) + `: bind: address already in use"\n$`)
	if code != 1 || !failed.MatchString(out) {
		t.Errorf("a taken listen_addr: exit %d, and the log does not end with upstream's http gateway failed record:\n%s", code, out)
	}
}
