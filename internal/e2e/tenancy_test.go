package e2e

import (
	"context"
	"crypto/sha256"
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
	"syscall"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/echo"
	"github.com/nexus-broker/nexus-broker/internal/sockdir"
	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// tenancyLo starts this test process's block of uids (the lock on a range
// is host-wide: two runs on one host, or internal/spawnd's tests beside
// these, never share one).
var tenancyLo = 900000 + os.Getpid()%5000*100

// uidRange is from..to of this process's block.
func uidRange(from, to int) string { return fmt.Sprintf("%d-%d", tenancyLo+from, tenancyLo+to) }

// tenantHost is a broker with tenancy: whose directories are outside /tmp
// (which the sandbox hides): broker.yaml, state_dir and nexus-echo's copy
// under one 0755 directory of /var/tmp, with homes_dir beside them.
type tenantHost struct {
	*Broker
	root, echo, homes, world string
}

func startTenantHost(t testing.TB, sandbox, uidRange string) *tenantHost {
	t.Helper()
	return startTenantHostWith(t, sandbox, uidRange, func(h *tenantHost) string { return staticAuthYAML + h.echoEntry() })
}

// echoEntry is the nexus entry of the host's nexus-echo, its /run on.
func (h *tenantHost) echoEntry() string {
	return fmt.Sprintf("binaries:\n  nexus:\n    path: %q\n    env: {%s: \"1\"}\n", h.echo, echo.EnvAllowRun)
}

// startTenantHostWith is startTenantHost with the auth: and binaries:
// blocks yaml gives for the host (its directories made).
func startTenantHostWith(t testing.TB, sandbox, uidRange string, yaml func(h *tenantHost) string) *tenantHost {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("tenancy needs a root nexus-spawnd; CI runs as root")
	}
	root, err := os.MkdirTemp("/var/tmp", "nexus-e2e-tenancy-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(root) })
	h := &tenantHost{root: root, echo: filepath.Join(root, "bin", "nexus-echo"), homes: filepath.Join(root, "homes"), world: filepath.Join(root, "world")}
	for dir, mode := range map[string]os.FileMode{root: 0o755, filepath.Dir(h.echo): 0o755, h.world: 0o777, filepath.Join(root, "etc"): 0o700} {
		if err := os.MkdirAll(dir, mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(dir, mode); err != nil {
			t.Fatal(err)
		}
	}
	copyFile(t, bin("nexus-echo"), h.echo, 0o755)
	t.Cleanup(h.killInstances)
	h.Broker = startBroker(t, Options{
		Dir:          filepath.Join(root, "etc"),
		StateDir:     true,
		NoNexusEntry: true,
		Token:        tokOps,
		YAML:         yaml(h) + fmt.Sprintf("tenancy: {uid_range: %q, homes_dir: %q, sandbox: %s}\n", uidRange, h.homes, sandbox),
	})
	return h
}

func copyFile(t testing.TB, from, to string, mode os.FileMode) {
	t.Helper()
	src, err := os.Open(from)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	dst, err := os.OpenFile(to, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(dst, src); err != nil {
		t.Fatal(err)
	}
	if err := dst.Close(); err != nil {
		t.Fatal(err)
	}
}

// instances are the live processes of this host's nexus-echo copy.
func (h *tenantHost) instances() []int { return processesOf(h.echo, "") }

// killInstances kills the process group of every instance a failed test
// left (bwrap's, which leads it).
func (h *tenantHost) killInstances() { killGroupsOf(h.instances()) }

// tenant is one principal's claimed instance.
type tenant struct {
	claim *brokerclient.Claim
	conn  *brokerclient.Conn
	uid   int
}

func (h *tenantHost) claimAs(t *testing.T, token, session string) tenant {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c, err := h.as(token).Claim(ctx, brokerclient.ClaimRequest{Config: "engine:\n  name: example\n", SessionID: session})
	if err != nil {
		t.Fatalf("claim as %s: %v", token, err)
	}
	conn := h.dial(c, brokerclient.DialOptions{Token: token})
	uid, err := strconv.Atoi(say(t, conn, "/run id -u"))
	if err != nil {
		t.Fatal(err)
	}
	return tenant{c, conn, uid}
}

// hashOf is a file's content digest (a directory's: its files'), "" when
// unreadable.
func hashOf(path string) string {
	sum := sha256.New()
	err := filepath.WalkDir(path, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		data, err := os.ReadFile(p)
		fmt.Fprintf(sum, "%s %d\n", p, len(data))
		sum.Write(data)
		return err
	})
	if err != nil {
		return ""
	}
	return fmt.Sprintf("%x", sum.Sum(nil))
}

// TestTenantCannotReachAnother: with tenancy: and sandbox: strict, bob's
// instance (through nexus-echo's /run, standing in for an engine's shell
// tool) can read, write or signal nothing of alice's, of spawnd's or of
// the host's, and the host is checked as root to be unchanged; bob resuming
// alice's session gets what an unknown id gets; alice keeps her uid across
// claims and a kill -9 of spawnd.
func TestTenantCannotReachAnother(t *testing.T) {
	h := startTenantHost(t, "strict", uidRange(0, 9))
	alice := h.claimAs(t, tokAlice, "")
	session := alice.claim.SessionID
	aliceHome := filepath.Join(h.homes, strconv.Itoa(alice.uid))
	sessionFile := filepath.Join(aliceHome, ".nexus", "sessions", session)
	stateDir := filepath.Join(h.root, "etc", "state")
	say(t, alice.conn, "my secret is PINEAPPLE")

	// The positive control: what bob will try to reach is there.
	var st syscall.Stat_t
	if err := syscall.Stat(aliceHome, &st); err != nil || int(st.Uid) != alice.uid || st.Mode&0o7777 != 0o700 {
		t.Fatalf("alice's home %s: %v, uid %d mode %04o; want uid %d, 0700", aliceHome, err, st.Uid, st.Mode&0o7777, alice.uid)
	}
	if err := syscall.Stat(sessionFile, &st); err != nil || int(st.Uid) != alice.uid {
		t.Fatalf("alice's session %s: %v, uid %d; want it of uid %d", sessionFile, err, st.Uid, alice.uid)
	}
	alicePids := h.instances()
	if len(alicePids) != 1 {
		t.Fatalf("%d instances, want alice's alone", len(alicePids))
	}
	before := map[string]string{}
	configs, _ := filepath.Glob(filepath.Join(h.Tmp, "nexus-spawnd-*", alice.claim.LeaseID+".yaml"))
	if len(configs) != 1 {
		t.Fatalf("alice's temp config not found under %s", h.Tmp)
	}
	for _, p := range []string{sessionFile, filepath.Join(stateDir, "spawn-key"), configs[0]} {
		if before[p] = hashOf(p); before[p] == "" {
			t.Fatalf("%s is not readable as root", p)
		}
	}

	bob := h.claimAs(t, tokBob, "")
	if bob.uid == alice.uid || bob.uid < tenancyLo || bob.uid > tenancyLo+9 {
		t.Fatalf("bob runs as uid %d, alice as %d; want two uids of %s", bob.uid, alice.uid, uidRange(0, 9))
	}
	if got := say(t, bob.conn, "/run id -G"); got != strconv.Itoa(bob.uid) {
		t.Errorf("bob's groups are %q, want his own gid alone", got)
	}
	attacks := map[string]string{
		"list alice's home":           "ls " + aliceHome,
		"read alice's session":        "ls " + sessionFile,
		"list spawnd's state_dir":     "ls " + stateDir,
		"read the spawn-key":          "cat " + filepath.Join(stateDir, "spawn-key"),
		"write a world-writable dir":  "echo bob > " + filepath.Join(h.world, "bob"),
		"write the broker's config":   "echo bob >> " + h.ConfigPath,
		"write alice's session":       "echo bob > " + filepath.Join(sessionFile, "bob"),
		"read alice's temp config":    "cat " + configs[0],
		"read alice's environ":        fmt.Sprintf("cat /proc/%d/environ", alicePids[0]),
		"read alice's cmdline":        fmt.Sprintf("cat /proc/%d/cmdline", alicePids[0]),
		"signal alice's instance":     fmt.Sprintf("kill -TERM %d", alicePids[0]),
		"see another instance's argv": "cat /proc/*/cmdline | tr '\\0' ' ' | grep -c -- [" + alice.claim.LeaseID[:1] + "]" + alice.claim.LeaseID[1:],
	}
	for what, cmd := range attacks {
		if got := say(t, bob.conn, "/run "+cmd); !strings.HasPrefix(got, "run failed") {
			t.Errorf("%s (%s) from bob's instance answered %q, want a failure", what, cmd, got)
		}
	}
	// /dev/shm and /tmp are bob's own: a write there reaches nothing of
	// the host's.
	for _, dir := range []string{"/dev/shm", "/tmp"} {
		name := filepath.Join(dir, "nexus-e2e-bob-was-here")
		if got := say(t, bob.conn, "/run echo bob > "+name+" && echo ok"); got != "ok" {
			t.Errorf("bob's private %s is not writable: %q", dir, got)
		}
		if _, err := os.Lstat(name); err == nil {
			_ = os.Remove(name)
			t.Errorf("bob's write to his %s reached the host's %s", dir, name)
		}
	}

	// As root: nothing changed.
	for p, sum := range before {
		if hashOf(p) != sum {
			t.Errorf("%s changed under bob's attacks", p)
		}
	}
	if ents, _ := os.ReadDir(h.world); len(ents) != 0 {
		t.Errorf("the world-writable directory holds %v after bob's attacks", ents)
	}
	if err := syscall.Kill(alicePids[0], 0); err != nil {
		t.Errorf("alice's instance %d is gone after bob's attacks: %v", alicePids[0], err)
	}
	if got := say(t, alice.conn, "still there?"); !strings.Contains(got, "still there?") {
		t.Errorf("alice's instance answered %q after bob's attacks", got)
	}

	assertUnknownSession(t, h.Broker, session, func() int { return len(h.instances()) })

	// Alice's own resume, after a kill -9 of spawnd: her uid, her session.
	for token, id := range map[string]string{tokAlice: alice.claim.LeaseID, tokBob: bob.claim.LeaseID} {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		err := h.as(token).Release(ctx, id)
		cancel()
		if err != nil {
			t.Fatalf("release %s: %v", id, err)
		}
	}
	followed := regexp.MustCompile(`msg="following nexus-spawnd's instance exits"`)
	n := h.GatewayLog.count(followed)
	h.KillSpawnd(syscall.SIGKILL)
	h.StartSpawnd()
	h.GatewayLog.wait(t, regexp.MustCompile(fmt.Sprintf(`(?s)(msg="following nexus-spawnd's instance exits".*){%d}`, n+1)), time.Minute)
	again := h.claimAs(t, tokAlice, session)
	if again.uid != alice.uid {
		t.Errorf("after a kill -9 of nexus-spawnd alice runs as uid %d, before as %d", again.uid, alice.uid)
	}
	// Her fifth turn: the resumed session holds her four before.
	if got := say(t, again.conn, "what did I say?"); !strings.HasPrefix(got, "echo #5: ") {
		t.Errorf("alice's resume answered %q, want her own session's fifth turn", got)
	}
}

// TestTenantCannotSpoofTheProxy: with proxy_headers honoured on
// proxy_listen, bob's sandboxed instance binds 127.0.0.2 (or not) and sends
// the proxy's headers to the gateway's TCP listener, naming an admin (the
// admin view, a ticket for alice's lease), and tries the proxy's socket
// itself: every request is refused, and as root the gateway served and
// minted nothing for it. The control: the same headers through the socket
// are the admin view.
func TestTenantCannotSpoofTheProxy(t *testing.T) {
	var sock string
	h := startTenantHostWith(t, "strict", uidRange(30, 39), func(h *tenantHost) string {
		sock = filepath.Join(h.root, "proxy.sock")
		// Distinct prefixes, as tenancy: requires of two validators.
		return fmt.Sprintf("auth:\n  proxy_listen: %q\n  proxy_listen_group: adm\n  validators:\n"+
			"    - {type: proxy_headers, principal_prefix: \"proxy:\", principal_header: X-Forwarded-User, scopes_header: X-Forwarded-Scopes}\n", sock) +
			strings.Replace(strings.TrimPrefix(staticAuthYAML, "auth:\n  validators:\n"), "    - type: static\n", "    - type: static\n      principal_prefix: \"tok:\"\n", 1) +
			h.echoEntry()
	})
	alice := h.claimAs(t, tokAlice, "")
	bob := h.claimAs(t, tokBob, "")
	asAdmin := [][2]string{{"X-Forwarded-User", "ops"}, {"X-Forwarded-Scopes", "nexus.broker.admin"}}
	tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}
	defer tr.CloseIdleConnections()
	if status, body := sendWith(t, tr, "http://proxy/leases", asAdmin...); status != http.StatusOK || !strings.Contains(body, alice.claim.LeaseID) {
		t.Fatalf("the control: the admin through the proxy's socket = %d %s, want the admin view with alice's lease", status, body)
	}

	// The gateway's log is read through a pipe: wait for the control's
	// line before counting, and for the attacks' refusals after them.
	served := regexp.MustCompile(`msg="auth allowed" [^\n]*principal_id=proxy:`)
	h.GatewayLog.wait(t, served, 10*time.Second)
	const denied = `msg="auth denied" [^\n]*denial="proxy_headers: identity header from a peer outside trusted_proxy_cidrs"`
	minted := regexp.MustCompile(`msg="issued lease ticket"`)
	wasServed, wasMinted, wasDenied := h.GatewayLog.count(served), h.GatewayLog.count(minted), h.GatewayLog.count(regexp.MustCompile(denied))
	headers := "-H 'X-Forwarded-User: ops' -H 'X-Forwarded-Scopes: nexus.broker.admin' -H 'X-Forwarded-For: 127.0.0.2'"
	for what, cmd := range map[string]string{
		"the admin view from 127.0.0.2":        "curl -sS --interface 127.0.0.2 -w ' %{http_code}' " + headers + " " + h.Base + "/leases",
		"the admin view from 127.0.0.1":        "curl -sS -w ' %{http_code}' " + headers + " " + h.Base + "/leases",
		"a ticket for alice's lease":           "curl -sS --interface 127.0.0.2 -w ' %{http_code}' -X POST " + headers + " " + h.Base + "/ticket/" + alice.claim.LeaseID,
		"a ticket for alice's lease, as alice": "curl -sS --interface 127.0.0.2 -w ' %{http_code}' -X POST -H 'X-Forwarded-User: tok:alice' " + h.Base + "/ticket/" + alice.claim.LeaseID,
	} {
		if got, want := say(t, bob.conn, "/run "+cmd), bodyRejected+" 401"; got != want {
			t.Errorf("%s from bob's instance (%s) answered %q, want %q", what, cmd, got, want)
		}
	}
	if got := say(t, bob.conn, "/run curl -sS --unix-socket "+sock+" "+headers+" http://proxy/leases"); !strings.HasPrefix(got, "run failed") {
		t.Errorf("the proxy's socket from bob's instance answered %q, want a failure", got)
	} else {
		t.Logf("the proxy's socket from bob's instance: %s", got)
	}

	// As root: nothing was served to a proxy principal, nothing minted.
	h.GatewayLog.wait(t, regexp.MustCompile(fmt.Sprintf(`(?s)(%s.*){%d}`, denied, wasDenied+4)), 10*time.Second)
	if n := h.GatewayLog.count(served); n != wasServed {
		t.Errorf("the gateway served %d requests as a proxy principal during bob's attacks:\n%s", n-wasServed, h.GatewayLog)
	}
	if n := h.GatewayLog.count(minted); n != wasMinted {
		t.Errorf("the gateway minted %d tickets during bob's attacks", n-wasMinted)
	}
	if got := say(t, alice.conn, "still mine?"); !strings.Contains(got, "still mine?") {
		t.Errorf("alice's instance answered %q after bob's attacks", got)
	}
}

// TestTenancyRefusesNonRootSpawnd: a nexus-spawnd that is not root cannot
// give principals their uids, and says so at boot, naming the key.
func TestTenancyRefusesNonRootSpawnd(t *testing.T) {
	requireRoot(t)
	// A short directory: the refused spawnd's run directory (its socket
	// path) lives inside it whatever TMPDIR is.
	dir := sockdir.New(t, "nxt")
	cfg := filepath.Join(dir, "broker.yaml")
	yaml := fmt.Sprintf("state_dir: %q\nbinaries: {nexus: {path: %q}}\ntenancy: {uid_range: %q, homes_dir: %q, sandbox: none}\n",
		filepath.Join(dir, "state"), bin("nexus-echo"), uidRange(20, 29), filepath.Join(dir, "homes"))
	// The run directory is the test's, so the refused spawnd leaves nothing
	// under the default /tmp/nexus-broker-65534.
	runDir := filepath.Join(dir, "run")
	for _, err := range []error{os.WriteFile(cfg, []byte(yaml), 0o644), os.Chmod(dir, 0o755),
		os.Mkdir(runDir, 0o700), os.Chown(runDir, 65534, 65534)} {
		if err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", bin("nexus-spawnd"), "-config", cfg, "-run-dir", runDir).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "broker config: tenancy: nexus-spawnd runs as uid 65534, and tenancy needs root") {
		t.Fatalf("a non-root nexus-spawnd with tenancy: exited %v: %s", err, out)
	}
	if _, err := os.Lstat(filepath.Join(dir, "state")); err == nil {
		t.Error("the refused spawnd created its state_dir")
	}
}

// TestSandboxedReleaseSIGTERMReachesTheEngine: release's SIGTERM to the
// lease's process group reaches the engine inside bubblewrap (spawnd runs
// bwrap without --new-session, the engine a member of bwrap's group), and
// the engine has time to act on it: bwrap dies of the SIGTERM at once, and
// spawnd waits for the rest of the group (up to term_grace) before its
// SIGKILL. The instance ignores the shutdown frame and takes 300ms to stop
// on SIGTERM; its own log shows it got through that, and spawnd's log shows
// no SIGKILL.
func TestSandboxedReleaseSIGTERMReachesTheEngine(t *testing.T) {
	h := startTenantHostWith(t, "strict", uidRange(70, 79), func(h *tenantHost) string {
		return staticAuthYAML + "release_grace: 1s\n" + fmt.Sprintf("binaries:\n  nexus:\n    path: %q\n    env: {%s: \"1\", %s: \"1\", %s: \"300ms\"}\n",
			h.echo, echo.EnvAllowRun, echo.EnvIgnoreShutdownFrame, echo.EnvStopDelay)
	})
	alice := h.claimAs(t, tokAlice, "")
	id := alice.claim.LeaseID
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := h.as(tokAlice).Release(ctx, id); err != nil {
		t.Fatalf("release %s: %v", id, err)
	}
	m := h.SpawndLog.wait(t, regexp.MustCompile(`msg="instance exited" lease_id=`+id+` [^\n]*`), time.Minute)
	t.Logf("released: %s", m[0])
	if !strings.Contains(m[0], "signal=SIGTERM") {
		t.Errorf("the sandboxed instance's leader did not end on release's SIGTERM: %s", m[0])
	}
	if n := h.SpawndLog.count(regexp.MustCompile(`SIGKILL|did not exit within term_grace`)); n != 0 {
		t.Errorf("spawnd killed the sandboxed instance (%d log lines), so it had no time to stop on SIGTERM:\n%s", n, h.SpawndLog.String())
	}
	logPath := filepath.Join(h.root, "etc", "state", "logs", id+".log")
	data, err := os.ReadFile(logPath)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		`msg="ignoring shutdown frame" [^\n]*knob=` + echo.EnvIgnoreShutdownFrame,
		`msg="stopping on signal" [^\n]*signal=terminated`,
		`msg="stop delay passed" [^\n]*knob=` + echo.EnvStopDelay + ` delay=300ms`,
		`msg=stopped `,
	} {
		if !regexp.MustCompile(want).Match(data) {
			t.Errorf("the instance's log %s has no line matching %s:\n%s", logPath, want, data)
		}
	}
	if left := h.instances(); len(left) != 0 {
		t.Errorf("instance processes %v outlived their lease's exit", left)
	}
}

