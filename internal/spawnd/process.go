package spawnd

import (
	"fmt"
	"io"
	"os"
	"runtime"
	"strconv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nexus-broker/nexus-broker/internal/safedir"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// termGrace is how long Terminate waits after SIGTERM before SIGKILL: fixed
// and short, as upstream's, since release_grace has already run out.
const termGrace = 2 * time.Second

// started is a running, unreaped instance, as start hands it back.
type started struct {
	pid, pidfd int
	startTime  uint64
}

// start writes the lease's config and runs
//
//	<resolved path> -config <file> [-recall <session>] <entry args…>
//
// with spawnEnv's environment, in the HOME it gives, as a new session's
// leader, under run_as, with no_new_privs unless the entry opts out, to dial
// back to addr. Output appends to the lease's log file: a pipe would die
// with spawnd, and the instance with it (SIGPIPE). On failure it names the
// failed step and leaves no config and no process behind.
func (d *Daemon) start(id string, e *entry, inherit []string, req *spawnpb.SpawnRequest, addr string) (started, spawnpb.SpawnStep, error) {
	var cred *syscall.Credential
	if e.runAs != nil {
		// An empty, non-nil Groups makes the child call setgroups(0, NULL),
		// dropping spawnd's supplementary groups.
		cred = &syscall.Credential{Uid: e.runAs.uid, Gid: e.runAs.gid, Groups: []uint32{}}
	}
	home := ""
	if tn := d.tenancy; tn != nil {
		uid, err := tn.uidFor(req.GetPrincipal())
		if err != nil {
			return started{}, spawnpb.SpawnStep_SPAWN_STEP_UID, err
		}
		if home, err = tn.home(uid); err != nil {
			return started{}, spawnpb.SpawnStep_SPAWN_STEP_HOME, err
		}
		cred = tenantCredential(uid)
	}
	configPath := d.configFor(id)
	if err := writeConfig(configPath, req.GetConfig(), cred); err != nil {
		return started{}, spawnpb.SpawnStep_SPAWN_STEP_TEMP_CONFIG, err
	}
	p, err := d.exec(id, e, inherit, req, dialBack{addr: addr, leaseID: id, secret: secretFor(d.key, id), home: home}, configPath, cred)
	if err != nil {
		_ = os.Remove(configPath)
		return started{}, spawnpb.SpawnStep_SPAWN_STEP_EXEC, fmt.Errorf("spawning instance: %w", err)
	}
	return p, spawnpb.SpawnStep_SPAWN_STEP_UNSPECIFIED, nil
}

func (d *Daemon) exec(id string, e *entry, inherit []string, req *spawnpb.SpawnRequest, dial dialBack, configPath string, cred *syscall.Credential) (started, error) {
	p := started{pidfd: -1}
	argv := []string{e.resolved, "-config", configPath}
	if s := req.GetRecallSessionId(); s != "" {
		argv = append(argv, "-recall", s)
	}
	argv = append(argv, e.args...)
	if tn := d.tenancy; tn != nil && tn.bwrap != "" {
		argv = sandboxArgv(tn.bwrap, dial.home, configPath, argv)
	}
	env := spawnEnv(e, inherit, os.LookupEnv, dial)
	dir := workingDir(env.values["HOME"])

	out, err := openFile(d.logFor(id), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return started{}, fmt.Errorf("opening the instance log: %w", err)
	}
	defer out.Close()
	null, err := devNull()
	if err != nil {
		return started{}, err
	}
	own := ownSession(cred)
	sys := &syscall.SysProcAttr{
		// No controlling terminal: the instance cannot push input into
		// the terminal spawnd was started from (TIOCSTI).
		Setsid:     own,
		Setpgid:    !own,
		Credential: cred,
		PidFD:      &p.pidfd,
	}
	if d.cgroups != nil {
		cg, err := d.cgroups.create(id, e)
		if err != nil {
			return started{}, err
		}
		defer cg.Close()
		sys.UseCgroupFD, sys.CgroupFD = true, int(cg.Fd())
	}

	p.pid, err = startProcess(argv, &syscall.ProcAttr{
		Dir:   dir,
		Env:   env.pairs(),
		Files: []uintptr{null.Fd(), out.Fd(), out.Fd()},
		Sys:   sys,
	}, !e.allowEscalation)
	if err != nil {
		// No process, so no group to kill (pid 0 would be spawnd's own).
		if d.cgroups != nil {
			d.removeCgroup(id)
		}
		as := "nexus-spawnd's own credential"
		if e.runAs != nil {
			as = "run_as " + e.runAs.String()
		} else if cred != nil {
			as = fmt.Sprintf("the principal's uid %d", cred.Uid)
		}
		return started{}, fmt.Errorf("exec %s in %s under %s: %w", argv[0], dir, as, err)
	}
	if p.pidfd < 0 {
		err = fmt.Errorf("the kernel gave no pidfd for pid %d; nexus-spawnd needs Linux 5.3 or later", p.pid)
	} else if st, serr := readProcStat(p.pid); serr != nil {
		err = fmt.Errorf("reading the instance's start time: %w", serr)
		_ = unix.Close(p.pidfd)
	} else {
		p.startTime = st.startTime
	}
	if err != nil {
		d.discard(id, p.pid)
		return started{}, err
	}
	return p, nil
}

// discard kills a lease's instance that exec started but that must not
// run, with its process group, and reaps it; removing its cgroup kills
// what is left there. Not yet reaped, the pid and its group are still this
// child's.
func (d *Daemon) discard(id string, pid int) {
	_ = unix.Kill(-pid, unix.SIGKILL)
	_, _ = reap(pid)
	if d.cgroups != nil {
		d.removeCgroup(id)
	}
}

// ownSession says whether an instance must lead a session of its own
// rather than only a process group of its own in spawnd's session: where
// it runs as another user (run_as, tenancy:), which a shared session would
// let send SIGCONT to spawnd and to other users' instances, or where spawnd
// has a controlling terminal, which the instance could then reach. Otherwise
// spawnd's session has no terminal to reach, a process-group leader cannot
// acquire one, and a process of spawnd's own uid can signal spawnd anyway;
// and a session is a scheduling group of its own under the kernel's
// autogroups, which made a new instance boot up to three times slower on a
// loaded machine (docs/performance.md, "The cold claim against upstream's").
// An unreadable stat counts as a terminal.
//
// Whether spawnd has a terminal is read once, at its first spawn: spawnd
// opens no terminal, so it cannot gain one, and one it loses later only
// keeps its instances in sessions of their own, the cautious side.
func ownSession(cred *syscall.Credential) bool {
	return cred != nil || hasTerminal()
}

var hasTerminal = sync.OnceValue(func() bool {
	st, err := readProcStat(os.Getpid())
	return err != nil || st.tty != 0
})

// devNull is every instance's stdin, opened once for spawnd's life rather
// than per spawn (the child gets its own copy; spawnd's is close-on-exec).
var devNull = sync.OnceValues(func() (*os.File, error) { return openFile(os.DevNull, os.O_RDONLY, 0) })

// openFile is os.OpenFile (close-on-exec, never a controlling terminal, the
// same *PathError) without its try at registering a regular file with the
// runtime's poller, which the kernel refuses, four system calls spent: a
// spawn opens two files on the claim's path (the config and the log).
func openFile(path string, flag int, perm uint32) (*os.File, error) {
	fd, err := unix.Open(path, flag|unix.O_CLOEXEC|unix.O_NOCTTY, perm)
	for err == unix.EINTR {
		fd, err = unix.Open(path, flag|unix.O_CLOEXEC|unix.O_NOCTTY, perm)
	}
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	return os.NewFile(uintptr(fd), path), nil
}

// startProcess execs argv, with no_new_privs when noNewPrivs, from the
// caller's thread when its flag is the one wanted: a Spawn lane's thread
// has it (SetNoNewPrivs), so a claim's exec takes no hand-off to another
// thread; and every thread has it when spawnd was started with it (as the
// deploy unit starts it). Otherwise (an entry with
// allow_privilege_escalation, on a lane's thread; a caller that is no
// lane) the exec runs on a goroutine of its own: one whose thread lacks
// the flag, since only a locked thread is ever given it, or one that locks
// its thread and sets it, the thread ending with the goroutine (about
// 170 µs of CPU, off the claim's path).
func startProcess(argv []string, attr *syscall.ProcAttr, noNewPrivs bool) (int, error) {
	exec := func() (int, error) {
		pid, _, err := syscall.StartProcess(argv[0], argv, attr)
		return pid, err
	}
	if startedWithNNP {
		return exec()
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if threadHasNNP() == noNewPrivs {
		return exec()
	}
	type result struct {
		pid int
		err error
	}
	done := make(chan result, 1)
	go func() {
		if noNewPrivs {
			runtime.LockOSThread() // never unlocked: the thread ends with this goroutine
			if err := SetNoNewPrivs(); err != nil {
				done <- result{0, err}
				return
			}
		}
		pid, err := exec()
		done <- result{pid, err}
	}()
	r := <-done
	return r.pid, r.err
}

// startedWithNNP says whether spawnd was started with no_new_privs. The
// flag is per thread and inherited by every thread cloned from one that has
// it, so it is read once, at package initialisation, on the main thread and
// before a thread of its own is given it.
var startedWithNNP = threadHasNNP()

// threadHasNNP says whether the calling thread has no_new_privs.
func threadHasNNP() bool {
	v, err := unix.PrctlRetInt(unix.PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0)
	return err == nil && v == 1
}

// SetNoNewPrivs sets no_new_privs on the calling thread, which must stay
// locked to its goroutine and end with it: each Spawn lane's
// (spawnrpc.ServeOptions.SpawnThread), whose execs then inherit the flag
// without a hand-off, and startProcess's own. The flag is per thread,
// inherited by what the thread clones, and never cleared; the runtime
// starts the threads a locked goroutine needs from a clean template
// thread, never by cloning it.
func SetNoNewPrivs() error {
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("prctl(PR_SET_NO_NEW_PRIVS): %w", err)
	}
	return nil
}

// sealInheritedFDs marks every descriptor spawnd inherited (3 and up)
// close-on-exec, so none reaches an instance; what spawnd opens itself is
// born close-on-exec (Go's os package, Pipe2, pidfds).
func sealInheritedFDs() error {
	names, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return fmt.Errorf("listing inherited descriptors: %w; nexus-spawnd needs /proc mounted", err)
	}
	for _, de := range names {
		fd, err := strconv.Atoi(de.Name())
		if err != nil || fd < 3 {
			continue
		}
		// EBADF is the directory handle ReadDir has closed since.
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_SETFD, unix.FD_CLOEXEC); err != nil && err != unix.EBADF {
			return fmt.Errorf("marking inherited descriptor %d close-on-exec: %w", fd, err)
		}
	}
	return nil
}

