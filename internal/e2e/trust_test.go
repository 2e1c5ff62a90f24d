package e2e

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/nexus-broker/nexus-broker/internal/sockdir"
	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// asNobody runs a command as uid and gid 65534 with no groups, as a local
// attacker would, failing the test if it fails.
func asNobody(t *testing.T, argv ...string) {
	t.Helper()
	setpriv, err := exec.LookPath("setpriv")
	if err != nil || os.Geteuid() != 0 {
		t.Skip("needs root and setpriv to act as another local user")
	}
	args := append([]string{"--reuid", fmt.Sprint(nobody), "--regid", fmt.Sprint(nobody), "--clear-groups", "--"}, argv...)
	if out, err := exec.Command(setpriv, args...).CombinedOutput(); err != nil {
		t.Fatalf("as uid %d: %v: %v\n%s", nobody, argv, err, out)
	}
}

// rootOnlyFile is a file only root may read or write, the target of the
// attacker's symlinks; untouched reports whether it still holds its text.
func rootOnlyFile(t *testing.T) (path string, untouched func() bool) {
	t.Helper()
	path = filepath.Join(t.TempDir(), "root-only")
	const text = "root's secret\n"
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	return path, func() bool {
		data, err := os.ReadFile(path)
		return err == nil && string(data) == text
	}
}

// unquoted is out with every quoted value of its log records unquoted, so
// a test can look for an error's own words (quotes included) in it.
func unquoted(out string) string {
	var b strings.Builder
	for rest := out; rest != ""; {
		i := strings.IndexByte(rest, '"')
		if i < 0 {
			b.WriteString(rest)
			break
		}
		b.WriteString(rest[:i])
		q, err := strconv.QuotedPrefix(rest[i:])
		if err != nil {
			b.WriteByte('"')
			rest = rest[i+1:]
			continue
		}
		v, _ := strconv.Unquote(q) // QuotedPrefix vouched for it
		b.WriteString(v)
		rest = rest[i+len(q):]
	}
	return b.String()
}

// refused checks that a boot failed, naming every phrase of want, and
// leaked nothing of the root-only file.
func refused(t *testing.T, what string, code int, out string, want ...string) {
	t.Helper()
	if code == 0 {
		t.Fatalf("%s: the boot went ahead:\n%s", what, out)
	}
	for _, w := range want {
		if !strings.Contains(unquoted(out), w) {
			t.Errorf("%s: refused, but does not say %q:\n%s", what, w, out)
		}
	}
	if strings.Contains(out, "root's secret") {
		t.Errorf("%s: the refusal printed the root-only file:\n%s", what, out)
	}
}

// TestPrecreatedDevDefaultsDirRefused: another local user creates the
// development defaults directory first and plants symlinks in it (the
// config, the run directory's locks and log, the state_dir lock). make run's
// gateway refuses it, naming its path, owner and mode, and nothing behind a
// symlink is read or written.
func TestPrecreatedDevDefaultsDirRefused(t *testing.T) {
	xdg := sockdir.New(t, "nxd")
	if err := os.Chmod(xdg, 0o1777); err != nil { // as shared as /tmp
		t.Fatal(err)
	}
	target, untouched := rootOnlyFile(t)
	dev := filepath.Join(xdg, "nexus-broker-dev")
	asNobody(t, "mkdir", "-m", "0777", dev, dev+"/run", dev+"/state")
	for _, l := range []string{"broker.yaml", "run/launch.lock", "run/spawnd.log", "state/state.lock"} {
		asNobody(t, "ln", "-s", target, filepath.Join(dev, l))
	}
	code, out := runToExit(t, []string{"XDG_RUNTIME_DIR=" + xdg}, "nexus-broker")
	refused(t, "pre-created development defaults", code, out, dev, fmt.Sprintf("owned by uid %d with mode 0777", nobody))
	if !untouched() {
		t.Error("the symlinks' root-only target was written")
	}
}

