package spawnd

import (
	"bytes"
	"os"
	"os/exec"
	"runtime"
	"syscall"
	"testing"
)

// nnpChildEnv makes this test binary the no_new_privs child of
// TestStartedWithNNPExecsOnTheCaller.
const nnpChildEnv = "SPAWND_TEST_NNP_CHILD"

// A spawnd started with no_new_privs (the deploy unit's NoNewPrivileges=yes)
// has it on every thread, so an exec that needs it runs where it is asked
// for; the instance starts with the flag.
func TestStartedWithNNPExecsOnTheCaller(t *testing.T) {
	if os.Getenv(nnpChildEnv) != "" {
		nnpChild(t)
		return
	}
	setpriv, err := exec.LookPath("setpriv")
	if err != nil {
		t.Skip("needs setpriv to start a process with no_new_privs")
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(setpriv, "--no-new-privs", self, "-test.run", "^TestStartedWithNNPExecsOnTheCaller$", "-test.v")
	cmd.Env = append(os.Environ(), nnpChildEnv+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil || !bytes.Contains(out, []byte("--- PASS: TestStartedWithNNPExecsOnTheCaller")) {
		t.Fatalf("the test under no_new_privs failed (%v):\n%s", err, out)
	}
}

func nnpChild(t *testing.T) {
	if !startedWithNNP {
		t.Fatal("started under setpriv --no-new-privs, yet startedWithNNP is false")
	}
	if got := childNNP(t, true); got != "NoNewPrivs:\t1\n" {
		t.Errorf("the child's status says %q, want no_new_privs set", got)
	}
}

// childNNP is the NoNewPrivs line of a child startProcess starts with
// noNewPrivs.
func childNNP(t *testing.T, noNewPrivs bool) string {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	null, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer null.Close()
	grep, err := exec.LookPath("grep")
	if err != nil {
		t.Skip("needs grep")
	}
	pid, err := startProcess([]string{grep, "^NoNewPrivs:", "/proc/self/status"}, &syscall.ProcAttr{
		Files: []uintptr{null.Fd(), w.Fd(), w.Fd()},
	}, noNewPrivs)
	w.Close()
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	_, _ = out.ReadFrom(r)
	if _, err := reap(pid); err != nil {
		t.Fatal(err)
	}
	return out.String()
}

// TestExecGetsTheFlagItAsksFor: an instance starts with no_new_privs
// exactly when asked, from a Spawn lane's thread (which has the flag) and
// from any other (which has not), in either case.
func TestExecGetsTheFlagItAsksFor(t *testing.T) {
	if startedWithNNP {
		t.Skip("every thread has no_new_privs")
	}
	for _, lane := range []bool{false, true} {
		for _, want := range []bool{false, true} {
			got := make(chan string, 1)
			go func() {
				if lane {
					runtime.LockOSThread() // never unlocked: the thread ends with this goroutine
					if err := SetNoNewPrivs(); err != nil {
						t.Error(err)
						got <- ""
						return
					}
				}
				got <- childNNP(t, want)
			}()
			wantLine := map[bool]string{false: "NoNewPrivs:\t0\n", true: "NoNewPrivs:\t1\n"}[want]
			if line := <-got; line != wantLine {
				t.Errorf("on a thread with the flag %v, asked for it %v: the child says %q", lane, want, line)
			}
		}
	}
}