// writeConfig writes the claim's config 0600, owned by the run_as uid when
// there is one, so no other run_as user can read it.
func writeConfig(path string, config []byte, cred *syscall.Credential) error {
	f, err := openFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("writing temp config: %w", err)
	}
	if cred != nil {
		err = f.Chown(int(cred.Uid), int(cred.Gid))
	}
	if err == nil {
		_, err = f.Write(config)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		_ = os.Remove(path)
		return fmt.Errorf("writing temp config: %w", err)
	}
	return nil
}

// workingDir is the spawn's HOME when that is a directory, else "/" (nobody's
// home is /nonexistent; it stays HOME, as the spec says).
func workingDir(home string) string {
	if info, err := os.Stat(home); home != "" && err == nil && info.IsDir() {
		return home
	}
	return "/"
}

// supervise has the exit watch call supervised when the instance's leader
// exits or spawnd closes. It holds one count of d.wg until then, and no
// goroutine.
func (d *Daemon) supervise(l *lease) {
	err := d.exits.add(l.pidfd, func(exited bool, err error) { go d.supervised(l, exited, err) })
	if err != nil {
		d.supervised(l, false, err)
	}
}

// supervised kills what is left of an exited instance, reaps it (when spawnd
// is its parent) and publishes its exit; on Close (or a failed watch) it
// leaves the instance running.
func (d *Daemon) supervised(l *lease, exited bool, err error) {
	defer d.wg.Done()
	if !exited {
		if err != nil {
			d.log.Error("supervising instance failed; its exit will not be reported", "lease_id", l.rec.LeaseID, "pid", l.rec.PID, "error", err)
		}
		// Under d.mu, so an escalation never signals through a closed pidfd.
		d.mu.Lock()
		_ = unix.Close(l.pidfd)
		l.pidfd = -1
		d.mu.Unlock()
		return
	}

	if l.sandboxed {
		d.drainSandbox(l)
	}
	d.mu.Lock()
	if l.inCgroup {
		_ = d.cgroups.signal(l.rec.LeaseID, unix.SIGKILL)
	} else if !l.adopted {
		// The leader has exited but is unreaped, so its pid, the group's
		// id, cannot have been reused. Marking the lease gone under the
		// same lock, before the reap, keeps an escalation from signalling
		// the group after.
		_ = unix.Kill(-l.rec.PID, unix.SIGKILL)
	}
	terminated := l.state == stateTerminating
	l.state = stateGone
	delete(d.leases, l.rec.LeaseID)
	pidfd := l.pidfd
	l.pidfd = -1
	rec := l.snapshot()
	d.mu.Unlock()

	var ws unix.WaitStatus
	known := false
	if l.adopted {
		// The status first: init may reap the leader at any moment.
		ws, known = adoptedStatus(rec)
		if !l.inCgroup {
			if n, err := killGroupRemains(rec.PID, l.sid, rec.StartTime); err != nil {
				d.log.Error("killing what is left of an adopted instance's process group failed", "lease_id", rec.LeaseID, "pid", rec.PID, "killed", n, "error", err)
			}
		}
	} else {
		var err error
		if ws, err = reap(rec.PID); err != nil {
			d.log.Error("reaping instance failed", "lease_id", rec.LeaseID, "pid", rec.PID, "error", err)
		}
		known = err == nil
	}
	_ = unix.Close(pidfd)
	if l.inCgroup {
		if err := d.removeCgroup(rec.LeaseID); err != nil {
			rec.CgroupLeft = err.Error()
		}
	}
	d.removeConfig(l.configPath)
	ev := &spawnpb.ExitEvent{LeaseId: rec.LeaseID, Pid: int64(rec.PID), ExitCode: -1, Terminated: terminated}
	switch {
	case !known:
	case ws.Exited():
		ev.ExitCode = int32(ws.ExitStatus())
	case ws.Signaled():
		ev.Signal = unix.SignalName(ws.Signal())
	}
	if !terminated {
		rec.Reason = reasonCrashed
		ev.LogPath = d.logFor(rec.LeaseID)
		ev.OutputTail = outputTail(ev.LogPath)
	}
	if d.stateLock == nil {
		// Without a state_dir the log is in spawnd's temp directory: it
		// goes with its lease (its tail went out with the exit event).
		_ = os.Remove(d.logFor(rec.LeaseID))
		ev.LogPath = ""
	}
	_ = d.journal.Put(journalLine{kindEnded, rec})
	d.dropRelease(rec.LeaseID)
	d.log.Info("instance exited", "lease_id", rec.LeaseID, "entry", rec.Entry, "pid", rec.PID, "adopted", l.adopted,
		"exit_code", ev.ExitCode, "signal", ev.Signal, "terminated", terminated, "reason", rec.Reason)
	d.watchers.publish(ev)
	l.exit = ev
	close(l.gone)
}

