package spawnd

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/nexus-broker/nexus-broker/internal/spawnproof"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// restartWithLive stops the harness's Daemon while lease id's instance runs,
// checks the journal still holds the lease as live, and boots a new Daemon
// on the same state_dir, which must re-adopt it.
func (h *harness) restartWithLive(id string) {
	h.t.Helper()
	h.stop()
	_, recs := journalLines(h.t, filepath.Join(h.stateDir, journalFile))
	if got := linesOf(recs, id); len(got) == 0 || got[len(got)-1].Kind == kindEnded {
		h.t.Fatalf("after Close the journal's records of %s are %+v; Close must leave a live lease live", id, got)
	}
	h.start()
	h.logs.await(h.t, "instance re-adopted", "lease_id", id)
}

// TestRestartReadoptsAndTerminates: a new Daemon on the same state_dir
// lists the surviving instance as adopted, verifies its secret, refuses its
// lease id to Spawn, and Terminate takes its whole group, including a
// grandchild that ignores SIGTERM, with the exit published on Watch.
func TestRestartReadoptsAndTerminates(t *testing.T) {
	h := newHarness(t, withGrace("1h"))
	resp, f := h.spawn("lease-keep", "family")
	grandchild := pidfdOf(t, f.report.Grandchild)
	secret := f.env()["NEXUS_BROKER_SPAWN_SECRET"]
	if _, err := h.client.Record(h.ctx(), &spawnpb.RecordRequest{LeaseId: "lease-keep", SessionId: "sess-keep"}); err != nil {
		t.Fatal(err)
	}
	configPath := filepath.Join(h.d.configDir, "lease-keep.yaml")

	h.restartWithLive("lease-keep")
	list, err := h.client.List(h.ctx(), &spawnpb.ListRequest{})
	if err != nil {
		t.Fatal(err)
	}
	want := &spawnpb.Lease{LeaseId: "lease-keep", Principal: "alice", SessionId: "sess-keep", Entry: "family",
		Pid: resp.Pid, CreatedUnixNano: resp.CreatedUnixNano, Adopted: true, Verifier: resp.Verifier}
	if len(list.Leases) != 1 || !proto.Equal(list.Leases[0], want) {
		t.Fatalf("List after the restart = %v, want %v", list.Leases, want)
	}
	// Derived again from the spawn-key, never journaled: the restarted
	// gateway checks the adopted instance's register frames with it.
	if !spawnproof.Matches(list.Leases[0].Verifier, secret) {
		t.Fatal("the adopted lease's verifier does not match its instance's secret")
	}
	for _, tc := range []struct {
		secret string
		want   spawnpb.VerifyResult
	}{
		{secret, spawnpb.VerifyResult_VERIFY_RESULT_OK},
		{strings.Repeat("0", len(secret)), spawnpb.VerifyResult_VERIFY_RESULT_WRONG_SECRET},
	} {
		v, err := h.client.Verify(h.ctx(), &spawnpb.VerifyRequest{LeaseId: "lease-keep", Secret: tc.secret})
		if err != nil || v.Result != tc.want {
			t.Errorf("Verify of the adopted lease = %v (%v), want %v", v.GetResult(), err, tc.want)
		}
	}
	_, err = h.client.Spawn(h.ctx(), &spawnpb.SpawnRequest{LeaseId: "lease-keep", Entry: "nexus"})
	if status.Code(err) != codes.AlreadyExists {
		t.Errorf("Spawn of an adopted lease id = %v, want AlreadyExists", err)
	}

	stream := h.watch()
	ev, err := h.terminate("lease-keep", "manual release", true)
	if err != nil {
		t.Fatal(err)
	}
	// The test process is still the instance's parent and never reaps it,
	// so its status is there to read.
	wantExit := &spawnpb.ExitEvent{LeaseId: "lease-keep", Pid: resp.Pid, ExitCode: -1, Signal: "SIGTERM", Terminated: true}
	if !proto.Equal(ev, wantExit) {
		t.Errorf("Terminate = %v, want %v", ev, wantExit)
	}
	if got := h.nextExit(stream); !proto.Equal(got, wantExit) {
		t.Errorf("Watch = %v, want %v", got, wantExit)
	}
	awaitGone(t, grandchild)
	_, recs := journalLines(t, filepath.Join(h.stateDir, journalFile))
	if got := linesOf(recs, "lease-keep"); got[len(got)-1].Kind != kindEnded || got[len(got)-1].Reason != "manual release" {
		t.Errorf("last journal record = %+v, want ended, manual release", got[len(got)-1])
	}
	if _, err := os.Stat(configPath); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the adopted instance's temp config is still there: %v", err)
	}
	if _, err := os.Stat(filepath.Dir(configPath)); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the previous nexus-spawnd's empty temp directory is still there: %v", err)
	}
}

