package spawnd

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nexus-broker/nexus-broker/internal/bindindex"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// journalLines reads a journal file as its lines (without newlines) and,
// for each, the record it holds (the zero journalLine for a bad line).
func journalLines(t testing.TB, path string) ([]string, []journalLine) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var raw []string
	var recs []journalLine
	for line := range strings.Lines(string(data)) {
		line = strings.TrimSuffix(line, "\n")
		var jl journalLine
		_ = json.Unmarshal([]byte(line), &jl)
		raw = append(raw, line)
		recs = append(recs, jl)
	}
	return raw, recs
}

// linesOf is the records of one lease, in file order.
func linesOf(recs []journalLine, id string) []journalLine {
	var out []journalLine
	for _, r := range recs {
		if r.LeaseID == id {
			out = append(out, r)
		}
	}
	return out
}

// TestJournalRecordsEveryTransition: minted, started, recorded and ended,
// each carrying the whole lease, each on disk by the time its verb returns,
// and none carrying the secret.
func TestJournalRecordsEveryTransition(t *testing.T) {
	h := newHarness(t, "advertise_addr: broker-1.example.com:9090\n"+defaultYAML)
	path := filepath.Join(h.stateDir, journalFile)
	resp, _ := h.spawn("lease-j", "nexus")
	_, recs := journalLines(t, path)
	if got := linesOf(recs, "lease-j"); len(got) != 2 || got[0].Kind != kindMinted || got[1].Kind != kindStarted {
		t.Fatalf("after Spawn returned the journal holds %+v, want minted and started", got)
	}
	if _, err := h.client.Record(h.ctx(), &spawnpb.RecordRequest{LeaseId: "lease-j", SessionId: "sess-j"}); err != nil {
		t.Fatal(err)
	}
	if _, err := h.terminate("lease-j", "idle", true); err != nil {
		t.Fatal(err)
	}

	_, recs = journalLines(t, path)
	got := linesOf(recs, "lease-j")
	if len(got) != 4 || got[1].StartTime == 0 {
		t.Fatalf("journal records of lease-j = %+v, want minted, started (with a start_time), recorded, ended", got)
	}
	base := leaseRecord{
		LeaseID:       "lease-j",
		Principal:     "alice",
		Entry:         "nexus",
		CreatedAt:     time.Unix(0, resp.CreatedUnixNano).UTC(),
		BrokerID:      h.d.brokerID,
		AdvertiseAddr: "broker-1.example.com:9090",
		ConfigPath:    filepath.Join(h.d.configDir, "lease-j.yaml"),
	}
	started := base
	started.PID, started.StartTime, started.BootID = int(resp.Pid), got[1].StartTime, h.d.bootID
	recorded := started
	recorded.SessionID = "sess-j"
	ended := recorded
	ended.Reason = "idle"
	want := []journalLine{{kindMinted, base}, {kindStarted, started}, {kindRecorded, recorded}, {kindEnded, ended}}
	for i := range want {
		g, w := got[i], want[i]
		g.seq = 0
		if !g.CreatedAt.Equal(w.CreatedAt) {
			t.Errorf("record %d created_at = %v, want %v", i, g.CreatedAt, w.CreatedAt)
		}
		g.CreatedAt = w.CreatedAt
		if g != w {
			t.Errorf("record %d = %+v\nwant %+v", i, g, w)
		}
	}
	data, _ := os.ReadFile(path)
	if bytes.Contains(data, []byte(secretFor(h.d.key, "lease-j"))) {
		t.Error("the journal holds a spawn secret")
	}
	if info, err := os.Stat(path); err != nil || info.Mode().Perm() != 0o600 {
		t.Errorf("journal mode = %v (%v), want 0600", info.Mode().Perm(), err)
	}
}

func testRecord(id string) leaseRecord {
	return leaseRecord{
		LeaseID:   id,
		Principal: "alice",
		Entry:     "nexus",
		CreatedAt: time.Now().UTC(),
		BrokerID:  "b-test",
	}
}

