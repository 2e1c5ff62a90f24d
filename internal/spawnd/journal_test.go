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

// TestJournalWriteFailuresNeverFailAVerb: a journal that cannot be written
// (here: the descriptor it appends to replaced by a read-only one of the same
// file) is logged at ERROR, and Spawn, Record and Terminate all still succeed.
func TestJournalWriteFailuresNeverFailAVerb(t *testing.T) {
	h := newHarness(t, defaultYAML)
	path := filepath.Join(h.stateDir, journalFile)
	ro, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	fds, _ := os.ReadDir("/proc/self/fd")
	swapped := false
	for _, de := range fds {
		fd, _ := strconv.Atoi(de.Name())
		if target, _ := os.Readlink("/proc/self/fd/" + de.Name()); target == path && fd != int(ro.Fd()) {
			if err := unix.Dup3(int(ro.Fd()), fd, unix.O_CLOEXEC); err != nil {
				t.Fatal(err)
			}
			swapped = true
		}
	}
	if !swapped {
		t.Fatalf("no descriptor of this process is open on %s", path)
	}

	h.spawn("lease-w", "nexus") // fails the test if Spawn fails
	h.logs.await(t, "appending to the lease journal failed; the lease goes on, but a nexus-spawnd restart may not re-adopt its instance", "key", "lease-w")
	if _, err := h.client.Record(h.ctx(), &spawnpb.RecordRequest{LeaseId: "lease-w", SessionId: "s"}); err != nil {
		t.Fatalf("Record failed with the journal unwritable: %v", err)
	}
	if _, err := h.terminate("lease-w", "manual release", true); err != nil {
		t.Fatalf("Terminate failed with the journal unwritable: %v", err)
	}
}