// TestAdoptedInstanceExitIsPublished: an adopted instance that exits on its
// own takes its group with it, and its exit reaches Watch and the journal.
func TestAdoptedInstanceExitIsPublished(t *testing.T) {
	h := newHarness(t, defaultYAML)
	resp, f := h.spawn("lease-crash", "family")
	grandchild := pidfdOf(t, f.report.Grandchild)
	h.restartWithLive("lease-crash")
	stream := h.watch()
	f.send("exit 7")
	// It exited on its own: the event says where its output is and how it
	// ends, escaped.
	want := &spawnpb.ExitEvent{LeaseId: "lease-crash", Pid: resp.Pid, ExitCode: 7,
		LogPath: filepath.Join(h.stateDir, "logs", "lease-crash.log"), OutputTail: `fake instance started\n`}
	if ev := h.nextExit(stream); !proto.Equal(ev, want) {
		t.Errorf("exit = %v, want %v", ev, want)
	}
	awaitGone(t, grandchild)
	h.logs.await(t, "instance exited", "lease_id", "lease-crash", "adopted", true, "reason", reasonCrashed)
	_, recs := journalLines(t, filepath.Join(h.stateDir, journalFile))
	if got := linesOf(recs, "lease-crash"); got[len(got)-1].Kind != kindEnded || got[len(got)-1].Reason != reasonCrashed {
		t.Errorf("last journal record = %+v, want ended, crashed", got[len(got)-1])
	}
	list, err := h.client.List(h.ctx(), &spawnpb.ListRequest{})
	if err != nil || len(list.Leases) != 0 {
		t.Errorf("List = %v (%v), want no lease", list, err)
	}
}

// TestTornJournalTailAfterAKill: a record half-written when spawnd was
// killed is skipped with a WARN naming its line, and the lease before it is
// re-adopted all the same.
func TestTornJournalTailAfterAKill(t *testing.T) {
	h := newHarness(t, defaultYAML)
	_, f := h.spawn("lease-survivor", "nexus")
	h.stop()
	path := filepath.Join(h.stateDir, journalFile)
	raw, _ := journalLines(t, path)
	half := raw[len(raw)-1][:len(raw[len(raw)-1])/2]
	jf, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := jf.WriteString(half); err != nil {
		t.Fatal(err)
	}
	jf.Close()

	h.start()
	h.logs.await(t, "skipping a lease journal line that is not a whole record (torn by a crash mid-write, or edited)", "line", len(raw)+1)
	h.logs.await(t, "instance re-adopted", "lease_id", "lease-survivor")
	if raw, _ := journalLines(t, path); len(raw) != 1 {
		t.Errorf("journal after the compaction at open = %q, want the one live lease", raw)
	}
	stream := h.watch()
	f.send("exit 0")
	if ev := h.nextExit(stream); ev.LeaseId != "lease-survivor" || ev.ExitCode != 0 {
		t.Errorf("exit = %v, want lease-survivor code 0", ev)
	}
}

