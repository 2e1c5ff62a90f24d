package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
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
)

// cgroupRoot creates a cgroup v2 directory of the test's own, to hand
// nexus-spawnd as spawnd.cgroup_root, and removes it with everything in it
// at cleanup (registered first, so it runs after the broker's). It skips
// the test where there is no writable cgroup v2 tree.
func cgroupRoot(t *testing.T) string {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("cgroup containment needs a root nexus-spawnd; CI runs as root")
	}
	mounts, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Skipf("no /proc/self/mountinfo: %v", err)
	}
	m := regexp.MustCompile(`(?m)^\S+ \S+ \S+ \S+ (\S+) .* - cgroup2 `).FindSubmatch(mounts)
	if m == nil {
		t.Skip("no cgroup v2 tree is mounted: cgroup containment cannot be tested here")
	}
	root, err := os.MkdirTemp(string(m[1]), "nexus-e2e-")
	if err != nil {
		t.Skipf("the cgroup v2 tree at %s is not writable: %v", m[1], err)
	}
	t.Cleanup(func() { removeCgroupTree(t, root) })
	return root
}

// removeCgroupTree kills every process under dir and removes it, leaves first.
func removeCgroupTree(t *testing.T, dir string) {
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if e.IsDir() {
			removeCgroupTree(t, filepath.Join(dir, e.Name()))
		}
	}
	_ = os.WriteFile(filepath.Join(dir, "cgroup.kill"), []byte("1"), 0)
	eventually(t, 10*time.Second, func() string { return "cgroup " + dir + " empty and removed at cleanup" }, func() bool {
		err := os.Remove(dir)
		return err == nil || errors.Is(err, fs.ErrNotExist)
	})
}

// inCgroup reports whether pid is a member of the cgroup at dir.
func inCgroup(dir string, pid int) bool {
	data, _ := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	return bytes.Contains(append([]byte("\n"), data...), []byte("\n"+strconv.Itoa(pid)+"\n"))
}

// cgroupBrokerID is the broker id of cgroupBroker's brokers.
const cgroupBrokerID = "e2e-cgroup"

// cgroupBroker starts a broker in cgroup mode under a fresh cgroup root,
// whose nexus entry serves /run as nobody; o adds to that.
func cgroupBroker(t *testing.T, o Options) (*Broker, string) {
	t.Helper()
	return cgroupBrokerWith(t, o, runEntry("nexus", nobodyHome(t), ""))
}

// cgroupBrokerWith is cgroupBroker with entry as its only binaries: entry.
func cgroupBrokerWith(t *testing.T, o Options, entry string) (*Broker, string) {
	t.Helper()
	root := cgroupRoot(t)
	o.NoNexusEntry = true
	o.SpawndYAML = fmt.Sprintf("  cgroup_root: %q\n", root)
	o.YAML += "broker_id: " + cgroupBrokerID + "\nbinaries:\n" + entry
	return startBroker(t, o), root
}

// escapees has the instance start a child that leaves its session (setsid)
// and one that leaves its parent (a double fork), and returns their pids.
func escapees(t *testing.T, say func(string) string) (setsid, orphan int) {
	t.Helper()
	for _, c := range []struct {
		dst *int
		cmd string
	}{
		{&setsid, "/run setsid sleep 3600 >/dev/null 2>&1 & echo $!"},
		{&orphan, "/run (sleep 3600 >/dev/null 2>&1 & echo $!)"},
	} {
		answer := say(c.cmd)
		pid, err := strconv.Atoi(answer)
		if err != nil {
			t.Fatalf("%q answered %q", c.cmd, answer)
		}
		t.Cleanup(func() { _ = syscall.Kill(pid, syscall.SIGKILL) })
		*c.dst = pid
	}
	eventually(t, 5*time.Second, func() string { return fmt.Sprintf("child %d in a session of its own", setsid) },
		func() bool { return statField(t, setsid, 6) == setsid })
	return setsid, orphan
}

