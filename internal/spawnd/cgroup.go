package spawnd

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nexus-broker/nexus-broker/internal/config/core"
)

// Containment: one cgroup v2 per lease, <root>/<broker_id>/<lease_id>. An
// instance is cloned straight into it (CLONE_INTO_CGROUP), and nothing it
// forks can leave: setsid and double forks change sessions and parents, not
// cgroups, and only a writer of cgroup.procs (root, here) moves a process.
// So teardown reaches everything an instance started, and a lease is gone
// only once its cgroup is empty and removed. Without a delegated tree,
// process groups, which a child leaves with setsid.

const (
	// cgroupDrainLimit bounds how long a teardown waits for a killed cgroup
	// to empty; only a process in uninterruptible sleep outlasts it.
	cgroupDrainLimit = 10 * time.Second
	// cgroupRetryEvery spaces the retries of such a cgroup's removal.
	cgroupRetryEvery = 5 * time.Second
	// cgroupSelfLeaf is where spawnd moves itself when the root is its own
	// cgroup (Delegate=yes): a cgroup with members cannot hand controllers
	// to its children.
	cgroupSelfLeaf = "nexus-spawnd"
)

// limitFiles maps an entry limit to its controller and file.
var limitFiles = map[string]struct{ controller, file string }{
	"memory_max": {"memory", "memory.max"},
	"pids_max":   {"pids", "pids.max"},
	"cpu_weight": {"cpu", "cpu.weight"},
}

// msgNoCgroups is the one WARN of a spawnd without cgroup containment.
const msgNoCgroups = "no delegated cgroup v2 tree: instances are contained by process group only, which a child that calls setsid leaves, " +
	"surviving its instance's release; set spawnd.cgroup_root to a writable cgroup v2 directory, or run nexus-spawnd under systemd with Delegate=yes"

// Where the auto-detection reads; tests point them at fixtures.
var (
	procSelfCgroup    = "/proc/self/cgroup"
	procSelfMountinfo = "/proc/self/mountinfo"
)

// openCgroups sets up the tree at boot (or WARNs there is none), then the
// controllers s's limits need.
func (d *Daemon) openCgroups(configured string, s *settings) error {
	root, err := findCgroupRoot(configured)
	if err != nil {
		return err
	}
	if root == "" {
		d.log.Warn(msgNoCgroups)
	} else if d.cgroups, err = openCgroupTree(root, d.brokerID); err != nil {
		return err
	} else {
		d.log.Info("containing each instance in a cgroup of its own", "cgroup_dir", d.cgroups.dir)
	}
	return d.cgroups.admit(s)
}

// sweepCgroups kills and removes, at boot, every lease cgroup of this broker
// no live lease holds (a spawnd died between exec and journaling the pid,
// or the record was closed out); another broker id's subtree is untouched.
func (d *Daemon) sweepCgroups() {
	if d.cgroups == nil {
		return
	}
	ents, _ := os.ReadDir(d.cgroups.dir)
	for _, e := range ents {
		id := e.Name()
		if _, live := d.leases[id]; live || !e.IsDir() {
			continue
		}
		pids, _ := subtreeProcs(filepath.Join(d.cgroups.dir, id))
		if err := d.cgroups.remove(id, cgroupDrainLimit); err != nil {
			d.log.Error("removing an orphaned lease cgroup failed", "lease_id", id, "pids", fmt.Sprint(pids), "error", err)
			continue
		}
		d.log.Warn("lease cgroup no live lease holds: killed its processes and removed it", "lease_id", id, "pids", fmt.Sprint(pids))
	}
}

// cgroupTree is this broker's subtree of the delegated root.
type cgroupTree struct {
	root string // the delegated directory
	dir  string // root/<broker_id>: this broker's lease cgroups, nothing else
}

