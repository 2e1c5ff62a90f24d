package spawnd

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/nexus-broker/nexus-broker/internal/bindindex"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

func (h *harness) binding(session string) string {
	h.t.Helper()
	resp, err := h.client.Binding(h.ctx(), &spawnpb.BindingRequest{SessionId: session})
	if err != nil {
		h.t.Fatalf("Binding(%q): %v", session, err)
	}
	return resp.Entry
}

// resume spawns lease id from entry as a resume of session.
func (h *harness) resume(id, entry, session string) *fakeConn {
	h.t.Helper()
	_, err := h.client.Spawn(h.ctx(), &spawnpb.SpawnRequest{
		LeaseId: id, Entry: entry, Config: []byte("core: {}\n"), RecallSessionId: session,
		Principal: "alice",
	})
	if err != nil {
		h.t.Fatalf("Spawn(%s, %s, resume %s): %v", id, entry, session, err)
	}
	return h.accept()
}

func indexLines(t *testing.T, path string) []string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.Split(strings.TrimSuffix(string(data), "\n"), "\n")
}

// TestBindingIsWrittenOnResumeAndRecord: a resume binds its session when
// spawned, a new session when Record reports it; Binding answers from the
// live lease, then from the index, across a restart too.
func TestBindingIsWrittenOnResumeAndRecord(t *testing.T) {
	h := newHarness(t, defaultYAML)
	path := filepath.Join(h.stateDir, indexFile)
	stream := h.watch()
	resumed := h.resume("lease-resume", "notify", "sess-old")
	if got := indexLines(t, path); got[len(got)-1] != `{"session_id":"sess-old","entry":"notify","principal":"alice"}` {
		t.Errorf("index after a resume = %q, want its binding last", got)
	}
	_, fresh := h.spawn("lease-new", "nexus")
	if _, err := h.client.Record(h.ctx(), &spawnpb.RecordRequest{LeaseId: "lease-new", SessionId: "sess-new"}); err != nil {
		t.Fatal(err)
	}
	if got := indexLines(t, path); got[len(got)-1] != `{"session_id":"sess-new","entry":"nexus","principal":"alice"}` {
		t.Errorf("index after Record = %q, want its binding last", got)
	}
	if a, b := h.binding("sess-old"), h.binding("sess-new"); a != "notify" || b != "nexus" {
		t.Errorf("Binding while live = %q, %q, want notify, nexus", a, b)
	}
	resumed.send("exit 0")
	fresh.send("exit 0")
	h.nextExit(stream)
	h.nextExit(stream)
	h.stop()
	h.start()
	for session, want := range map[string]string{"sess-old": "notify", "sess-new": "nexus", "sess-unknown": ""} {
		if got := h.binding(session); got != want {
			t.Errorf("Binding(%s) after the leases ended and a restart = %q, want %q", session, got, want)
		}
	}
	if _, err := h.client.Binding(h.ctx(), &spawnpb.BindingRequest{}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("Binding of no session = %v, want InvalidArgument", err)
	}
}

// TestBindingPrefersALiveLease: while a lease runs the session, its entry
// is the answer, whatever the index says.
func TestBindingPrefersALiveLease(t *testing.T) {
	h := newHarness(t, defaultYAML)
	stream := h.watch()
	f := h.resume("lease-live", "nexus", "sess-x")
	h.d.index.Put(binding{"sess-x", "notify", ""})
	if got := h.binding("sess-x"); got != "nexus" {
		t.Errorf("Binding with a live lease on the session = %q, want its entry nexus", got)
	}
	f.send("exit 0")
	h.nextExit(stream)
	if got := h.binding("sess-x"); got != "notify" {
		t.Errorf("Binding once the lease is gone = %q, want the index's notify", got)
	}
}

// TestBindingWithoutStateDir answers from live leases only and keeps
// nothing.
func TestBindingWithoutStateDir(t *testing.T) {
	h := newHarness(t, strings.Replace(defaultYAML, "state_dir: STATE\n", "", 1))
	stream := h.watch()
	f := h.resume("lease-mem", "notify", "sess-mem")
	if got := h.binding("sess-mem"); got != "notify" {
		t.Errorf("Binding while live = %q, want notify", got)
	}
	f.send("exit 0")
	h.nextExit(stream)
	if got := h.binding("sess-mem"); got != "" {
		t.Errorf("Binding after the lease without state_dir = %q, want no opinion", got)
	}
	if _, err := os.Stat(h.stateDir); !os.IsNotExist(err) {
		t.Errorf("without state_dir something was written to %s: %v", h.stateDir, err)
	}
}

