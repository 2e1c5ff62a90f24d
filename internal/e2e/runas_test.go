package e2e

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"syscall"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/sockdir"
	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

func TestRunAsDropsToTheEntrysCredential(t *testing.T) {
	requireRoot(t)
	home := nobodyHome(t)
	b := startBroker(t, Options{NoNexusEntry: true, YAML: fmt.Sprintf(`binaries:
  nexus:
    path: %[1]q
  nobody:
    path: %[1]q
    run_as: {uid: 65534, gid: 65534}
    env:
      HOME: %[2]q
  nobody-passwd-home:
    path: %[1]q
    run_as: {uid: 65534, gid: 65534}
`, bin("nexus-echo"), home)})

	claim := b.claim(brokerclient.ClaimRequest{Binary: "nobody"})
	conn := b.dial(claim, brokerclient.DialOptions{})
	want := fmt.Sprintf("uid=65534 gid=65534 groups= home=%s cwd=%s", home, home)
	if got := say(t, conn, "/id"); got != want {
		t.Fatalf("/id = %q\nwant %q", got, want)
	}
	if got := say(t, conn, "hi"); got != "echo #2: hi (earlier: /id)" {
		t.Fatalf("answer = %q", got)
	}
	sessionDir := filepath.Join(home, ".nexus", "sessions", claim.SessionID)
	st, err := os.Stat(sessionDir)
	if err != nil {
		t.Fatalf("the session did not persist under the run_as HOME: %v", err)
	}
	if sys := st.Sys().(*syscall.Stat_t); sys.Uid != 65534 || sys.Gid != 65534 {
		t.Fatalf("session dir owned by %d:%d", sys.Uid, sys.Gid)
	}
	if status, _ := b.do("POST", "/release/"+claim.LeaseID, ""); status != 200 {
		t.Fatalf("release = %d", status)
	}
	b.waitNoInstances(15 * time.Second)

	// Without env.HOME the spawn gets the passwd database's home for 65534.
	b.SpawndLog.wait(t, regexp.MustCompile(`msg="binary registry entry" name=nobody-passwd-home .*run_as=65534:65534 run_as_home=(/\S*)`), time.Second)
	want65534 := passwdHome(t, 65534)
	m := b.SpawndLog.wait(t, regexp.MustCompile(`name=nobody-passwd-home .*run_as_home=(\S+)`), time.Second)
	if m[1] != want65534 {
		t.Fatalf("run_as_home = %q, want the passwd home %q", m[1], want65534)
	}
	// That home (/nonexistent on Debian) is not writable, so the instance
	// cannot create its session directory and never becomes ready: the
	// failure the spec describes for HOME not following the credential.
	if want65534 == "/nonexistent" {
		_, err := b.Client.Claim(context.Background(), brokerclient.ClaimRequest{Config: "a: 1", Binary: "nobody-passwd-home"})
		var ae *brokerclient.APIError
		if !errors.As(err, &ae) || ae.Status != 502 {
			t.Fatalf("claim under an unwritable passwd home = %v, want 502", err)
		}
	}
}

// passwdHome reads uid's home directory from /etc/passwd.
func passwdHome(t *testing.T, uid int) string {
	t.Helper()
	data, err := os.ReadFile("/etc/passwd")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(fmt.Sprintf(`(?m)^[^:]*:[^:]*:%d:[^:]*:[^:]*:([^:]*):`, uid)).FindSubmatch(data)
	if m == nil {
		t.Fatalf("uid %d not in /etc/passwd", uid)
	}
	return string(m[1])
}

