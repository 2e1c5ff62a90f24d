package spawnd

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Recovery: at boot, each lease the predecessor journaled as live whose
// instance is proven to be the same process is adopted (supervised, listed,
// verifiable, terminable as if spawned here). Identity is (boot id, pid,
// start time), never a pid alone: a recycled pid may be anybody's. A record
// that cannot be proven is closed out and its process never signalled.

// Reasons a record is closed out at recovery.
const (
	// reasonPidGone: no process has the journaled pid any more.
	reasonPidGone = "pid gone"
	// reasonIdentityMismatch: the pid is held by a process with another
	// start time, or the host rebooted since (another boot id).
	reasonIdentityMismatch = "identity mismatch"
	// reasonNeverStarted: no pid was journaled, so nothing can be proven.
	reasonNeverStarted = "never started"
)

// configDirPrefix names spawnd's temp config directories (makeWorkDirs).
const configDirPrefix = "nexus-spawnd-"

// readBootID is this boot's /proc/sys/kernel/random/boot_id.
func readBootID() (string, error) {
	data, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return "", fmt.Errorf("reading the boot id: %w; nexus-spawnd needs /proc mounted to prove an instance's identity", err)
	}
	return strings.TrimSpace(string(data)), nil
}

// procStat is what spawnd reads from /proc/<pid>/stat.
type procStat struct {
	state     byte   // field 3: 'Z' is a zombie
	pgid, sid int    // fields 5 and 6
	tty       int    // field 7: the controlling terminal, 0 for none
	startTime uint64 // field 22, clock ticks since boot
	// exitStatus is field 52, the wait status of a zombie; 0 for a live
	// process, and for one whose status we may not read.
	exitStatus uint32
}

// readProcStat parses /proc/<pid>/stat, counting fields from the last ')':
// the command name (field 2) may itself hold spaces and parentheses.
func readProcStat(pid int) (procStat, error) {
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return procStat{}, err
	}
	s := string(data)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:]) // f[0] is field 3
	field := func(n int) string { return f[n-3] }
	if len(f) < 22-2 || len(field(3)) != 1 {
		return procStat{}, fmt.Errorf("/proc/%d/stat has %d fields after the command name, not the layout nexus-spawnd reads", pid, len(f))
	}
	st := procStat{state: field(3)[0]}
	st.pgid, err = strconv.Atoi(field(5))
	if err == nil {
		st.sid, err = strconv.Atoi(field(6))
	}
	if err == nil {
		st.tty, err = strconv.Atoi(field(7))
	}
	if err == nil {
		st.startTime, err = strconv.ParseUint(field(22), 10, 64)
	}
	if err == nil && len(f) >= 52-2 {
		var status uint64
		status, err = strconv.ParseUint(field(52), 10, 32)
		st.exitStatus = uint32(status)
	}
	if err != nil {
		return procStat{}, fmt.Errorf("/proc/%d/stat: %w", pid, err)
	}
	return st, nil
}

// identify proves that rec's process is still the instance it was journaled
// for and returns a pidfd for it and its stat, or else the reason to close
// the record out and what was found.
//
// The start time is checked before pidfd_open and after: the instance held
// the pid before and still holds it after, so the pidfd opened in between
// refers to it (a process keeps its pid for life).
func identify(rec leaseRecord, bootID string) (pidfd int, st procStat, reason, found string) {
	if rec.PID <= 0 {
		return -1, st, reasonNeverStarted, "no pid was journaled"
	}
	if rec.BootID != bootID {
		return -1, st, reasonIdentityMismatch, fmt.Sprintf("journaled under boot id %q; the host has rebooted since (boot id %q)", rec.BootID, bootID)
	}
	check := func() (string, string) {
		var err error
		st, err = readProcStat(rec.PID)
		switch {
		case errors.Is(err, fs.ErrNotExist) || errors.Is(err, unix.ESRCH):
			return reasonPidGone, "no such process"
		case err != nil:
			return reasonIdentityMismatch, err.Error()
		case st.startTime != rec.StartTime:
			return reasonIdentityMismatch, fmt.Sprintf("the pid now belongs to a process started at tick %d, not %d", st.startTime, rec.StartTime)
		}
		return "", ""
	}
	if reason, found = check(); reason != "" {
		return -1, st, reason, found
	}
	pidfd, err := unix.PidfdOpen(rec.PID, 0)
	if err == unix.ESRCH {
		return -1, st, reasonPidGone, "the process exited during recovery"
	} else if err != nil {
		return -1, st, reasonIdentityMismatch, fmt.Sprintf("pidfd_open: %v", err)
	}
	if reason, found = check(); reason != "" {
		_ = unix.Close(pidfd)
		return -1, st, reason, found
	}
	return pidfd, st, "", ""
}

// adoptedStatus is an exited adopted instance's wait status, best-effort:
// it is readable in /proc only until init reaps it.
func adoptedStatus(rec leaseRecord) (unix.WaitStatus, bool) {
	st, err := readProcStat(rec.PID)
	if err != nil || st.state != 'Z' || st.startTime != rec.StartTime {
		return 0, false
	}
	return unix.WaitStatus(st.exitStatus), true
}