// TestForeignIndexIsSetAside: an index spawnd cannot trust (a directory, a
// symlink, a file another uid owns, one others may read) never prevents the
// boot: it is set aside with one WARN, the symlink's target untouched, and
// a fresh 0600 index of spawnd's own records the next binding.
func TestForeignIndexIsSetAside(t *testing.T) {
	target := filepath.Join(t.TempDir(), "target")
	for _, tc := range []struct {
		name  string
		plant func(path string) error
	}{
		{"directory", func(p string) error { return os.Mkdir(p, 0o700) }},
		{"symlink", func(p string) error { return os.Symlink(target, p) }},
		{"foreign-owned", func(p string) error {
			if err := os.WriteFile(p, nil, 0o600); err != nil {
				return err
			}
			return os.Chown(p, 65534, 65534)
		}},
		{"loose", func(p string) error { return os.WriteFile(p, nil, 0o644) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := os.WriteFile(target, []byte("not the index\n"), 0o600); err != nil {
				t.Fatal(err)
			}
			h := newHarness(t, defaultYAML)
			h.stop()
			path := filepath.Join(h.stateDir, indexFile)
			if err := os.Remove(path); err != nil {
				t.Fatal(err)
			}
			if err := tc.plant(path); err != nil {
				t.Fatal(err)
			}
			h.start()
			h.logs.await(t, "the session → binary index is not nexus-spawnd's own, so it was set aside and a fresh one started; "+
				"resumes of sessions it recorded are not checked against their binary", "path", path, "set_aside", path+".set-aside")
			stream := h.watch()
			_, f := h.spawn("lease-aside", "notify")
			if _, err := h.client.Record(h.ctx(), &spawnpb.RecordRequest{LeaseId: "lease-aside", SessionId: "sess-aside"}); err != nil {
				t.Fatal(err)
			}
			f.send("exit 0")
			h.nextExit(stream)
			if got := h.binding("sess-aside"); got != "notify" {
				t.Errorf("Binding from the fresh index = %q, want notify", got)
			}
			st, err := os.Lstat(path)
			if err != nil || !st.Mode().IsRegular() || st.Mode().Perm() != 0o600 || st.Sys().(*syscall.Stat_t).Uid != uint32(os.Geteuid()) {
				t.Errorf("the fresh index: %v %v", st, err)
			}
			if data, _ := os.ReadFile(target); string(data) != "not the index\n" {
				t.Errorf("the symlink's target was touched: %q", data)
			}
		})
	}
}

func openTestIndex(t *testing.T, dir string, limit int) (*bindindex.Index[binding], *logBuffer) {
	t.Helper()
	logs := newLogBuffer()
	x := openSessionIndex(dir, limit, slog.New(slog.NewJSONHandler(logs, nil)))
	if x == nil {
		t.Fatalf("the index in %s did not open:\n%s", dir, logs.text())
	}
	t.Cleanup(x.Close)
	return x, logs
}

// TestIndexDropsTheOldestBinding: past the cap the binding written longest
// ago goes, a rebinding counts as new, and a reopened index agrees.
func TestIndexDropsTheOldestBinding(t *testing.T) {
	dir := t.TempDir()
	x, _ := openTestIndex(t, dir, 3)
	for _, s := range []string{"s1", "s2", "s3"} {
		x.Put(binding{s, "nexus", ""})
	}
	x.Put(binding{"s1", "vision", ""}) // refreshed: s2 is now the oldest
	x.Put(binding{"s4", "nexus", ""})
	want := map[string]string{"s1": "vision", "s2": "", "s3": "nexus", "s4": "nexus"}
	for s, e := range want {
		if got := lookup(x, s); got != e {
			t.Errorf("lookup(%s) = %q, want %q", s, got, e)
		}
	}
	x.Close()
	y, _ := openTestIndex(t, dir, 3)
	for s, e := range want {
		if got := lookup(y, s); got != e {
			t.Errorf("after reopening, lookup(%s) = %q, want %q", s, got, e)
		}
	}
}

// TestIndexRepeatWritesNothing: a binding written again unchanged (every
// resume of a session writes its binding) costs no line, nor an fsync.
func TestIndexRepeatWritesNothing(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, indexFile)
	x, _ := openTestIndex(t, dir, maxBindings)
	for range 10 {
		x.Put(binding{"sess-same", "nexus", "alice"})
	}
	x.Put(binding{"sess-other", "vision", "bob"})
	if got := indexLines(t, path); len(got) != 2 {
		t.Fatalf("after ten repeats and one other binding the index is %q, want two lines", got)
	}
}