// findCgroupRoot is the delegated cgroup v2 directory: spawnd.cgroup_root,
// which must be a writable cgroup v2 directory, else spawnd's own cgroup when
// systemd delegated it; "" for none.
func findCgroupRoot(configured string) (string, error) {
	if configured != "" {
		if !filepath.IsAbs(configured) {
			return "", fmt.Errorf("broker config: spawnd.cgroup_root: %q is not an absolute path", configured)
		}
		var st unix.Statfs_t
		if err := unix.Statfs(configured, &st); err != nil || st.Type != unix.CGROUP2_SUPER_MAGIC {
			return "", fmt.Errorf("broker config: spawnd.cgroup_root: %s is not a cgroup v2 directory (%v); point it at a directory of the cgroup2 mount that nexus-spawnd may write, or remove the key", configured, err)
		}
		if err := unix.Access(configured, unix.W_OK); err != nil {
			return "", fmt.Errorf("broker config: spawnd.cgroup_root: %s is not writable by nexus-spawnd: %w; delegate it (systemd: Delegate=yes) or remove the key", configured, err)
		}
		return configured, nil
	}
	if own := ownCgroup(); own != "" && delegated(own) {
		return own, nil
	}
	return "", nil
}

// ownCgroup is spawnd's own cgroup v2 directory; "" when /proc does not tell.
func ownCgroup() string {
	self, _ := os.ReadFile(procSelfCgroup)
	mounts, _ := os.ReadFile(procSelfMountinfo)
	return ownCgroupDir(self, mounts)
}

// ownCgroupDir joins the "0::" line of /proc/self/cgroup to the cgroup2
// mount of /proc/self/mountinfo; "" without either.
func ownCgroupDir(selfCgroup, mountinfo []byte) string {
	var path string
	for line := range strings.Lines(string(selfCgroup)) {
		if p, ok := strings.CutPrefix(strings.TrimSpace(line), "0::"); ok {
			path = p
		}
	}
	if !strings.HasPrefix(path, "/") {
		return ""
	}
	for line := range strings.Lines(string(mountinfo)) {
		pre, post, ok := strings.Cut(line, " - ")
		f, fs := strings.Fields(pre), strings.Fields(post)
		if !ok || len(f) < 5 || len(fs) < 1 || fs[0] != "cgroup2" {
			continue
		}
		// Field 4 is the mount's root inside the hierarchy, field 5 where
		// it is mounted.
		rel, ok := strings.CutPrefix(path, f[3])
		if !ok {
			continue
		}
		return filepath.Join(f[4], rel)
	}
	return ""
}

// delegated reports whether systemd delegated dir: Delegate=yes sets
// trusted.delegate or user.delegate.
func delegated(dir string) bool {
	for _, attr := range []string{"trusted.delegate", "user.delegate"} {
		buf := make([]byte, 8)
		if n, err := unix.Getxattr(dir, attr, buf); err == nil && string(buf[:n]) == "1" {
			return true
		}
	}
	return false
}

// openCgroupTree prepares root/<brokerID>, first moving spawnd into a leaf
// of its own when root is spawnd's own cgroup.
func openCgroupTree(root, brokerID string) (*cgroupTree, error) {
	// broker_id is joined into the path, and everything under the result is
	// this broker's to kill: ".." would make the root's siblings "ours".
	if !core.IsToken(brokerID, core.MaxBrokerIDLen) {
		return nil, fmt.Errorf("broker config: broker_id: %q cannot name this broker's cgroup under %s: with per-lease cgroups use 1 to %d letters, digits, - or _", brokerID, root, core.MaxBrokerIDLen)
	}
	if ownCgroup() == filepath.Clean(root) {
		leaf := filepath.Join(root, cgroupSelfLeaf)
		if err := os.Mkdir(leaf, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
			return nil, fmt.Errorf("cgroup: creating %s for nexus-spawnd itself: %w", leaf, err)
		}
		if err := writeCgroupFile(leaf, "cgroup.procs", strconv.Itoa(os.Getpid())); err != nil {
			return nil, err
		}
	}
	t := &cgroupTree{root: root, dir: filepath.Join(root, brokerID)}
	if err := os.Mkdir(t.dir, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return nil, fmt.Errorf("cgroup: creating %s: %w; check that spawnd.cgroup_root is delegated to nexus-spawnd", t.dir, err)
	}
	// Teardown depends on cgroup.kill (Linux 5.14).
	if _, err := os.Stat(filepath.Join(t.dir, "cgroup.kill")); err != nil {
		_ = os.Remove(t.dir)
		return nil, fmt.Errorf("cgroup: %s has no cgroup.kill, so its instances could not be torn down: per-lease cgroups need Linux 5.14 or later; "+
			"upgrade, or remove spawnd.cgroup_root (and Delegate=yes from the unit) to contain instances by process group", t.dir)
	}
	return t, nil
}