// appendLifecycle appends rec's kinds in order, numbering them as
// lease.snapshot would.
func appendLifecycle(j *bindindex.Index[journalLine], rec leaseRecord, kinds ...recordKind) {
	for _, k := range kinds {
		rec.seq++
		j.Put(journalLine{k, rec})
	}
}

func openTestJournal(t testing.TB, dir string) (*bindindex.Index[journalLine], []leaseRecord, *logBuffer) {
	t.Helper()
	logs := newLogBuffer()
	j, live, err := openJournal(dir, "b-test", slog.New(slog.NewJSONHandler(logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(j.Close)
	return j, live, logs
}

// TestJournalCompactsEvery512Appends counts the file's lines on either side
// of the 512th append, and replays the compacted file.
func TestJournalCompactsEvery512Appends(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, journalFile)
	j, _, _ := openTestJournal(t, dir)
	appendLifecycle(j, testRecord("keep"), kindMinted)
	for i := range (journalCompactEvery - 2) / 2 {
		appendLifecycle(j, testRecord(fmt.Sprint("churn-", i)), kindMinted, kindEnded)
	}
	if raw, _ := journalLines(t, path); len(raw) != journalCompactEvery-1 {
		t.Fatalf("after %d appends the journal has %d lines, want one per append", journalCompactEvery-1, len(raw))
	}
	appendLifecycle(j, testRecord("last"), kindMinted)
	raw, recs := journalLines(t, path)
	if len(raw) != 2 || recs[0].LeaseID != "keep" || recs[1].LeaseID != "last" {
		t.Fatalf("after the %dth append the journal is %q, want only the two live leases", journalCompactEvery, raw)
	}
	// Appends go on into the compacted file.
	appendLifecycle(j, testRecord("after"), kindMinted)
	if raw, _ := journalLines(t, path); len(raw) != 3 {
		t.Fatalf("an append after compaction left %d lines, want 3", len(raw))
	}
	j.Close()
	_, live, _ := openTestJournal(t, dir)
	var ids []string
	for _, r := range live {
		ids = append(ids, r.LeaseID)
	}
	if strings.Join(ids, ",") != "keep,last,after" {
		t.Errorf("replayed live leases = %v, want keep, last, after", ids)
	}
}

// TestJournalDropsStaleSnapshots: a snapshot that reaches the journal after
// a newer one of the same lease, or after the lease ended, is not written.
func TestJournalDropsStaleSnapshots(t *testing.T) {
	dir := t.TempDir()
	j, _, _ := openTestJournal(t, dir)
	rec := testRecord("lease-race")
	rec.seq = 1
	j.Put(journalLine{kindMinted, rec})
	rec.seq, rec.SessionID = 3, "newer"
	j.Put(journalLine{kindRecorded, rec})
	rec.seq, rec.SessionID = 2, "older"
	j.Put(journalLine{kindRecorded, rec})
	rec.seq, rec.SessionID, rec.Reason = 4, "newer", "exited"
	j.Put(journalLine{kindEnded, rec})
	rec.seq = 5
	j.Put(journalLine{kindRecorded, rec}) // a Record that raced the exit
	_, recs := journalLines(t, filepath.Join(dir, journalFile))
	var kinds []string
	for _, r := range recs {
		kinds = append(kinds, string(r.Kind)+":"+r.SessionID)
	}
	if got := strings.Join(kinds, " "); got != "minted: recorded:newer ended:newer" {
		t.Errorf("journal = %s, want minted, recorded:newer, ended", got)
	}
}

// TestJournalSkipsCorruptLines: a line torn by a kill mid-write, and one
// that is not a record at all, are skipped with a WARN naming them; the
// rest replays, the compaction at open drops them, and appends start clean.
func TestJournalSkipsCorruptLines(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, journalFile)
	var file bytes.Buffer
	for _, l := range []journalLine{
		{kindMinted, testRecord("lease-a")},
		{kindStarted, testRecord("lease-a")},
	} {
		line, _ := json.Marshal(l)
		file.Write(append(line, '\n'))
	}
	file.WriteString("{\"kind\":\"minted\",\"lease_id\":\"lease-x\"}\n") // no broker_id
	line, _ := json.Marshal(journalLine{kindMinted, testRecord("lease-b")})
	file.Write(append(line, '\n'))
	torn, _ := json.Marshal(journalLine{kindMinted, testRecord("lease-torn")})
	file.Write(torn[:len(torn)/2])
	if err := os.WriteFile(path, file.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}

	j, live, logs := openTestJournal(t, dir)
	for _, n := range []int{3, 5} {
		logs.await(t, "skipping a lease journal line that is not a whole record (torn by a crash mid-write, or edited)", "line", n)
	}
	if len(live) != 2 || live[0].LeaseID != "lease-a" || live[1].LeaseID != "lease-b" {
		t.Fatalf("replayed %+v, want lease-a and lease-b", live)
	}
	appendLifecycle(j, testRecord("lease-c"), kindMinted)
	raw, recs := journalLines(t, path)
	if len(raw) != 3 || recs[2].LeaseID != "lease-c" {
		t.Errorf("journal after open and one append = %q, want lease-a, lease-b, lease-c", raw)
	}
}

// TestStateDirLockRefusesASecondDaemon: a second nexus-spawnd on a state_dir
// in use is refused, naming the holder; once the first is gone it boots.
func TestStateDirLockRefusesASecondDaemon(t *testing.T) {
	h := newHarness(t, defaultYAML)
	_, _, err := boot(t, h.expand(defaultYAML))
	want := fmt.Sprintf("state_dir %s is in use by another nexus-spawnd (pid %d holds %s)", h.stateDir, os.Getpid(), filepath.Join(h.stateDir, stateLockFile))
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("second Daemon on one state_dir: %v, want an error containing %q", err, want)
	}
	h.stop()
	h.start()
}

