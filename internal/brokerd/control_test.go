package brokerd

import (
	"bufio"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
)

// controlHelperEnv makes the test binary a control socket client (the
// attacker, run as another uid): it sends a drain to the socket named and
// prints what came back.
const controlHelperEnv = "NEXUS_CONTROL_HELPER_SOCKET"

func TestMain(m *testing.M) {
	if sock := os.Getenv(controlHelperEnv); sock != "" {
		c, err := net.Dial("unix", sock)
		if err != nil {
			fmt.Println("dial:", err)
			os.Exit(0)
		}
		fmt.Fprintf(c, "%s\n", VerbDrain)
		answer, _ := io.ReadAll(c)
		fmt.Printf("answer: %s", answer)
		os.Exit(0)
	}
	os.Exit(m.Run())
}

var discard = slog.New(slog.NewTextHandler(io.Discard, nil))

func ask(t *testing.T, sock, verb string) string {
	t.Helper()
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "%s\n", verb)
	answer, _ := bufio.NewReader(c).ReadString('\n')
	return answer
}

// TestControlSocket: the control socket is 0600; its owner drains and
// undrains; another uid is refused by the mode and, were the mode wider,
// by SO_PEERCRED, and nothing is drained.
func TestControlSocket(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to act as uid 65534")
	}
	if _, err := exec.LookPath("setpriv"); err != nil {
		t.Skip("needs setpriv")
	}
	// Not under TMPDIR: uid 65534 must reach the socket, and its path
	// must fit the socket limit whatever TMPDIR is.
	dir, err := os.MkdirTemp("/tmp", "ctl-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	var draining atomic.Bool
	var calls atomic.Int32
	sock := filepath.Join(dir, ControlSocket)
	ctl, err := serveControl(sock, func(on bool) { calls.Add(1); draining.Store(on) }, discard)
	if err != nil {
		t.Fatal(err)
	}
	defer ctl.Close()
	if st, err := os.Stat(sock); err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("control socket: %v, %v; want mode 0600", st, err)
	}
	if a := ask(t, sock, VerbDrain); !strings.HasPrefix(a, answerOK+"draining") || !draining.Load() {
		t.Fatalf("drain answered %q, draining %v", a, draining.Load())
	}
	if a := ask(t, sock, VerbUndrain); !strings.HasPrefix(a, answerOK+"serving") || draining.Load() {
		t.Fatalf("undrain answered %q, draining %v", a, draining.Load())
	}
	if a := ask(t, sock, "reboot"); !strings.HasPrefix(a, answerError+"unknown verb") {
		t.Fatalf("an unknown verb answered %q", a)
	}
	// A copy of this test binary uid 65534 can run, whatever TMPDIR's mode.
	helper := filepath.Join(dir, "helper")
	exe, err := os.ReadFile(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(helper, exe, 0o755); err != nil {
		t.Fatal(err)
	}
	attack := func() string {
		cmd := exec.Command("setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", helper)
		cmd.Env = append(os.Environ(), controlHelperEnv+"="+sock)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("the helper as uid 65534: %v\n%s", err, out)
		}
		return string(out)
	}
	if out := attack(); !strings.Contains(out, "permission denied") {
		t.Fatalf("uid 65534 on the 0600 socket: %q, want permission denied", out)
	}
	if err := os.Chmod(sock, 0o666); err != nil {
		t.Fatal(err)
	}
	if out := attack(); !strings.Contains(out, "uid 65534 may not control this broker") {
		t.Fatalf("uid 65534 on a 0666 socket: %q, want refused by its peer credentials", out)
	}
	if calls.Load() != 2 || draining.Load() {
		t.Fatalf("after the attacks: %d verbs done, draining %v; want the owner's 2, not draining", calls.Load(), draining.Load())
	}
}

// TestControlFollowsConfig: nexus-broker -drain finds the control socket
// where the config's control_socket puts it (a directory of the gateway's
// own, not spawnd's run directory), and without the key in the run
// directory.
func TestControlFollowsConfig(t *testing.T) {
	// Short, whatever TMPDIR is: the socket path limit.
	dir, err := os.MkdirTemp("/tmp", "ctl-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	runDir, own := filepath.Join(dir, "run"), filepath.Join(dir, "gw")
	for _, d := range []string{runDir, own} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	var draining atomic.Bool
	drain := func(on bool) { draining.Store(on) }
	write := func(yaml string) Options {
		path := filepath.Join(dir, "broker.yaml")
		if err := os.WriteFile(path, []byte(fmt.Sprintf("spawnd:\n  run_dir: %q\n", runDir)+yaml), 0o600); err != nil {
			t.Fatal(err)
		}
		return Options{ConfigPath: path, Logger: discard}
	}

	configured := filepath.Join(own, "control.sock")
	o := write(fmt.Sprintf("control_socket: %q\n", configured))
	ctl, err := serveControl(configured, drain, discard)
	if err != nil {
		t.Fatal(err)
	}
	if err := Control(o, VerbDrain); err != nil || !draining.Load() {
		t.Fatalf("-drain with control_socket: %v, draining %v", err, draining.Load())
	}
	ctl.Close()
	if _, err := os.Lstat(configured); !os.IsNotExist(err) {
		t.Errorf("control_socket %s after Close: %v, want it removed", configured, err)
	}
	if err := Control(o, VerbUndrain); err == nil || !strings.Contains(err.Error(), configured) {
		t.Errorf("-undrain with no broker on control_socket: %v, want an error naming %s", err, configured)
	}

	o = write("")
	ctl, err = serveControl(filepath.Join(runDir, ControlSocket), drain, discard)
	if err != nil {
		t.Fatal(err)
	}
	defer ctl.Close()
	if err := Control(o, VerbUndrain); err != nil || draining.Load() {
		t.Fatalf("-undrain without control_socket: %v, draining %v", err, draining.Load())
	}
}