// admit enables the controllers s's limits need in the root's and this
// broker's cgroup.subtree_control. A limit whose controller the root does
// not offer refuses s, naming it; a nil tree refuses any limit.
func (t *cgroupTree) admit(s *settings) error {
	for _, name := range slices.Sorted(maps.Keys(s.entries)) {
		for _, key := range slices.Sorted(maps.Keys(s.entries[name].limits)) {
			c := limitFiles[key].controller
			if t == nil {
				return fmt.Errorf("broker config: binaries: %s: %s needs cgroup v2 containment, which this nexus-spawnd has not got (no spawnd.cgroup_root, and no cgroup delegated by systemd); set one or remove the limit", name, key)
			}
			if !t.enabled(t.root, c) {
				_ = writeCgroupFile(t.root, "cgroup.subtree_control", "+"+c)
			}
			if !t.enabled(t.root, c) {
				offered, _ := os.ReadFile(filepath.Join(t.root, "cgroup.controllers"))
				return fmt.Errorf("broker config: binaries: %s: %s needs the %s controller, which %s does not enable in cgroup.subtree_control (controllers it offers: %q); enable it there or remove the limit",
					name, key, c, t.root, strings.TrimSpace(string(offered)))
			}
			if err := writeCgroupFile(t.dir, "cgroup.subtree_control", "+"+c); err != nil {
				return fmt.Errorf("broker config: binaries: %s: %s: %w", name, key, err)
			}
		}
	}
	return nil
}

// enabled reports whether dir's cgroup.subtree_control lists controller.
func (t *cgroupTree) enabled(dir, controller string) bool {
	data, _ := os.ReadFile(filepath.Join(dir, "cgroup.subtree_control"))
	return slices.Contains(strings.Fields(string(data)), controller)
}

// create makes a lease's cgroup with the entry's limits, open for
// CLONE_INTO_CGROUP.
func (t *cgroupTree) create(leaseID string, e *entry) (*os.File, error) {
	dir := filepath.Join(t.dir, leaseID)
	if err := os.Mkdir(dir, 0o755); err != nil {
		return nil, fmt.Errorf("cgroup: creating %s: %w", dir, err)
	}
	for _, key := range slices.Sorted(maps.Keys(e.limits)) {
		if err := writeCgroupFile(dir, limitFiles[key].file, e.limits[key]); err != nil {
			_ = os.Remove(dir)
			return nil, err
		}
	}
	f, err := os.Open(dir)
	if err != nil {
		_ = os.Remove(dir)
		return nil, fmt.Errorf("cgroup: %w", err)
	}
	return f, nil
}

// signal sends sig to every member of a lease's cgroup: SIGKILL through
// cgroup.kill (all at once, forks in flight included), any other signal
// through a pidfd of each member still listed once the pidfd is open, so a
// pid reused since the listing is never signalled.
func (t *cgroupTree) signal(leaseID string, sig unix.Signal) error {
	dir := filepath.Join(t.dir, leaseID)
	if sig == unix.SIGKILL {
		return writeCgroupFile(dir, "cgroup.kill", "1")
	}
	before, err := subtreeProcs(dir)
	if err != nil {
		return err
	}
	fds := map[int]int{}
	for _, pid := range before {
		if fd, err := unix.PidfdOpen(pid, 0); err == nil {
			fds[pid] = fd
		}
	}
	after, err := subtreeProcs(dir)
	for pid, fd := range fds {
		if err == nil && slices.Contains(after, pid) {
			_ = unix.PidfdSendSignal(fd, sig, nil, 0)
		}
		_ = unix.Close(fd)
	}
	return err
}