// removeCgroup removes a lease's cgroup once it is empty. One that does not
// empty within cgroupDrainLimit (a member in uninterruptible sleep) is an
// ERROR, its removal retried until spawnd closes (the next boot's sweep
// finishes it), and the reason returned for the ended record.
func (d *Daemon) removeCgroup(id string) error {
	err := d.cgroups.remove(id, cgroupDrainLimit)
	if err == nil {
		return nil
	}
	first := err
	d.log.Error("lease cgroup did not empty; the lease is closed and the cgroup's removal is retried", "lease_id", id, "error", err)
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		for err != nil {
			select {
			case <-d.closing:
				return
			case <-time.After(cgroupRetryEvery):
			}
			err = d.cgroups.remove(id, 0)
		}
		d.log.Info("lease cgroup removed after all", "lease_id", id)
	}()
	return first
}

// drainSandbox gives the engine inside a sandboxed lease's exited leader
// up to termGrace to exit before supervised SIGKILLs what is left of the
// group (or cgroup). bwrap, the leader, does not forward signals: release's
// SIGTERM to the group ends it at once while the engine, another member,
// is still acting on it (flushing its session); an immediate SIGKILL would
// make the SIGTERM stage a SIGKILL.
//
// The leader stays unreaped (supervised reaps it after), so its pid, the
// group's id, cannot be reused while this waits: members found by it are
// the instance's. d.mu is not held: the lease is still listed, and an
// escalation may still signal the group, safely for the same reason.
func (d *Daemon) drainSandbox(l *lease) {
	drained, err := drainGroup(l.rec.PID, termGrace)
	switch {
	case err != nil:
		d.log.Error("waiting for the sandboxed instance's processes failed; killing them", "lease_id", l.rec.LeaseID, "pid", l.rec.PID, "error", err)
	case !drained:
		d.log.Warn("the sandboxed instance's processes did not exit within term_grace of bwrap's exit; killing them", "lease_id", l.rec.LeaseID, "pid", l.rec.PID, "term_grace", termGrace.String())
	}
}