// TestIndexSkipsCorruptLines: bad and torn lines, and bindings of session
// ids that break the rule (an index written before ids were checked), are
// skipped with a WARN naming them; the good ones still answer.
func TestIndexSkipsCorruptLines(t *testing.T) {
	dir := t.TempDir()
	text := `{"session_id":"sess-a","entry":"nexus"}` + "\n" +
		"not json\n" +
		`{"session_id":"","entry":"nexus"}` + "\n" +
		`{"session_id":"sess-b","entry":"vision"}` + "\n" +
		`{"session_id":"../..","entry":"vision"}` + "\n" +
		`{"session_id":"sess-torn","en`
	if err := os.WriteFile(filepath.Join(dir, indexFile), []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	x, logs := openTestIndex(t, dir, maxBindings)
	for _, n := range []int{2, 3, 5, 6} {
		logs.await(t, "skipping a session → binary index line that is not a whole binding (torn by a crash mid-write, edited, or written before session ids were checked)", "line", n)
	}
	if a, b, c := lookup(x, "sess-a"), lookup(x, "sess-b"), lookup(x, "sess-torn"); a != "nexus" || b != "vision" || c != "" {
		t.Errorf("lookups = %q, %q, %q; want nexus, vision and no opinion", a, b, c)
	}
	if n := len(indexLines(t, filepath.Join(dir, indexFile))); n != 2 {
		t.Errorf("index after the rewrite at open has %d lines, want 2", n)
	}
}

// TestASessionBelongsToTheEntryThatCreatedIt: once a session is bound to an
// entry, a report of it from another entry's lease is refused and logged,
// whether the owner is a live lease or the index; the refused lease keeps
// running without it and does not count for Binding, and a resume naming the
// other entry is refused by Spawn too.
func TestASessionBelongsToTheEntryThatCreatedIt(t *testing.T) {
	h := newHarness(t, defaultYAML)
	stream := h.watch()
	_, victim := h.spawn("lease-a", "notify")
	if _, err := h.client.Record(h.ctx(), &spawnpb.RecordRequest{LeaseId: "lease-a", SessionId: "sess-a"}); err != nil {
		t.Fatal(err)
	}
	_, thief := h.spawn("lease-b", "nexus")
	steal := func(when string) {
		t.Helper()
		_, err := h.client.Record(h.ctx(), &spawnpb.RecordRequest{LeaseId: "lease-b", SessionId: "sess-a"})
		if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), `session "sess-a" belongs to entry "notify", not "nexus"`) {
			t.Fatalf("Record of another entry's session (%s) = %v, want FailedPrecondition naming the owner", when, err)
		}
		if got := h.binding("sess-a"); got != "notify" {
			t.Fatalf("Binding after a refused rebind (%s) = %q, want notify", when, got)
		}
	}
	steal("owner live")
	victim.send("exit 0")
	h.nextExit(stream)
	steal("owner in the index")
	h.logs.await(t, "session-id report refused; the lease keeps running with the session id it had", "lease_id", "lease-b")
	if got := h.list(); len(got) != 1 || got[0].SessionId != "" {
		t.Errorf("List after refused reports = %v, want lease-b running with no session id", got)
	}
	_, err := h.client.Spawn(h.ctx(), &spawnpb.SpawnRequest{
		LeaseId: "lease-c", Entry: "nexus", Config: []byte("core: {}\n"), RecallSessionId: "sess-a",
	})
	if status.Code(err) != codes.FailedPrecondition {
		t.Errorf("Spawn resuming another entry's session = %v, want FailedPrecondition", err)
	}
	thief.send("exit 0")
	h.nextExit(stream)
	if got := indexLines(t, filepath.Join(h.stateDir, indexFile)); len(got) != 1 || got[0] != `{"session_id":"sess-a","entry":"notify","principal":"alice"}` {
		t.Errorf("index = %q, want only the owner's binding", got)
	}
}