// TestPrecreatedRunDirBaseRefused: another local user creates the base of
// the default run directories first (/tmp/nexus-broker-<uid>, here under a
// shared $XDG_RUNTIME_DIR). A launching gateway refuses it, naming path,
// owner and mode, without sending the operator to start nexus-spawnd by
// hand (which would refuse it the same way), and puts nothing in it.
func TestPrecreatedRunDirBaseRefused(t *testing.T) {
	xdg := sockdir.New(t, "nxb")
	if err := os.Chmod(xdg, 0o1777); err != nil {
		t.Fatal(err)
	}
	base := filepath.Join(xdg, "nexus-broker")
	asNobody(t, "mkdir", "-m", "0777", base)
	cfg := writeConfig(t, t.TempDir(), fmt.Sprintf("listen_addr: \"127.0.0.1:%d\"\nbinaries:\n  nexus:\n    path: %q\n", freePort(t), bin("nexus-echo")))
	code, out := runToExit(t, []string{"XDG_RUNTIME_DIR=" + xdg}, "nexus-broker", "-config", cfg)
	refused(t, "pre-created run directory base", code, out, base, fmt.Sprintf("owned by uid %d with mode 0777", nobody))
	if strings.Contains(out, "yourself") {
		t.Errorf("the refusal sends the operator to start nexus-spawnd by hand:\n%s", out)
	}
	if left, _ := os.ReadDir(base); len(left) != 0 {
		t.Errorf("the gateway created %s in the untrusted base", left[0].Name())
	}
}

// TestPlantedFilesRefused: files an attacker planted in the broker's own
// directories while they were open to others (an operator's 0777
// state_dir, say) are refused at boot, naming path, owner and mode (or the
// symlink), and a symlink's target is never touched: the state_dir lock,
// the spawn-key and the lease journal for spawnd, launch.lock and
// spawnd.log for a launching gateway.
func TestPlantedFilesRefused(t *testing.T) {
	target, untouched := rootOnlyFile(t)
	for _, tc := range []struct {
		name  string
		plant func(t *testing.T, state, run string)
		want  []string
	}{
		{"symlinked state.lock", func(t *testing.T, state, _ string) {
			asNobody(t, "ln", "-s", target, filepath.Join(state, "state.lock"))
		}, []string{filepath.Join("state", "state.lock") + " is a symlink"}},
		{"foreign spawn-key", func(t *testing.T, state, _ string) {
			asNobody(t, "sh", "-c", "umask 077; head -c 32 /dev/zero > "+filepath.Join(state, "spawn-key"))
		}, []string{filepath.Join("state", "spawn-key"), fmt.Sprintf("owned by uid %d with mode 0600", nobody)}},
		{"foreign journal", func(t *testing.T, state, _ string) {
			asNobody(t, "sh", "-c", "umask 077; : > "+filepath.Join(state, "leases.jsonl"))
		}, []string{filepath.Join("state", "leases.jsonl"), fmt.Sprintf("owned by uid %d with mode 0600", nobody)}},
		{"symlinked launch.lock", func(t *testing.T, _, run string) {
			asNobody(t, "ln", "-s", target, filepath.Join(run, "launch.lock"))
		}, []string{filepath.Join("run", "launch.lock") + " is a symlink"}},
		{"symlinked spawnd.log", func(t *testing.T, _, run string) {
			asNobody(t, "ln", "-s", target, filepath.Join(run, "spawnd.log"))
		}, []string{filepath.Join("run", "spawnd.log") + " is a symlink"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			base := sockdir.New(t, "nxp")
			if err := os.Chmod(base, 0o755); err != nil {
				t.Fatal(err)
			}
			state, run := filepath.Join(base, "state"), filepath.Join(base, "run")
			for _, d := range []string{state, run} {
				if err := os.Mkdir(d, 0o777); err != nil {
					t.Fatal(err)
				}
				if err := os.Chmod(d, 0o777); err != nil {
					t.Fatal(err)
				}
			}
			tc.plant(t, state, run)
			cfg := writeConfig(t, t.TempDir(), fmt.Sprintf("listen_addr: \"127.0.0.1:%d\"\nstate_dir: %q\nspawnd:\n  run_dir: %q\nbinaries:\n  nexus:\n    path: %q\n",
				freePort(t), state, run, bin("nexus-echo")))
			code, out := runToExit(t, nil, "nexus-broker", "-config", cfg)
			refused(t, tc.name, code, out, tc.want...)
			if !untouched() {
				t.Error("the symlink's root-only target was written")
			}
			// The spawnd of an attempt that got as far as launching one.
			if ep, err := os.ReadFile(filepath.Join(run, "spawnd.json")); err == nil {
				t.Errorf("a spawnd published %s despite the planted file", ep)
			}
		})
	}
}