// TestCgroupTeardownReachesSetsidAndDoubleForkedChildren: in cgroup mode a
// child that left its instance's session and one that left its parent are
// both gone after the release, and so is the lease's cgroup.
func TestCgroupTeardownReachesSetsidAndDoubleForkedChildren(t *testing.T) {
	b, root := cgroupBroker(t, Options{YAML: "release_grace: 1s\n"})
	claim, conn, pid := instancePid(t, b, "nexus")
	lease := filepath.Join(root, cgroupBrokerID, claim.LeaseID)
	setsid, orphan := escapees(t, func(s string) string { return say(t, conn, s) })
	for _, p := range []int{pid, setsid, orphan} {
		if !inCgroup(lease, p) {
			t.Fatalf("pid %d is not in the lease's cgroup %s", p, lease)
		}
	}
	if status, _ := b.do("POST", "/release/"+claim.LeaseID, ""); status != 200 {
		t.Fatalf("release = %d", status)
	}
	for _, p := range []int{pid, setsid, orphan} {
		eventually(t, 15*time.Second, func() string { return fmt.Sprintf("pid %d gone after release", p) }, func() bool { return !alive(p) })
	}
	eventually(t, 15*time.Second, func() string { return "lease cgroup " + lease + " removed" }, func() bool {
		_, err := os.Stat(lease)
		return errors.Is(err, fs.ErrNotExist)
	})
}

// TestOrphanedLeaseCgroupIsCleanedAtNextBoot: spawnd is killed right after
// an exec whose "started" record never reached the journal. Its successor
// kills that instance, and what it started, through the lease's cgroup and
// removes it; another broker's subtree under the same root is left alone.
func TestOrphanedLeaseCgroupIsCleanedAtNextBoot(t *testing.T) {
	b, root := cgroupBroker(t, Options{StateDir: true})
	claim, conn, pid := instancePid(t, b, "nexus")
	lease := filepath.Join(root, cgroupBrokerID, claim.LeaseID)
	setsid, _ := escapees(t, func(s string) string { return say(t, conn, s) })

	// Another broker's instance, in its own subtree of the same root.
	other := filepath.Join(root, "another-broker", "lease-x")
	if err := os.MkdirAll(other, 0o755); err != nil {
		t.Fatal(err)
	}
	otherDir, err := os.Open(other)
	if err != nil {
		t.Fatal(err)
	}
	stranger := exec.Command("sleep", "3600")
	stranger.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(otherDir.Fd())}
	if err := stranger.Start(); err != nil {
		t.Fatal(err)
	}
	otherDir.Close()
	t.Cleanup(func() { _ = stranger.Process.Kill(); _ = stranger.Wait() })

	b.KillSpawnd(syscall.SIGKILL)
	// As if spawnd had died between the exec and the journal's fsync: the
	// lease was minted, but no record carries its pid.
	journal := filepath.Join(b.Dir, "state", "leases.jsonl")
	data, err := os.ReadFile(journal)
	if err != nil {
		t.Fatal(err)
	}
	var kept []string
	for _, line := range strings.SplitAfter(string(data), "\n") {
		if strings.Contains(line, claim.LeaseID) && !strings.Contains(line, `"kind":"minted"`) {
			continue
		}
		kept = append(kept, line)
	}
	if err := os.WriteFile(journal, []byte(strings.Join(kept, "")), 0o600); err != nil {
		t.Fatal(err)
	}
	if !alive(pid) || !alive(setsid) {
		t.Fatal("the instance died with spawnd; nothing is left to clean up")
	}

	b.StartSpawnd()
	b.SpawndLog.wait(t, regexp.MustCompile(`lease cgroup no live lease holds: killed its processes and removed it" lease_id=`+claim.LeaseID), 15*time.Second)
	for _, p := range []int{pid, setsid} {
		eventually(t, 5*time.Second, func() string { return fmt.Sprintf("pid %d gone", p) }, func() bool { return !alive(p) })
	}
	if _, err := os.Stat(lease); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("lease cgroup %s still there: %v", lease, err)
	}
	if !alive(stranger.Process.Pid) || !inCgroup(other, stranger.Process.Pid) {
		t.Errorf("the other broker's instance %d in %s was touched", stranger.Process.Pid, other)
	}
}