// TestSessionIDsAreValidatedAndReportsCapped: a hostile id is refused by
// Spawn, Record and Binding alike, and a lease records at most
// maxSessionReports ids, so a flood of reports grows neither the journal nor
// the index.
func TestSessionIDsAreValidatedAndReportsCapped(t *testing.T) {
	h := newHarness(t, defaultYAML)
	for _, bad := range []string{"-h", "a/b", "../..", "a\nb", strings.Repeat("a", 129)} {
		_, err := h.client.Spawn(h.ctx(), &spawnpb.SpawnRequest{
			LeaseId: "lease-bad", Entry: "nexus", Config: []byte("core: {}\n"), RecallSessionId: bad,
		})
		if status.Code(err) != codes.InvalidArgument {
			t.Errorf("Spawn resuming %q = %v, want InvalidArgument", bad, err)
		}
		if _, err := h.client.Binding(h.ctx(), &spawnpb.BindingRequest{SessionId: bad}); status.Code(err) != codes.InvalidArgument {
			t.Errorf("Binding(%q) = %v, want InvalidArgument", bad, err)
		}
	}
	h.spawn("lease-flood", "nexus")
	if _, err := h.client.Record(h.ctx(), &spawnpb.RecordRequest{LeaseId: "lease-flood", SessionId: "-h"}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("Record of -h = %v, want InvalidArgument", err)
	}
	if got := h.list(); got[0].SessionId != "" {
		t.Errorf("session id after a refused report = %q, want none", got[0].SessionId)
	}
	journal := filepath.Join(h.stateDir, journalFile)
	for i := 2; i <= maxSessionReports; i++ {
		if _, err := h.client.Record(h.ctx(), &spawnpb.RecordRequest{LeaseId: "lease-flood", SessionId: fmt.Sprint("sess-", i)}); err != nil {
			t.Fatalf("report %d: %v", i, err)
		}
	}
	before, _ := os.Stat(journal)
	for i := range 50 {
		_, err := h.client.Record(h.ctx(), &spawnpb.RecordRequest{LeaseId: "lease-flood", SessionId: fmt.Sprint("more-", i)})
		if status.Code(err) != codes.ResourceExhausted {
			t.Fatalf("report past the cap = %v, want ResourceExhausted", err)
		}
	}
	after, _ := os.Stat(journal)
	if after.Size() != before.Size() {
		t.Errorf("journal grew from %d to %d bytes on refused reports", before.Size(), after.Size())
	}
	if got := h.list(); got[0].SessionId != fmt.Sprint("sess-", maxSessionReports) {
		t.Errorf("session id after the flood = %q, want the last accepted one", got[0].SessionId)
	}
	if n := len(h.logs.find("session-id report refused; the lease keeps running with the session id it had")); n != 2 {
		t.Errorf("%d refusal WARNs, want 2 (the bad id, then the first past the cap)", n)
	}
	if got := indexLines(t, filepath.Join(h.stateDir, indexFile)); len(got) != maxSessionReports-1 {
		t.Errorf("index holds %d lines, want %d", len(got), maxSessionReports-1)
	}
}

func (h *harness) list() []*spawnpb.Lease {
	h.t.Helper()
	resp, err := h.client.List(h.ctx(), &spawnpb.ListRequest{})
	if err != nil {
		h.t.Fatal(err)
	}
	return resp.Leases
}

// lookup is the entry x binds session to, "" for no opinion.
func lookup(x *bindindex.Index[binding], session string) string {
	b, _ := x.Get(session)
	return b.Entry
}

// TestBindingAnswersOwnership: a session belongs to the principal whose
// lease reported it, for good (a resume by another keeps the owner), across
// a restart; an unknown session has no owner; Binding never names it.
func TestBindingAnswersOwnership(t *testing.T) {
	h := newHarness(t, defaultYAML)
	owner := func(session, principal string) spawnpb.Ownership {
		t.Helper()
		res, err := h.client.Binding(h.ctx(), &spawnpb.BindingRequest{SessionId: session, Principal: principal})
		if err != nil {
			t.Fatal(err)
		}
		return res.Ownership
	}
	h.spawn("lease-a", "nexus") // as alice
	if _, err := h.client.Record(h.ctx(), &spawnpb.RecordRequest{LeaseId: "lease-a", SessionId: "sess-a"}); err != nil {
		t.Fatal(err)
	}
	if _, err := h.client.Spawn(h.ctx(), &spawnpb.SpawnRequest{LeaseId: "lease-b", Entry: "nexus", Config: []byte("x"), RecallSessionId: "sess-a", Principal: "bob"}); err != nil {
		t.Fatal(err)
	}
	h.accept()
	for _, boot := range []string{"live", "restarted"} {
		if got := owner("sess-a", "alice"); got != spawnpb.Ownership_OWNERSHIP_OWN {
			t.Errorf("%s: alice's session for alice = %v", boot, got)
		}
		if got := owner("sess-a", "bob"); got != spawnpb.Ownership_OWNERSHIP_OTHER {
			t.Errorf("%s: alice's session for bob = %v", boot, got)
		}
		if got := owner("sess-none", "bob"); got != spawnpb.Ownership_OWNERSHIP_UNRECORDED {
			t.Errorf("%s: an unknown session for bob = %v", boot, got)
		}
		h.stop()
		h.start()
	}
	_, err := h.client.Binding(h.ctx(), &spawnpb.BindingRequest{SessionId: "sess-a", Principal: "a\x00"})
	if status.Code(err) != codes.InvalidArgument {
		t.Errorf("Binding for a principal with a NUL = %v, want InvalidArgument", err)
	}
}