// maxScanRounds bounds killGroupRemains. A round signals every member it
// sees; the next finds only children forked during the last, and a killed
// process forks no more, so a couple of rounds is the norm.
const maxScanRounds = 16

// killGroupRemains SIGKILLs what is left of an adopted instance's process
// group once its leader has exited. Not the leader's parent, spawnd cannot
// keep it unreaped to pin the group id, so kill(-pgid) could reach a group
// that reused the id; it signals each member found in /proc through its own
// pidfd instead.
//
// Why only the instance's processes: Linux hands out no pid still used as a
// group id, so while the group has a member the id is the instance's. Only
// if it emptied and the pid came round again since the leader's exit could
// a member be a stranger, and the filter shuts out what it can even then: a
// member shares the leader's session (setpgid never crosses sessions) and
// started no earlier. Each candidate is read again once its pidfd is open,
// as identify does.
func killGroupRemains(pgid, sid int, leaderStart uint64) (killed int, err error) {
	member := func(st procStat) bool {
		return st.pgid == pgid && st.sid == sid && st.startTime >= leaderStart && st.state != 'Z'
	}
	signalled := map[int]uint64{} // pid → start time
	for range maxScanRounds {
		members, err := scanProcs(member)
		if err != nil {
			return killed, err
		}
		fresh := 0
		for pid, st := range members {
			if start, ok := signalled[pid]; ok && start == st.startTime {
				continue // killed last round, not yet a zombie
			}
			fd, err := unix.PidfdOpen(pid, 0)
			if err != nil {
				continue // gone already
			}
			if again, err := readProcStat(pid); err == nil && member(again) && again.startTime == st.startTime &&
				unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0) == nil {
				signalled[pid] = st.startTime
				fresh++
			}
			_ = unix.Close(fd)
		}
		if fresh == 0 {
			return len(signalled), nil
		}
	}
	return len(signalled), fmt.Errorf("process group %d still had new members after %d rounds of SIGKILL", pgid, maxScanRounds)
}

// scanProcs is every process in /proc whose stat member accepts, by pid.
func scanProcs(member func(procStat) bool) (map[int]procStat, error) {
	names, err := os.ReadDir("/proc")
	if err != nil {
		return nil, fmt.Errorf("scanning /proc for the instance's process group: %w", err)
	}
	found := map[int]procStat{}
	for _, de := range names {
		pid, err := strconv.Atoi(de.Name())
		if err != nil {
			continue
		}
		if st, err := readProcStat(pid); err == nil && member(st) {
			found[pid] = st
		}
	}
	return found, nil
}

// journaledConfig is the temp config a record names if it has the shape of
// one spawnd wrote (<temp>/nexus-spawnd-*/<lease id>.yaml), else "": a path
// spawnd deletes is checked, even from its own journal.
func journaledConfig(rec leaseRecord) string {
	p := rec.ConfigPath
	if !filepath.IsAbs(p) || filepath.Clean(p) != p || filepath.Base(p) != rec.LeaseID+".yaml" ||
		!strings.HasPrefix(filepath.Base(filepath.Dir(p)), configDirPrefix) {
		return ""
	}
	return p
}

// removeConfig removes a gone instance's temp config, and then its
// directory if left empty by a predecessor killed with -9 (removeStaleDir).
func (d *Daemon) removeConfig(path string) {
	if path == "" {
		return
	}
	_ = os.Remove(path)
	if dir := filepath.Dir(path); dir != d.configDir {
		removeStaleDir(dir)
	}
}

// recoverLeases adopts or closes out each live lease the journal replayed,
// in New, before any verb is served; the caller starts the supervisors.
func (d *Daemon) recoverLeases(live []leaseRecord) []*lease {
	var adopted []*lease
	for _, rec := range live {
		d.spent[rec.LeaseID] = struct{}{}
		pidfd, st, reason, found := identify(rec, d.bootID)
		if reason != "" {
			rec.Reason = reason
			rec.seq++
			d.journal.Put(journalLine{kindEnded, rec})
			d.removeConfig(journaledConfig(rec))
			d.log.Warn("journaled lease closed out; its process was not signalled",
				"lease_id", rec.LeaseID, "entry", rec.Entry, "pid", rec.PID, "reason", reason, "found", found)
			continue
		}
		l := &lease{
			rec:        rec,
			state:      stateRunning,
			pidfd:      pidfd,
			configPath: journaledConfig(rec),
			adopted:    true,
			sid:        st.sid,
			inCgroup:   d.cgroups.holds(rec.LeaseID),
			gone:       make(chan struct{}),
		}
		d.leases[rec.LeaseID] = l
		adopted = append(adopted, l)
		d.log.Info("instance re-adopted", "lease_id", rec.LeaseID, "entry", rec.Entry, "pid", rec.PID,
			"session_id", rec.SessionID, "principal", rec.Principal)
	}
	return adopted
}