// remove kills what is left in a lease's cgroup, waits up to within for it
// to empty and removes it (a missing one is removed already).
func (t *cgroupTree) remove(leaseID string, within time.Duration) error {
	dir := filepath.Join(t.dir, leaseID)
	if _, err := os.Stat(dir); errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err := t.signal(leaseID, unix.SIGKILL); err != nil {
		return err
	}
	events, err := os.Open(filepath.Join(dir, "cgroup.events"))
	if err != nil {
		return fmt.Errorf("cgroup: %w", err)
	}
	defer events.Close()
	deadline := time.Now().Add(within)
	buf := make([]byte, 256)
	for {
		n, err := events.ReadAt(buf, 0)
		if n == 0 && err != nil {
			return fmt.Errorf("cgroup: reading %s: %w", events.Name(), err)
		}
		if bytes.Contains(buf[:n], []byte("populated 0")) {
			break
		}
		left := time.Until(deadline)
		if left <= 0 {
			return fmt.Errorf("cgroup %s still holds %s %s after SIGKILL: a process in uninterruptible sleep (state D) dies only once its kernel call returns", dir, members(dir), within)
		}
		// The kernel flags cgroup.events with POLLPRI when it changes.
		fds := []unix.PollFd{{Fd: int32(events.Fd()), Events: unix.POLLPRI}}
		if _, err := unix.Poll(fds, int(min(left, time.Second)/time.Millisecond)+1); err != nil && err != unix.EINTR {
			return fmt.Errorf("cgroup: polling %s: %w", events.Name(), err)
		}
	}
	// Children first: a cgroup with child cgroups cannot be removed.
	dirs := subtree(dir)
	for i := len(dirs) - 1; i >= 0; i-- {
		if err := os.Remove(dirs[i]); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("cgroup: removing %s: %w", dirs[i], err)
		}
	}
	return nil
}

// subtree lists dir and every cgroup below it, parents first: an instance
// of spawnd's uid can create child cgroups (cgroupfs holds no symlinks).
func subtree(dir string) []string {
	var dirs []string
	_ = filepath.WalkDir(dir, func(path string, e fs.DirEntry, err error) error {
		if err == nil && e.IsDir() {
			dirs = append(dirs, path)
		}
		return nil
	})
	return dirs
}

// subtreeProcs lists the members of dir and of every cgroup below it.
func subtreeProcs(dir string) ([]int, error) {
	var all []int
	for _, d := range subtree(dir) {
		data, err := os.ReadFile(filepath.Join(d, "cgroup.procs"))
		if err != nil && d == dir {
			return nil, fmt.Errorf("cgroup: %w", err)
		}
		for _, f := range strings.Fields(string(data)) {
			if pid, err := strconv.Atoi(f); err == nil {
				all = append(all, pid)
			}
		}
	}
	return all, nil
}

// holds reports whether a lease has a cgroup here (one a spawnd without
// cgroups started has none).
func (t *cgroupTree) holds(leaseID string) bool {
	if t == nil {
		return false
	}
	info, err := os.Stat(filepath.Join(t.dir, leaseID))
	return err == nil && info.IsDir()
}

// members names each process left in a cgroup and its state (D: waiting in
// the kernel), for the error of one that will not empty.
func members(dir string) string {
	var out []string
	pids, _ := subtreeProcs(dir)
	for _, pid := range pids {
		state := "gone"
		if st, err := readProcStat(pid); err == nil {
			state = string(st.state)
		}
		out = append(out, fmt.Sprintf("pid %d (state %s)", pid, state))
	}
	return strings.Join(out, ", ")
}

// writeCgroupFile writes value to an existing cgroup interface file.
func writeCgroupFile(dir, name, value string) error {
	path := filepath.Join(dir, name)
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err == nil {
		_, err = f.WriteString(value)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}
	if err != nil {
		return fmt.Errorf("cgroup: writing %q to %s: %w", value, path, err)
	}
	return nil
}