// TestSandboxedInstanceIgnoringSIGTERMIsKilled: spawnd's wait for the
// sandbox's processes after bwrap's exit is bounded: an engine that ignores
// SIGTERM (and the shutdown frame) is SIGKILLed term_grace after the
// SIGTERM, as an unsandboxed one is, and nothing of it is left.
func TestSandboxedInstanceIgnoringSIGTERMIsKilled(t *testing.T) {
	h := startTenantHostWith(t, "strict", uidRange(80, 89), func(h *tenantHost) string {
		return staticAuthYAML + "release_grace: 1s\n" + fmt.Sprintf("binaries:\n  nexus:\n    path: %q\n    env: {%s: \"1\", %s: \"1\"}\n",
			h.echo, echo.EnvAllowRun, echo.EnvIgnoreShutdown)
	})
	id := h.claimAs(t, tokAlice, "").claim.LeaseID
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := h.as(tokAlice).Release(ctx, id); err != nil {
		t.Fatalf("release %s: %v", id, err)
	}
	// Either spawnd's term_grace ran out with bwrap still there, or bwrap
	// died of the SIGTERM first and the sandbox's processes were killed
	// term_grace after its exit: both are the bounded kill.
	h.SpawndLog.wait(t, regexp.MustCompile(`msg="(instance did not exit after SIGTERM; sending SIGKILL to its process group|the sandboxed instance's processes did not exit within term_grace of bwrap's exit; killing them)" lease_id=`+id), time.Minute)
	m := h.SpawndLog.wait(t, regexp.MustCompile(`msg="instance exited" lease_id=`+id+` [^\n]*`), time.Minute)
	t.Logf("released: %s", m[0])
	data, err := os.ReadFile(filepath.Join(h.root, "etc", "state", "logs", id+".log"))
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`msg="ignoring SIGTERM" `).Match(data) {
		t.Errorf("the instance never saw release's SIGTERM:\n%s", data)
	}
	if left := h.instances(); len(left) != 0 {
		t.Errorf("instance processes %v outlived their lease's exit", left)
	}
}