// TestCgroupLimitWithoutItsControllerRefusesTheBoot: a pids_max on a tree
// that does not enable the pids controller refuses spawnd's boot, naming
// the entry, the key and the controller.
func TestCgroupLimitWithoutItsControllerRefusesTheBoot(t *testing.T) {
	root := cgroupRoot(t)
	if data, _ := os.ReadFile(filepath.Join(filepath.Dir(root), "cgroup.subtree_control")); strings.Contains(string(data), "pids") {
		t.Skip("this tree enables the pids controller; the refusal needs one that does not")
	}
	dir := t.TempDir()
	cfg := filepath.Join(dir, "broker.yaml")
	yaml := fmt.Sprintf("spawnd:\n  run_dir: %q\n  cgroup_root: %q\nbinaries:\n  nexus:\n    path: %q\n    pids_max: 64\n",
		filepath.Join(sockdir.New(t, "nxg"), "run"), root, bin("nexus-echo"))
	if err := os.WriteFile(cfg, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, bin("nexus-spawnd"), "-config", cfg).CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 {
		t.Fatalf("nexus-spawnd = %v, want exit 1; output:\n%s", err, out)
	}
	want := fmt.Sprintf("binaries: nexus: pids_max needs the pids controller, which %s does not enable in cgroup.subtree_control", root)
	if !strings.Contains(string(out), want) {
		t.Fatalf("output does not say %q:\n%s", want, out)
	}
}

// TestCgroupTeardownRemovesChildCgroupsAnInstanceMade: an instance running
// as spawnd's own uid (root, no run_as) can create cgroups inside its
// lease's and move a child there. Teardown reaches that child and removes
// the whole subtree, where a plain rmdir of the lease cgroup would fail
// with EBUSY for ever.
func TestCgroupTeardownRemovesChildCgroupsAnInstanceMade(t *testing.T) {
	b, root := cgroupBrokerWith(t, Options{YAML: "release_grace: 1s\n"},
		fmt.Sprintf("  nexus:\n    path: %q\n    env:\n      %s: \"1\"\n", bin("nexus-echo"), echo.EnvAllowRun))
	claim, conn, pid := instancePid(t, b, "nexus")
	lease := filepath.Join(root, cgroupBrokerID, claim.LeaseID)
	sub := filepath.Join(lease, "made-by-the-instance", "deeper")
	answer := say(t, conn, fmt.Sprintf("/run mkdir -p %q && (sleep 3600 >/dev/null 2>&1 & echo $! > %q; echo $!)", sub, filepath.Join(sub, "cgroup.procs")))
	child, err := strconv.Atoi(answer)
	if err != nil {
		t.Fatalf("moving a child into a cgroup of the instance's own answered %q", answer)
	}
	t.Cleanup(func() { _ = syscall.Kill(child, syscall.SIGKILL) })
	if !inCgroup(sub, child) {
		t.Fatalf("pid %d is not in %s", child, sub)
	}
	if status, _ := b.do("POST", "/release/"+claim.LeaseID, ""); status != 200 {
		t.Fatalf("release = %d", status)
	}
	for _, p := range []int{pid, child} {
		eventually(t, 15*time.Second, func() string { return fmt.Sprintf("pid %d gone after release", p) }, func() bool { return !alive(p) })
	}
	eventually(t, 15*time.Second, func() string { return "lease cgroup " + lease + " and its subtree removed" }, func() bool {
		_, err := os.Stat(lease)
		return errors.Is(err, fs.ErrNotExist)
	})
	if n := b.SpawndLog.count(regexp.MustCompile(`cgroup: removing`)); n != 0 {
		t.Fatalf("spawnd logged %d failed removals:\n%s", n, b.SpawndLog)
	}
}