// TestRunAsWithoutPrivilegeFailsTheClaimAtOnce: a spawnd that cannot set a
// child's credentials says so once at boot, and a claim of a run_as entry
// answers 500 spawning instance at once instead of hanging to ready_timeout.
func TestRunAsWithoutPrivilegeFailsTheClaimAtOnce(t *testing.T) {
	setpriv, err := exec.LookPath("setpriv")
	if os.Getuid() != 0 || err != nil {
		t.Skip("needs root and setpriv to start a spawnd without CAP_SETUID/CAP_SETGID")
	}
	b := startBroker(t, Options{
		SpawndWrapper: []string{setpriv, "--bounding-set=-setuid,-setgid", "--"},
		NoNexusEntry:  true,
		YAML:          fmt.Sprintf("binaries:\n  nexus:\n    path: %[1]q\n  nobody:\n    path: %[1]q\n    run_as: {uid: 65534, gid: 65534}\n", bin("nexus-echo")),
	})
	warn := regexp.MustCompile(`level=WARN msg="run_as is configured but nexus-spawnd lacks CAP_SETUID and CAP_SETGID`)
	b.SpawndLog.wait(t, warn, 5*time.Second)
	start := time.Now()
	e := b.claimErr(brokerclient.ClaimRequest{Binary: "nobody"})
	if e.Status != 500 || e.Message != "spawning instance" {
		t.Fatalf("claim of a run_as entry = %d %q, want 500 spawning instance", e.Status, e.Message)
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="claim failed" status=500 reason="spawning instance" error="Spawn: entry \\"nobody\\" runs as 65534:65534, and nexus-spawnd lacks CAP_SETUID and CAP_SETGID"`), 5*time.Second)
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("the refusal took %s; it must not wait for ready_timeout", d)
	}
	b.SpawndLog.wait(t, regexp.MustCompile(`level=ERROR msg="spawning instance refused: run_as needs CAP_SETUID and CAP_SETGID[^"]*".*run_as=65534:65534`), 5*time.Second)
	if n := b.SpawndLog.count(warn); n != 1 {
		t.Fatalf("the boot WARN appeared %d times, want once", n)
	}
	// Entries without run_as still spawn.
	b.claim(brokerclient.ClaimRequest{})
}

// TestRunAsOnANonRootSpawndIsUpstreamsWARN: a nexus-spawnd that does not
// run as root, with run_as entries, says so at boot in upstream's words
// and keys (euid), naming the entries.
func TestRunAsOnANonRootSpawndIsUpstreamsWARN(t *testing.T) {
	setpriv, err := exec.LookPath("setpriv")
	if os.Getuid() != 0 || err != nil {
		t.Skip("needs root and setpriv to start nexus-spawnd as another user")
	}
	dir := sockdir.New(t, "nxu")
	if err := os.Chown(dir, nobody, nobody); err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "broker.yaml")
	yaml := fmt.Sprintf("listen_addr: \"127.0.0.1:%d\"\nspawnd:\n  run_dir: %q\nbinaries:\n  nexus:\n    path: %q\n    run_as: {uid: 65533, gid: 65533}\n    env: {HOME: /}\n",
		freePort(t), filepath.Join(dir, "run"), bin("nexus-echo"))
	if err := os.WriteFile(cfg, []byte(yaml), 0o644); err != nil {
		t.Fatal(err)
	}
	tmp := filepath.Join(dir, "tmp")
	if err := os.Mkdir(tmp, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(tmp, nobody, nobody); err != nil {
		t.Fatal(err)
	}
	log := newLogBuffer()
	cmd := exec.Command(setpriv, "--reuid", fmt.Sprint(nobody), "--regid", fmt.Sprint(nobody), "--clear-groups", "--", bin("nexus-spawnd"), "-config", cfg)
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + dir, "TMPDIR=" + tmp}
	cmd.Stdout, cmd.Stderr = log, log
	p := startProc(t, cmd)
	defer p.signal(syscall.SIGTERM)
	log.wait(t, regexp.MustCompile(`level=WARN msg="run_as is configured but this broker does not run as root, so it cannot set a spawned instance's credentials at all — every claim selecting such an entry will fail to spawn\. `+
		`Run the broker as root \(or grant it CAP_SETUID and CAP_SETGID\) or remove run_as" euid=65534 entries=nexus\n`), 10*time.Second)
}