// drainGroup waits up to limit for every live member of process group pgid
// to exit, and reports whether they did. It only watches, never signals:
// it scans /proc for the members, waits on their pidfds until one exits,
// and scans again (a member may have forked).
func drainGroup(pgid int, limit time.Duration) (bool, error) {
	deadline := time.Now().Add(limit)
	live := func(st procStat) bool { return st.pgid == pgid && st.state != 'Z' && st.state != 'X' }
	for {
		members, err := scanProcs(live)
		if err != nil || len(members) == 0 {
			return err == nil, err
		}
		if !time.Now().Before(deadline) {
			return false, nil
		}
		fds := make([]unix.PollFd, 0, len(members))
		for pid := range members {
			if fd, err := unix.PidfdOpen(pid, 0); err == nil {
				fds = append(fds, unix.PollFd{Fd: int32(fd), Events: unix.POLLIN})
			}
		}
		err = pollUntil(fds, deadline)
		for _, f := range fds {
			_ = unix.Close(int(f.Fd))
		}
		if err != nil {
			return false, fmt.Errorf("waiting on the process group's pidfds: %w", err)
		}
	}
}

// pollUntil polls fds until one is ready or the deadline passes.
func pollUntil(fds []unix.PollFd, deadline time.Time) error {
	for left := time.Until(deadline); len(fds) > 0 && left > 0; left = time.Until(deadline) {
		if _, err := unix.Poll(fds, int((left+time.Millisecond-1)/time.Millisecond)); err != unix.EINTR {
			return err
		}
	}
	return nil
}