// TestAnotherUserCannotStopSpawndsLeases: a local user who writes a config
// naming the run directory of a spawnd it may not reach, and runs
// nexus-broker -stop with it, is told so (exit 1), never "nothing to
// stop", and the owner's lease lives on.
func TestAnotherUserCannotStopSpawndsLeases(t *testing.T) {
	setpriv, err := exec.LookPath("setpriv")
	if err != nil || os.Geteuid() != 0 {
		t.Skip("needs root and setpriv to act as another local user")
	}
	b := startBroker(t, Options{})
	claim := b.claim(brokerclient.ClaimRequest{})
	// Only the run directory's own mode keeps the user out.
	if err := os.Chmod(filepath.Dir(b.RunDir), 0o755); err != nil {
		t.Fatal(err)
	}
	dir := sockdir.New(t, "nxn")
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "broker.yaml")
	yaml := fmt.Sprintf("listen_addr: \"127.0.0.1:%d\"\nspawnd:\n  run_dir: %q\nbinaries:\n  nexus:\n    path: %q\n", freePort(t), b.RunDir, bin("nexus-echo"))
	if err := os.WriteFile(cfg, []byte(yaml), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(setpriv, "--reuid", fmt.Sprint(nobody), "--regid", fmt.Sprint(nobody), "--clear-groups", "--", bin("nexus-broker"), "-stop", "-config", cfg)
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + dir}
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 {
		t.Fatalf("nexus-broker -stop as uid %d: %v, want exit 1:\n%s", nobody, err, out)
	}
	want := regexp.MustCompile(`level=ERROR msg="failed to attach to nexus-spawnd" error="nexus-spawnd refused this connection: open ` + regexp.QuoteMeta(filepath.Join(b.RunDir, "spawnd.json")) +
		`: permission denied, so uid 65534 may not reach the nexus-spawnd of run directory ` + regexp.QuoteMeta(b.RunDir) + `; run as the user spawnd.gateway_uid names`)
	if !want.Match(out) || strings.Contains(string(out), "nothing to stop") {
		t.Fatalf("-stop by another user does not say it may not reach spawnd:\n%s", out)
	}
	if code, body := b.get("/leases"); code != 200 || !strings.Contains(body, claim.LeaseID) {
		t.Fatalf("the lease is gone after another user's -stop: %d %s", code, body)
	}
}

// TestDevDefaultsUnderAnotherUsersXDGRuntimeDirRefused: a root make run
// with the $XDG_RUNTIME_DIR of another uid (sudo -E, say) refuses it,
// naming it and its owner, as a pre-created directory under /tmp is
// refused, and writes nothing in it: its owner could swap the config
// spawnd reads.
func TestDevDefaultsUnderAnotherUsersXDGRuntimeDirRefused(t *testing.T) {
	requireRoot(t)
	xdg := filepath.Join(sockdir.New(t, "nxu"), "user")
	if err := os.Mkdir(xdg, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(xdg, nobody, nobody); err != nil { // /run/user/<uid> of another user
		t.Fatal(err)
	}
	code, out := runToExit(t, []string{"XDG_RUNTIME_DIR=" + xdg}, "nexus-broker")
	refused(t, "another uid's XDG_RUNTIME_DIR", code, out, "$XDG_RUNTIME_DIR: "+xdg, fmt.Sprintf("owned by uid %d with mode 0700", nobody))
	if left, _ := os.ReadDir(xdg); len(left) != 0 {
		t.Errorf("the gateway created %s in another uid's XDG_RUNTIME_DIR", left[0].Name())
	}
}