// Without a state_dir owners live in memory for spawnd's life, and the
// binary check stays off as before.
func TestOwnersInMemoryWithoutStateDir(t *testing.T) {
	h := newHarness(t, strings.Replace(defaultYAML, "state_dir: STATE\n", "", 1))
	h.spawn("lease-a", "notify")
	if _, err := h.client.Record(h.ctx(), &spawnpb.RecordRequest{LeaseId: "lease-a", SessionId: "sess-a"}); err != nil {
		t.Fatal(err)
	}
	if _, err := h.client.Terminate(h.ctx(), &spawnpb.TerminateRequest{LeaseId: "lease-a", SkipGrace: true}); err != nil {
		t.Fatal(err)
	}
	res, err := h.client.Binding(h.ctx(), &spawnpb.BindingRequest{SessionId: "sess-a", Principal: "alice"})
	if err != nil || res.Ownership != spawnpb.Ownership_OWNERSHIP_OWN || res.Entry != "" {
		t.Errorf("Binding = %v (%v), want alice's, with no binary opinion", res, err)
	}
}

// TestIndexCompactsEveryIndexCompactEveryAppends: the file grows by one line
// per append until the indexCompactEvery-th, which rewrites it as the
// bindings in memory (the newest limit of them), and appends go on after;
// a reopened index agrees with memory.
func TestIndexCompactsEveryIndexCompactEveryAppends(t *testing.T) {
	dir := shmDir(t) // 65 536 fsyncs
	const limit = 10
	x, _ := openTestIndex(t, dir, limit)
	path := filepath.Join(dir, indexFile)
	put := func(i int) {
		if err := x.Put(binding{fmt.Sprint("sess-", i), "nexus", "alice"}); err != nil {
			t.Fatal(err)
		}
	}
	for i := 1; i < indexCompactEvery; i++ {
		put(i)
	}
	if n := len(indexLines(t, path)); n != indexCompactEvery-1 {
		t.Fatalf("after %d appends the file holds %d lines: compacted before the %dth append", indexCompactEvery-1, n, indexCompactEvery)
	}
	put(indexCompactEvery)
	lines := indexLines(t, path)
	if len(lines) != limit || !strings.Contains(lines[0], fmt.Sprintf(`"sess-%d"`, indexCompactEvery-limit+1)) ||
		!strings.Contains(lines[limit-1], fmt.Sprintf(`"sess-%d"`, indexCompactEvery)) {
		t.Fatalf("after the %dth append the file holds %d lines (%.60s … %.60s); want the newest %d bindings", indexCompactEvery, len(lines), lines[0], lines[len(lines)-1], limit)
	}
	put(indexCompactEvery + 1)
	if n := len(indexLines(t, path)); n != limit+1 {
		t.Fatalf("the append after the compaction left %d lines, want %d", n, limit+1)
	}
	x.Close()
	y, _ := openTestIndex(t, dir, limit)
	for i := indexCompactEvery + 1 - limit; i <= indexCompactEvery+1; i++ {
		want := "nexus"
		if i == indexCompactEvery+1-limit {
			want = "" // the 11th newest, dropped by the cap on replay
		}
		if got := lookup(y, fmt.Sprint("sess-", i)); got != want {
			t.Errorf("after reopening, sess-%d binds %q, want %q", i, got, want)
		}
	}
}

// BenchmarkSessionIndexHeap: the heap the session index holds at its cap,
// maxBindings bindings of a stock nexus's session id (32 hex characters),
// entry "nexus" and a 32-byte principal, as that many claims leave it.
// index-B is the index's heap; B/binding the same per binding (README
// states it).
func BenchmarkSessionIndexHeap(b *testing.B) {
	heap := func() uint64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return m.HeapAlloc
	}
	for b.Loop() {
		before := heap()
		x := openSessionIndex("", maxBindings, quiet)
		for i := range maxBindings {
			x.Put(binding{fmt.Sprintf("%032x", i), "nexus", fmt.Sprintf("oidc:user-%022d", i)})
		}
		held := heap() - before
		if n, _ := x.Opened(); n != maxBindings {
			b.Fatalf("the index holds %d bindings, want %d", n, maxBindings)
		}
		b.ReportMetric(float64(held), "index-B")
		b.ReportMetric(float64(held)/maxBindings, "B/binding")
		runtime.KeepAlive(x)
	}
}