// BenchmarkJournalAppend measures appends/s with the fsync every append
// pays, on the disk under TMPDIR, against the same appends without it. The
// appends alternate minted and ended, so compaction runs as it would on a
// broker whose leases come and go.
func BenchmarkJournalAppend(b *testing.B) {
	churn := func(j *bindindex.Index[journalLine], n int) {
		rec := testRecord("")
		rec.PID, rec.StartTime, rec.BootID, rec.SessionID = 123456, 987654321, "f5ef28e3-55bc-4056-b9a1-16d413464005", "sess-bench"
		rec.AdvertiseAddr, rec.ConfigPath = "broker-1.example.com:9090", "/tmp/nexus-spawnd-123/lease.yaml"
		for i := range n {
			rec.LeaseID = fmt.Sprint("lease-", i/2)
			rec.seq = uint64(i%2 + 1)
			j.Put(journalLine{[]recordKind{kindMinted, kindEnded}[i%2], rec})
		}
	}
	spec := journalSpec(b.TempDir(), "b-test")
	spec.Durable = false
	idx, err := bindindex.OpenRequired(spec, slog.New(slog.DiscardHandler))
	if err != nil {
		b.Fatal(err)
	}
	defer idx.Close()
	baseline := idx
	const baseN = 100_000
	began := time.Now()
	churn(baseline, baseN)
	baseNs := float64(time.Since(began).Nanoseconds()) / baseN

	j, _, _ := openTestJournal(b, b.TempDir())
	b.ResetTimer()
	churn(j, b.N)
	b.StopTimer()
	ns := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
	b.ReportMetric(1e9/ns, "appends/s")
	b.ReportMetric(baseNs, "nofsync-ns/op")
	b.ReportMetric(ns/baseNs, "fsync-vs-nofsync")
}

