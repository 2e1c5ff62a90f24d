package e2e

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nexus-broker/nexus-broker/internal/echo"
	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// nobody is the run_as uid and gid the containment tests drop to.
const nobody = 65534

// requireRoot skips a test that must start a privileged nexus-spawnd.
func requireRoot(t *testing.T) {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("needs a root nexus-spawnd (run_as, a planted terminal); CI runs as root")
	}
}

// nobodyHome is a fresh HOME owned by nobody, outside the test's 0700
// temp directory so that nobody can reach it.
func nobodyHome(t *testing.T) string {
	t.Helper()
	home, err := os.MkdirTemp("", "nexus-e2e-nobody-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(home) })
	if err := os.Chown(home, nobody, nobody); err != nil {
		t.Fatal(err)
	}
	return home
}

// runEntry is a broker.yaml binaries entry of nexus-echo that serves /run
// as nobody, with extra lines (indented four spaces) appended.
func runEntry(name, home, extra string) string {
	return fmt.Sprintf("  %s:\n    path: %q\n    run_as: {uid: %d, gid: %d}\n    env:\n      HOME: %q\n      %s: \"1\"\n%s",
		name, bin("nexus-echo"), nobody, nobody, home, echo.EnvAllowRun, extra)
}

// instancePid claims binary and asks the instance for its own pid (the
// parent of the shell /run starts). The test's cleanup kills that instance's
// session should the test fail before releasing it.
func instancePid(t *testing.T, b *Broker, binary string) (*brokerclient.Claim, *brokerclient.Conn, int) {
	t.Helper()
	claim := b.claim(brokerclient.ClaimRequest{Binary: binary})
	conn := b.dial(claim, brokerclient.DialOptions{})
	answer := say(t, conn, "/run echo $PPID")
	pid, err := strconv.Atoi(answer)
	if err != nil {
		t.Fatalf("/run echo $PPID answered %q", answer)
	}
	t.Cleanup(func() { _ = syscall.Kill(-pid, syscall.SIGKILL) })
	return claim, conn, pid
}

// statField is field n (1-based, as proc(5) numbers them) of /proc/pid/stat.
func statField(t *testing.T, pid, n int) int {
	t.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(string(data[bytes.LastIndexByte(data, ')')+1:]))
	v, err := strconv.Atoi(f[n-3])
	if err != nil {
		t.Fatalf("/proc/%d/stat field %d: %v", pid, n, err)
	}
	return v
}

// fdTargets maps each of pid's descriptors to what it refers to.
func fdTargets(t *testing.T, pid int) map[int]string {
	t.Helper()
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	fds, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	out := map[int]string{}
	for _, fd := range fds {
		n, _ := strconv.Atoi(fd.Name())
		out[n], _ = os.Readlink(filepath.Join(dir, fd.Name()))
	}
	return out
}

// openPTY opens a pseudo-terminal pair; both ends are closed at cleanup,
// after the broker's (cleanups run last-in first-out).
func openPTY(t *testing.T) (master, slave *os.File) {
	t.Helper()
	master, err := os.OpenFile("/dev/ptmx", os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Skipf("no pseudo-terminal to give nexus-spawnd: %v", err)
	}
	t.Cleanup(func() { master.Close() })
	if err := unix.IoctlSetPointerInt(int(master.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		t.Fatal(err)
	}
	n, err := unix.IoctlGetInt(int(master.Fd()), unix.TIOCGPTN)
	if err != nil {
		t.Fatal(err)
	}
	slave, err = os.OpenFile("/dev/pts/"+strconv.Itoa(n), os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { slave.Close() })
	// Drain what spawnd might echo, so a full terminal never blocks it.
	go func() { _, _ = io.Copy(io.Discard, master) }()
	return master, slave
}

// TestInstanceHasNoTerminalAndNoStrayDescriptors: nexus-spawnd runs with a
// pseudo-terminal as its controlling terminal and an inherited descriptor
// to a root-only file. Its run_as instance leads a session of its own with
// no controlling terminal (so no TIOCSTI into the operator's shell), has
// /dev/null as stdin and holds neither the planted descriptor nor any socket
// or pipe of spawnd's.
func TestInstanceHasNoTerminalAndNoStrayDescriptors(t *testing.T) {
	requireRoot(t)
	_, tty := openPTY(t)
	secretPath := filepath.Join(t.TempDir(), "root-only")
	if err := os.WriteFile(secretPath, []byte("root's secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	secret, err := os.Open(secretPath)
	if err != nil {
		t.Fatal(err)
	}
	defer secret.Close()
	b := startBroker(t, Options{
		NoNexusEntry:     true,
		YAML:             "binaries:\n" + runEntry("nexus", nobodyHome(t), ""),
		SpawndStdin:      tty,
		SpawndAttr:       &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0},
		SpawndExtraFiles: []*os.File{secret},
	})
	spawndPid := b.spawnd.cmd.Process.Pid
	if statField(t, spawndPid, 7) == 0 {
		t.Fatal("the test did not give nexus-spawnd a controlling terminal")
	}
	if target, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/3", spawndPid)); target != secretPath {
		t.Fatalf("nexus-spawnd's fd 3 is %q, want the planted %s", target, secretPath)
	}

	claim, _, pid := instancePid(t, b, "nexus")
	if tty := statField(t, pid, 7); tty != 0 {
		t.Errorf("instance %d has controlling terminal %#x (tty_nr), want none", pid, tty)
	}
	if sid := statField(t, pid, 6); sid != pid {
		t.Errorf("instance %d is in session %d, want its own", pid, sid)
	}
	held := map[string]bool{} // spawnd's sockets and pipes, unique by inode
	for _, target := range fdTargets(t, spawndPid) {
		if strings.HasPrefix(target, "socket:") || strings.HasPrefix(target, "pipe:") {
			held[target] = true
		}
	}
	for n, target := range fdTargets(t, pid) {
		switch {
		case n == 0 && target != os.DevNull:
			t.Errorf("instance stdin is %q, want %s", target, os.DevNull)
		case n > 2 && (target == secretPath || held[target]):
			t.Errorf("instance holds fd %d → %q, which nexus-spawnd holds", n, target)
		}
	}
	if status, _ := b.do("POST", "/release/"+claim.LeaseID, ""); status != 200 {
		t.Fatalf("release = %d", status)
	}
	eventually(t, 15*time.Second, func() string { return fmt.Sprintf("instance %d gone after release", pid) }, func() bool { return !alive(pid) })
}

// TestInstanceSessionFollowsSpawndsTerminal: an instance of spawnd's own
// uid leads a session of its own only where spawnd has a controlling
// terminal it could otherwise reach; where spawnd has none it leads its own
// process group in spawnd's session, which no process in it can give a
// terminal, and boots without being a scheduling group of its own. Either
// way it has no controlling terminal. (A run_as instance always leads its
// own session: TestInstanceHasNoTerminalAndNoStrayDescriptors.)
func TestInstanceSessionFollowsSpawndsTerminal(t *testing.T) {
	for _, terminal := range []bool{false, true} {
		t.Run(fmt.Sprintf("terminal=%v", terminal), func(t *testing.T) {
			o := Options{NoNexusEntry: true, SpawndAttr: &syscall.SysProcAttr{Setsid: true},
				YAML: fmt.Sprintf("binaries:\n  nexus:\n    path: %q\n    env: {%s: \"1\"}\n", bin("nexus-echo"), echo.EnvAllowRun)}
			if terminal {
				_, tty := openPTY(t)
				o.SpawndStdin, o.SpawndAttr = tty, &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}
			}
			b := startBroker(t, o)
			spawnd := b.spawnd.cmd.Process.Pid
			if got := statField(t, spawnd, 7) != 0; got != terminal {
				t.Fatalf("nexus-spawnd has a controlling terminal: %v, want %v", got, terminal)
			}
			_, _, pid := instancePid(t, b, "nexus")
			wantSid := spawnd
			if terminal {
				wantSid = pid
			}
			if tty, pgid, sid := statField(t, pid, 7), statField(t, pid, 5), statField(t, pid, 6); tty != 0 || pgid != pid || sid != wantSid {
				t.Errorf("instance %d: tty_nr %#x, process group %d, session %d; want no terminal, its own group, session %d", pid, tty, pgid, sid, wantSid)
			}
		})
	}
}

// TestSetuidHelperGainsNothing: an instance that runs a root setuid binary
// stays nobody, because it starts with no_new_privs; the entry that opts out
// with allow_privilege_escalation gets root from the same binary, which is
// what proves the binary would have lifted it.
func TestSetuidHelperGainsNothing(t *testing.T) {
	requireRoot(t)
	setpriv, err := exec.LookPath("setpriv")
	if err != nil {
		t.Skip("needs setpriv to check that the filesystem honours setuid")
	}
	dir, err := os.MkdirTemp("", "nexus-e2e-setuid-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	helper := filepath.Join(dir, "id")
	idBin, err := os.ReadFile("/usr/bin/id")
	if err != nil {
		t.Skipf("needs /usr/bin/id as the setuid helper: %v", err)
	}
	if err := os.WriteFile(helper, idBin, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, err := range []error{os.Chmod(dir, 0o755), os.Chmod(helper, os.ModeSetuid|0o755)} {
		if err != nil {
			t.Fatal(err)
		}
	}
	out, err := exec.Command(setpriv, "--reuid", "65534", "--regid", "65534", "--clear-groups", helper, "-u").Output()
	if err != nil || strings.TrimSpace(string(out)) != "0" {
		t.Skipf("%s run as nobody outside the broker gives euid %q (%v), not 0: the filesystem of TMPDIR ignores setuid", helper, out, err)
	}

	home := nobodyHome(t)
	b := startBroker(t, Options{
		NoNexusEntry: true,
		YAML:         "binaries:\n" + runEntry("nexus", home, "") + runEntry("escalating", home, "    allow_privilege_escalation: true\n"),
	})
	for entry, want := range map[string]string{"nexus": "65534", "escalating": "0"} {
		claim, conn, pid := instancePid(t, b, entry)
		if got := say(t, conn, "/run "+helper+" -u"); got != want {
			t.Errorf("entry %s: the setuid helper ran with euid %q, want %s", entry, got, want)
		}
		status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
		if nnp := entry == "nexus"; err != nil || bytes.Contains(status, []byte("NoNewPrivs:\t1\n")) != nnp {
			t.Errorf("entry %s: instance %d NoNewPrivs is not %v (%v)", entry, pid, nnp, err)
		}
		if code, _ := b.do("POST", "/release/"+claim.LeaseID, ""); code != 200 {
			t.Fatalf("release = %d", code)
		}
	}
}