func reap(pid int) (unix.WaitStatus, error) {
	var ws unix.WaitStatus
	for {
		if _, err := unix.Wait4(pid, &ws, 0, nil); err != unix.EINTR {
			return ws, err
		}
	}
}

// escalate tears a terminating lease down: release_grace for the instance
// to act on the gateway's shutdown frame (unless skipped: no socket sent
// one), SIGTERM, termGrace, SIGKILL; it stops once the instance is gone or
// spawnd closes.
func (d *Daemon) escalate(l *lease, skipGrace bool, grace time.Duration) {
	defer d.wg.Done()
	group := "process group"
	if l.inCgroup {
		group = "cgroup"
	}
	msg := "instance did not exit within release_grace; sending SIGTERM to its " + group
	if skipGrace {
		msg = "release_grace skipped: no socket could have asked the instance to stop; sending SIGTERM to its " + group
	} else if d.settled(l, grace) {
		return
	}
	d.signalGroup(l, unix.SIGTERM, msg, "release_grace", grace.String())
	if d.settled(l, termGrace) {
		return
	}
	d.signalGroup(l, unix.SIGKILL, "instance did not exit after SIGTERM; sending SIGKILL to its "+group, "term_grace", termGrace.String())
}

// settled waits up to wait for the lease to be gone or spawnd to close, and
// reports whether either happened.
func (d *Daemon) settled(l *lease, wait time.Duration) bool {
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-l.gone:
		return true
	case <-d.closing:
		return true
	case <-t.C:
		return false
	}
}

// signalGroup signals a terminating lease's group, then logs msg. The state
// check and the kill happen under d.mu, as supervised's do, so a group is
// never signalled once its leader may have been reaped.
//
// init reaps an adopted leader, so the state check cannot pin its group id:
// the leader is signalled through its pidfd, and only when that succeeds,
// proving it still holds its pid and so the group id, is the group
// signalled. Once it is gone its supervisor kills the rest
// (killGroupRemains).
func (d *Daemon) signalGroup(l *lease, sig unix.Signal, msg string, attrs ...any) {
	d.mu.Lock()
	live := l.state == stateTerminating && l.pidfd >= 0
	var err error
	switch {
	case !live:
	case l.inCgroup:
		err = d.cgroups.signal(l.rec.LeaseID, sig)
	case !l.adopted:
		err = unix.Kill(-l.rec.PID, sig)
	case unix.PidfdSendSignal(l.pidfd, sig, nil, 0) == nil:
		err = unix.Kill(-l.rec.PID, sig)
	default:
		live = false
	}
	rec := l.rec
	d.mu.Unlock()
	if !live {
		return
	}
	d.log.Warn(msg, append([]any{"lease_id", rec.LeaseID, "pid", rec.PID, "reason", rec.Reason}, attrs...)...)
	if err != nil {
		d.log.Error("signalling the instance's process group failed", "lease_id", rec.LeaseID, "signal", unix.SignalName(sig), "error", err)
	}
}

// outputTailBytes bounds the output an exit event carries.
const outputTailBytes = 2 << 10

// outputTail is the end of an instance's log, escaped as a Go string
// literal's body, so it can be quoted in a log line but never start one.
func outputTail(path string) string {
	f, err := safedir.OpenFile(path, os.O_RDONLY, 0)
	if err != nil {
		return ""
	}
	defer f.Close()
	var off int64
	if st, err := f.Stat(); err == nil {
		off = max(0, st.Size()-outputTailBytes)
	}
	data, _ := io.ReadAll(io.NewSectionReader(f, off, outputTailBytes))
	q := strconv.Quote(string(data))
	return q[1 : len(q)-1]
}