// TestAFailedJournalStillTearsDown: with the journal's disk full, Record
// and Terminate still succeed, and the teardown reaches the file through
// the rewrite: the ended lease is not replayed as live.
func TestAFailedJournalStillTearsDown(t *testing.T) {
	h := fullJournal(t, func(*harness) int { return 0 })
	if _, err := h.client.Record(h.ctx(), &spawnpb.RecordRequest{LeaseId: "lease-live", SessionId: "s"}); err != nil {
		t.Fatalf("Record failed with the journal full: %v", err)
	}
	h.logs.await(t, "writing the lease journal failed; new leases are refused until then, while releases and exits go on; it is rewritten from memory once writes work again")
	if st, _ := h.client.Status(h.ctx(), &spawnpb.StatusRequest{}); st.GetJournalError() != "no space left on device" {
		t.Fatalf("Status journal_error = %q", st.GetJournalError())
	}
	if _, err := h.terminate("lease-live", "manual release", true); err != nil {
		t.Fatalf("Terminate failed with the journal full: %v", err)
	}
	if err := os.Remove(filepath.Join(h.stateDir, "filler")); err != nil {
		t.Fatal(err)
	}
	h.logs.await(t, "the lease journal was rewritten from memory after a failed write; appending to it again")
	if _, recs := journalLines(t, filepath.Join(h.stateDir, journalFile)); len(linesOf(recs, "lease-live")) != 0 {
		t.Fatalf("the ended lease is still in the rewritten journal: %v", recs)
	}
}

// fullJournal boots a harness whose state_dir is a small tmpfs, holding
// one live lease, lease-live (so that a rewrite needs a page), sizes the
// journal (through another broker's record, which compaction keeps byte for
// byte) so that room bytes are left in its last page, and fills the rest of
// the tmpfs: the next appends succeed while they fit in that page, and fail
// with ENOSPC after. setup, if any, runs after lease-live's spawn, before
// the sizing.
func fullJournal(t *testing.T, room func(*harness) int, setup ...func(*harness)) *harness {
	t.Helper()
	state := filepath.Join(t.TempDir(), "state")
	if err := os.Mkdir(state, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", state, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "size=256k,mode=0700"); err != nil {
		t.Skipf("mounting a tmpfs needs root: %v", err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(state, unix.MNT_DETACH); err != nil {
			t.Error(err)
		}
	})
	h := newHarnessAt(t, defaultYAML, state)
	h.spawn("lease-live", "nexus")
	for _, f := range setup {
		f(h)
	}
	path := filepath.Join(state, journalFile)
	// Restarts until the compacted journal ends room bytes short of a page.
	pad := 1
	for {
		want := (pageSize - room(h)%pageSize) % pageSize
		st, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		delta := (want - int(st.Size()%pageSize) + pageSize) % pageSize
		if delta == 0 && pad > 1 {
			break
		}
		h.stop()
		data, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		var keep []byte
		for line := range bytes.Lines(data) {
			if !bytes.Contains(line, []byte(`"another-broker"`)) {
				keep = append(keep, line...)
			}
		}
		pad += delta
		other := fmt.Sprintf(`{"kind":"started","lease_id":"other","broker_id":"another-broker","principal":%q}`+"\n", strings.Repeat("x", pad))
		if err := os.WriteFile(path, append(keep, other...), 0o600); err != nil {
			t.Fatal(err)
		}
		h.start()
	}
	filler, err := os.Create(filepath.Join(state, "filler"))
	if err != nil {
		t.Fatal(err)
	}
	defer filler.Close()
	for {
		if _, err := filler.Write(make([]byte, pageSize)); err != nil {
			break
		}
	}
	t.Cleanup(func() { os.Remove(filler.Name()) })
	return h
}

const pageSize = 4096

// mintedLen is the longest minted line (with its newline) of lease id: the
// created_at with all nine digits of nanoseconds.
func (h *harness) mintedLen(id string) int {
	line, _ := json.Marshal(journalLine{kindMinted, leaseRecord{
		LeaseID: id, Principal: "alice", Entry: "nexus", BrokerID: h.d.brokerID, ConfigPath: h.d.configFor(id),
		CreatedAt: time.Date(2026, 1, 1, 0, 0, 0, 123456789, time.UTC),
	}})
	return len(line) + 1
}