// stranger is a process the test starts itself, in its own group, standing
// in for whoever holds a journaled pid after spawnd was down.
func stranger(t *testing.T) (pid int, start uint64) {
	t.Helper()
	cmd := exec.Command("sleep", "1000")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	st, err := readProcStat(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	return cmd.Process.Pid, st.startTime
}

// untouched fails the test unless pid is alive with no signal pending.
func untouched(t *testing.T, pid int) {
	t.Helper()
	fd := pidfdOf(t, pid)
	if n, _ := unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}, 0); n != 0 {
		t.Fatalf("pid %d has exited", pid)
	}
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(data)) {
		if k, v, _ := strings.Cut(line, ":"); (k == "SigPnd" || k == "ShdPnd") && strings.Trim(strings.TrimSpace(v), "0") != "" {
			t.Errorf("pid %d has a signal pending: %s", pid, strings.TrimSpace(line))
		}
	}
	if st, err := readProcStat(pid); err != nil || st.state == 'T' {
		t.Errorf("pid %d is stopped or unreadable (%v)", pid, err)
	}
}

// TestRecoveryProvesIdentity: journaled leases whose pid is gone, whose pid
// now belongs to another process, which were journaled under another boot,
// or which never got a pid are closed out with their reason, and no process
// is signalled; another broker's record is left exactly as it was, even
// though its pid and start time match a live process.
func TestRecoveryProvesIdentity(t *testing.T) {
	h := newHarness(t, defaultYAML)
	brokerID, bootID := h.d.brokerID, h.d.bootID
	h.stop()

	pid, start := stranger(t)
	oldConfigDir, err := os.MkdirTemp("", configDirPrefix)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(oldConfigDir) })
	oldConfig := filepath.Join(oldConfigDir, "lease-recycled.yaml")
	if err := os.WriteFile(oldConfig, []byte("core: {}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	// Its spawnd, killed with -9, left its lock free.
	if err := os.WriteFile(filepath.Join(oldConfigDir, configLockFile), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	// Linux never hands out a pid at or above pid_max, whose ceiling is 2^22.
	const impossiblePID = 1<<22 + 1
	ours := func(id string, pid int, start uint64, boot string) leaseRecord {
		rec := testRecord(id)
		rec.BrokerID, rec.PID, rec.StartTime, rec.BootID = brokerID, pid, start, boot
		return rec
	}
	recycled := ours("lease-recycled", pid, start+1, bootID)
	recycled.ConfigPath = oldConfig
	cases := []struct {
		rec    leaseRecord
		reason string
	}{
		{recycled, reasonIdentityMismatch},
		{ours("lease-rebooted", pid, start, "another-boot"), reasonIdentityMismatch},
		{ours("lease-gone", impossiblePID, start, bootID), reasonPidGone},
		{ours("lease-unstarted", 0, 0, ""), reasonNeverStarted},
	}
	var file strings.Builder
	// Another broker's line, spelled as no encoder here would spell it.
	foreign := fmt.Sprintf(`{"broker_id":"broker-elsewhere",  "kind":"started","lease_id":"lease-foreign","entry":"nexus","pid":%d,"start_time":%d,"boot_id":%q,"created_at":"2020-01-01T00:00:00Z","x-note":"kept"}`,
		pid, start, bootID)
	file.WriteString(foreign + "\n")
	for _, c := range cases {
		line, _ := json.Marshal(journalLine{kindStarted, c.rec})
		file.Write(append(line, '\n'))
	}
	path := filepath.Join(h.stateDir, journalFile)
	if err := os.WriteFile(path, []byte(file.String()), 0o600); err != nil {
		t.Fatal(err)
	}

	h.start()
	for _, c := range cases {
		h.logs.await(t, "journaled lease closed out; its process was not signalled", "lease_id", c.rec.LeaseID, "reason", c.reason)
	}
	untouched(t, pid)
	list, err := h.client.List(h.ctx(), &spawnpb.ListRequest{})
	if err != nil || len(list.Leases) != 0 {
		t.Errorf("List = %v (%v), want nothing adopted", list, err)
	}
	raw, recs := journalLines(t, path)
	if raw[0] != foreign {
		t.Errorf("another broker's record became\n%s\nwant it byte for byte\n%s", raw[0], foreign)
	}
	// Compacted at open, then closed out: the live line, then its end.
	for _, c := range cases {
		if got := linesOf(recs, c.rec.LeaseID); len(got) != 2 || got[1].Kind != kindEnded || got[1].Reason != c.reason {
			t.Errorf("journal records of %s = %+v, want its record and then an ended one, reason %q", c.rec.LeaseID, got, c.reason)
		}
	}
	if _, err := os.Stat(oldConfigDir); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the closed-out lease's temp config (and its emptied directory) is still there: %v", err)
	}
	for _, c := range cases {
		if _, err := h.client.Spawn(h.ctx(), &spawnpb.SpawnRequest{LeaseId: c.rec.LeaseID, Entry: "nexus"}); status.Code(err) != codes.AlreadyExists {
			t.Errorf("Spawn of closed-out %s = %v, want AlreadyExists", c.rec.LeaseID, err)
		}
	}

	// The next boot compacts the closed-out leases away and keeps the
	// foreign line as it was.
	h.stop()
	h.start()
	if raw, _ := journalLines(t, path); !slices.Equal(raw, []string{foreign}) {
		t.Errorf("journal after the next boot = %q, want only the foreign line", raw)
	}
	untouched(t, pid)
}

// TestAStartingSpawndRemovesOnlyDeadEmptyConfigDirs: a temp-config
// directory a spawnd killed with -9 left (its lock free, nothing but the
// lock and empty logs in it) is removed by the next spawnd to start; a live
// spawnd's, one holding a config, one without a lock, a symlink, and one
// another uid planted are not.
func TestAStartingSpawndRemovesOnlyDeadEmptyConfigDirs(t *testing.T) {
	root := worldDir(t)
	t.Setenv("TMPDIR", root)
	live := newHarness(t, defaultYAML)
	plant := func(name string, files ...string) string {
		dir := filepath.Join(root, configDirPrefix+name)
		if err := os.MkdirAll(filepath.Join(dir, "logs"), 0o700); err != nil {
			t.Fatal(err)
		}
		for _, f := range files {
			if err := os.WriteFile(filepath.Join(dir, f), nil, 0o600); err != nil {
				t.Fatal(err)
			}
		}
		return dir
	}
	dead := plant("dead", configLockFile)
	full := plant("full", configLockFile, "lease-x.yaml")
	nolock := plant("nolock")
	target := filepath.Join(t.TempDir(), "target")
	if err := os.Mkdir(target, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(target, configLockFile), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(root, configDirPrefix+"link")
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
	// The attacker's, planted as uid 65534.
	other := filepath.Join(root, configDirPrefix+"other")
	if out, err := exec.Command("setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
		"sh", "-c", `mkdir "$1" && : > "$1/`+configLockFile+`"`, "sh", other).CombinedOutput(); err != nil {
		t.Fatalf("planting as uid 65534: %v %s", err, out)
	}

	next := newHarness(t, defaultYAML)
	if _, err := os.Stat(dead); !os.IsNotExist(err) {
		t.Errorf("the dead spawnd's empty directory was not removed: %v", err)
	}
	for _, dir := range []string{live.d.configDir, next.d.configDir, full, nolock, link, target, other} {
		if _, err := os.Lstat(dir); err != nil {
			t.Errorf("%s was removed: %v", dir, err)
		}
	}
	if _, err := os.Stat(filepath.Join(target, configLockFile)); err != nil {
		t.Errorf("the symlink's target lost its lock: %v", err)
	}
	liveDir := live.d.configDir
	live.stop()
	if _, err := os.Stat(liveDir); !os.IsNotExist(err) {
		t.Errorf("a spawnd's own directory outlived its Close: %v", err)
	}
}