// instancesOf lists the live processes of lease id (by their environment).
func instancesOf(id string) []int {
	var pids []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		env, _ := os.ReadFile("/proc/" + e.Name() + "/environ")
		if st, err := readProcStat(pid); err == nil && st.state != 'Z' && bytes.Contains(env, []byte("\x00NEXUS_BROKER_LEASE_ID="+id+"\x00")) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// TestASpawnTheJournalCannotRecordIsRefused: a minted record that does not
// fit refuses the Spawn before exec; a started record that does not fit
// kills the instance it would have recorded. Either way the Spawn fails with
// SPAWN_STEP_JOURNAL, Status says why without a path, the journal is failed
// (no later append goes to the descriptor that failed), and once space
// returns it is rewritten from memory: no trace of the refused lease, and
// Spawn works again.
func TestASpawnTheJournalCannotRecordIsRefused(t *testing.T) {
	for _, tc := range []struct {
		name string
		room func(h *harness) int
		exec bool // whether the instance was started (and must be killed)
	}{
		{"minted record", func(*harness) int { return 0 }, false},
		// The minted line fits; the started one, 70-odd bytes longer, not.
		{"started record", func(h *harness) int { return h.mintedLen("lease-full") + 20 }, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := fullJournal(t, tc.room)
			path := filepath.Join(h.stateDir, journalFile)
			_, err := h.client.Spawn(h.ctx(), &spawnpb.SpawnRequest{LeaseId: "lease-full", Entry: "nexus", Config: []byte("core: {}\n"), Principal: "alice"})
			if stepOf(err) != spawnpb.SpawnStep_SPAWN_STEP_JOURNAL {
				t.Fatalf("Spawn with the journal full = %v, want a SPAWN_STEP_JOURNAL refusal", err)
			}
			if strings.Contains(err.Error(), h.stateDir) {
				t.Fatalf("the refusal names the state_dir: %v", err)
			}
			if got := h.logs.find("spawning instance refused: the lease journal cannot record it; its instance was killed"); (len(got) == 1) != tc.exec {
				t.Fatalf("refusal log lines after killing an instance: %v", got)
			}
			if pids := instancesOf("lease-full"); len(pids) != 0 {
				t.Fatalf("the refused lease's instance runs: %v", pids)
			}
			if _, err := os.Stat(h.d.configFor("lease-full")); !os.IsNotExist(err) {
				t.Fatalf("the refused lease's temp config is left: %v", err)
			}
			st, err := h.client.Status(h.ctx(), &spawnpb.StatusRequest{})
			if err != nil || st.JournalError != "no space left on device" {
				t.Fatalf("Status journal_error = %q, %v", st.GetJournalError(), err)
			}
			list, _ := h.client.List(h.ctx(), &spawnpb.ListRequest{})
			if len(list.GetLeases()) != 1 || list.Leases[0].LeaseId != "lease-live" {
				t.Fatalf("List after the refusal: %v", list.GetLeases())
			}

			if err := os.Remove(filepath.Join(h.stateDir, "filler")); err != nil {
				t.Fatal(err)
			}
			h.logs.await(t, "the lease journal was rewritten from memory after a failed write; appending to it again")
			if st, _ := h.client.Status(h.ctx(), &spawnpb.StatusRequest{}); st.GetJournalError() != "" {
				t.Fatalf("journal_error after the rewrite: %q", st.GetJournalError())
			}
			raw, recs := journalLines(t, path)
			for i, r := range recs {
				if !r.valid() || r.LeaseID == "lease-full" {
					t.Fatalf("rewritten journal line %d: %q", i+1, raw[i])
				}
			}
			h.spawn("lease-after", "nexus")
			if _, recs := journalLines(t, path); len(linesOf(recs, "lease-after")) != 2 {
				t.Fatalf("journal after the rewrite: %v", recs)
			}
		})
	}
}
