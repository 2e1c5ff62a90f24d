package a2a

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func testPolicy() Policy {
	return Policy{TTL: time.Hour, MaxPerContext: 50, MaxBytes: 64 << 20}
}

func quietLog(buf *bytes.Buffer) *slog.Logger { return slog.New(slog.NewTextHandler(buf, nil)) }

func record(principal, profile, ctx, id, state string) *Record {
	return &Record{Principal: principal, Profile: profile, Created: time.Now(),
		Task: Task{ID: id, ContextID: ctx, Status: Status{State: state}}}
}

func answered(r *Record, text string) *Record {
	r.Task.Artifacts = []Artifact{{ArtifactID: "a1", Parts: []Part{TextPart(text)}}}
	return r
}

// TestStoreLongTextRoundTrip: a 100 KiB answer is written as 8 KiB
// fragments plus a manifest, never inline, and reads back byte-identical
// after a reopen.
func TestStoreLongTextRoundTrip(t *testing.T) {
	dir := t.TempDir()
	var logs bytes.Buffer
	s := OpenStore(dir, testPolicy(), quietLog(&logs))
	long := strings.Repeat("0123456789abcdef", 100<<10/16) + "tail"
	s.Put(answered(record("p", "support", "c1", "t1", StateCompleted), long))
	s.Close()

	data, err := os.ReadFile(filepath.Join(dir, TasksFile))
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(data, []byte("0123456789abcdef0123")) || len(data) > 8<<10 {
		t.Errorf("the task line carries the long text inline (%d bytes)", len(data))
	}
	frags, _ := os.ReadDir(filepath.Join(dir, FragmentsDir))
	if want := (len(long) + FragmentSize - 1) / FragmentSize; len(frags) > want || len(frags) < 2 {
		t.Errorf("%d fragment files for %d bytes, want at most %d (content-addressed, so repeats share)", len(frags), len(long), want)
	}

	s2 := OpenStore(dir, testPolicy(), quietLog(&logs))
	defer s2.Close()
	r, ok := s2.Get("p", "support", "t1")
	if !ok {
		t.Fatalf("task did not read back; log:\n%s", logs.String())
	}
	if got := *r.Task.Artifacts[0].Parts[0].Text; got != long {
		t.Errorf("long text read back as %d bytes, want %d byte-identical", len(got), len(long))
	}
	if r.Task.Artifacts[0].Parts[0].Frag != nil {
		t.Error("a read-back part still carries its manifest")
	}
}

// TestStoreSettlesInflightOnReopen: a task a stopped broker left WORKING
// reads back FAILED with a status message saying why.
func TestStoreSettlesInflightOnReopen(t *testing.T) {
	dir := t.TempDir()
	var logs bytes.Buffer
	s := OpenStore(dir, testPolicy(), quietLog(&logs))
	s.Put(record("p", "support", "c1", "live", StateWorking))
	s.Put(record("p", "support", "c1", "queued", StateSubmitted))
	s.Put(answered(record("p", "support", "c1", "done", StateCompleted), "hi"))
	s.Close()
	s2 := OpenStore(dir, testPolicy(), quietLog(&logs))
	defer s2.Close()
	for id, want := range map[string]string{"live": StateFailed, "queued": StateFailed, "done": StateCompleted} {
		r, ok := s2.Get("p", "support", id)
		if !ok || r.Task.Status.State != want {
			t.Fatalf("%s reads back %+v, want %s", id, r, want)
		}
		if want == StateFailed && (r.Task.Status.Message == nil || !strings.Contains(*r.Task.Status.Message.Parts[0].Text, "stopped")) {
			t.Errorf("%s settled without a status message saying why: %+v", id, r.Task.Status)
		}
	}
}

// TestStoreUpdate: a move between live states reads back at once but is
// not written (a reopen settles the task FAILED either way); a terminal
// state is.
func TestStoreUpdate(t *testing.T) {
	dir := t.TempDir()
	var logs bytes.Buffer
	s := OpenStore(dir, testPolicy(), quietLog(&logs))
	r := record("p", "x", "c1", "t1", StateSubmitted)
	s.Put(r)
	r.Task.Status.State = StateWorking
	s.Update(r)
	if got, ok := s.Get("p", "x", "t1"); !ok || got.Task.Status.State != StateWorking {
		t.Fatalf("an updated task reads back %+v", got)
	}
	lines := func() int {
		data, _ := os.ReadFile(filepath.Join(dir, TasksFile))
		return bytes.Count(data, []byte("\n"))
	}
	if n := lines(); n != 1 {
		t.Errorf("the task file has %d lines after a Put and an Update, want 1", n)
	}
	r.Task.Status.State = StateCompleted
	s.Put(r)
	if n := lines(); n != 2 {
		t.Errorf("the task file has %d lines after the terminal Put, want 2", n)
	}
	s.Close()
}

// TestStoreScope: another caller, or the same caller on another profile,
// sees nothing, exactly like an unknown id.
func TestStoreScope(t *testing.T) {
	s := OpenStore("", testPolicy(), quietLog(&bytes.Buffer{}))
	s.Put(record("alice", "support", "c1", "t1", StateCompleted))
	for _, c := range [][2]string{{"bob", "support"}, {"alice", "research"}} {
		if _, ok := s.Get(c[0], c[1], "t1"); ok {
			t.Errorf("%s on %s read alice's support task", c[0], c[1])
		}
		if n := len(s.List(c[0], c[1], func(*Record) bool { return true })); n != 0 {
			t.Errorf("%s on %s lists %d tasks", c[0], c[1], n)
		}
	}
	if _, ok := s.Get("alice", "support", "t1"); !ok {
		t.Error("the owner cannot read its own task")
	}
}

// TestStoreRetention: max_per_context drops the oldest finished task of that
// conversation only, the byte bound drops oldest first, and a live task is
// never evicted.
func TestStoreRetention(t *testing.T) {
	p := testPolicy()
	p.MaxPerContext = 2
	s := OpenStore("", p, quietLog(&bytes.Buffer{}))
	s.Put(record("p", "x", "c1", "live", StateWorking))
	for _, id := range []string{"a", "b", "c"} {
		s.Put(record("p", "x", "c1", id, StateCompleted))
	}
	s.Put(record("p", "x", "c2", "other", StateCompleted))
	for id, want := range map[string]bool{"live": true, "a": false, "b": false, "c": true, "other": true} {
		if _, ok := s.Get("p", "x", id); ok != want {
			t.Errorf("task %s kept = %v, want %v", id, ok, want)
		}
	}

	p = testPolicy()
	p.MaxBytes = 10
	s = OpenStore("", p, quietLog(&bytes.Buffer{}))
	s.Put(answered(record("p", "x", "c1", "old", StateCompleted), "123456"))
	s.Put(answered(record("p", "x", "c2", "new", StateCompleted), "123456"))
	if _, ok := s.Get("p", "x", "old"); ok {
		t.Error("over the byte bound, the oldest task was kept")
	}
	if _, ok := s.Get("p", "x", "new"); !ok {
		t.Error("over the byte bound, the newest task was dropped")
	}
}

// TestStoreGlobalCap: past MaxTasks the oldest finished tasks go first,
// whatever their conversation; the count stays at the cap, through a
// reopen too, and a task still in flight is never the one dropped.
func TestStoreGlobalCap(t *testing.T) {
	dir := t.TempDir()
	var logs bytes.Buffer
	s := OpenStore(dir, testPolicy(), quietLog(&logs))
	s.Put(record("p", "x", "c-live", "live", StateWorking))
	const extra = 100
	for i := range MaxTasks + extra {
		s.Put(record("p", "x", fmt.Sprintf("c%d", i%97), fmt.Sprintf("t%d", i), StateCompleted))
	}
	check := func(s *Store, when string) {
		t.Helper()
		if n := len(s.List("p", "x", func(*Record) bool { return true })); n != MaxTasks {
			t.Errorf("%s: %d tasks kept, want the cap %d", when, n, MaxTasks)
		}
		if _, ok := s.Get("p", "x", "live"); !ok {
			t.Errorf("%s: the task in flight was dropped", when)
		}
		// One slot is the live task's, so extra+1 finished tasks went.
		for _, id := range []string{"t0", fmt.Sprintf("t%d", extra)} {
			if _, ok := s.Get("p", "x", id); ok {
				t.Errorf("%s: %s, among the oldest, is still kept", when, id)
			}
		}
		for _, id := range []string{fmt.Sprintf("t%d", extra+1), fmt.Sprintf("t%d", MaxTasks+extra-1)} {
			if _, ok := s.Get("p", "x", id); !ok {
				t.Errorf("%s: %s, among the newest, was dropped", when, id)
			}
		}
	}
	check(s, "live")
	s.Close()
	s2 := OpenStore(dir, testPolicy(), quietLog(&logs))
	defer s2.Close()
	check(s2, "reopened")
}

// TestTaskClone: nothing done to a clone's fields, slices or parts reaches
// the original (the store keeps clones of tasks the ingress goes on
// changing), and the clone marshals exactly like the original.
func TestTaskClone(t *testing.T) {
	orig := Task{ID: "t", ContextID: "c",
		Status:    Status{State: StateWorking, Message: &Message{MessageID: "s", Role: RoleAgent, Parts: []Part{TextPart("status")}}},
		History:   []Message{{MessageID: "m", Role: RoleUser, Parts: []Part{TextPart("question")}}},
		Artifacts: []Artifact{{ArtifactID: "a", Parts: []Part{TextPart("answer")}}},
	}
	before, _ := json.Marshal(&orig)
	c := orig.Clone()
	if got, _ := json.Marshal(&c); !bytes.Equal(got, before) {
		t.Fatalf("clone marshals as %s, want %s", got, before)
	}
	c.Status.Message.Parts[0] = TextPart("changed")
	c.History[0].Parts[0].Frag = &Manifest{}
	c.History[0].Parts = append(c.History[0].Parts, TextPart("more"))
	c.Artifacts[0].Parts[0].Text = nil
	c.Artifacts = append(c.Artifacts, Artifact{ArtifactID: "b"})
	c.Status.State = StateCompleted
	if after, _ := json.Marshal(&orig); !bytes.Equal(after, before) {
		t.Errorf("changing the clone changed the original:\n%s\nwas\n%s", after, before)
	}
	if empty := (&Task{ID: "e"}).Clone(); empty.History != nil || empty.Artifacts != nil {
		t.Errorf("a task without history or artifacts clones with empty slices: %+v", empty)
	}
}

// TestStoreTTL: a finished task older than the TTL reads back as unknown.
func TestStoreTTL(t *testing.T) {
	p := testPolicy()
	p.TTL = time.Millisecond
	s := OpenStore("", p, quietLog(&bytes.Buffer{}))
	s.Put(record("p", "x", "c1", "t1", StateCompleted))
	deadline := time.Now().Add(5 * time.Second)
	for {
		if _, ok := s.Get("p", "x", "t1"); !ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("a task past its TTL still reads back")
		}
		time.Sleep(time.Millisecond) // polling a clock, not synchronising
	}
}

// TestStoreSkipsTornLines: a torn trailing line and a line whose fragment is
// missing are skipped and counted in one WARN; the rest reads back.
func TestStoreSkipsTornLines(t *testing.T) {
	dir := t.TempDir()
	var logs bytes.Buffer
	s := OpenStore(dir, testPolicy(), quietLog(&logs))
	s.Put(answered(record("p", "x", "c1", "good", StateCompleted), "short"))
	s.Put(answered(record("p", "x", "c1", "long", StateCompleted), strings.Repeat("z", 3*FragmentSize)))
	s.Close()
	frags, _ := os.ReadDir(filepath.Join(dir, FragmentsDir))
	for _, f := range frags {
		_ = os.Remove(filepath.Join(dir, FragmentsDir, f.Name()))
	}
	f, _ := os.OpenFile(filepath.Join(dir, TasksFile), os.O_APPEND|os.O_WRONLY, 0)
	_, _ = f.WriteString(`{"principal":"p","profile":"x","task":{"id":"torn","contex`)
	_ = f.Close()
	s2 := OpenStore(dir, testPolicy(), quietLog(&logs))
	defer s2.Close()
	if _, ok := s2.Get("p", "x", "good"); !ok {
		t.Errorf("the whole record did not read back; log:\n%s", logs.String())
	}
	for _, id := range []string{"long", "torn"} {
		if _, ok := s2.Get("p", "x", id); ok {
			t.Errorf("task %s read back from a broken record", id)
		}
	}
	if !strings.Contains(logs.String(), `level=WARN msg="skipped unreadable a2a task records; the broker was most likely killed mid-write" path=`+filepath.Join(dir, TasksFile)+" skipped=2 read=1 first_line=2 error=") {
		t.Errorf("no WARN for the broken lines:\n%s", logs.String())
	}
}

// FuzzDecodeRecord: the store's line decoder never panics, and what it
// accepts is a record a reader can use.
func FuzzDecodeRecord(f *testing.F) {
	f.Add([]byte(`{"principal":"p","profile":"x","task":{"id":"t","contextId":"c","status":{"state":"TASK_STATE_COMPLETED"}}}`))
	f.Add([]byte(`{"task":{"id":"t","contextId":"c","status":{"state":"TASK_STATE_WORKING"},"artifacts":[{"artifactId":"a","parts":[{"frag":{"len":1,"sha256":"` + strings.Repeat("a", 64) + `","frags":["` + strings.Repeat("b", 64) + `"]}}]}]}}`))
	f.Add([]byte(`{"task":{"id":"t"`))
	f.Add([]byte(`{"task":{"id":"t","contextId":"c","status":{"state":"x"},"history":[{"parts":[{"frag":{"len":-1}}]}]}}`))
	f.Fuzz(func(t *testing.T, line []byte) {
		r, err := DecodeRecord(line)
		if err != nil {
			return
		}
		if r.Task.ID == "" || r.Task.ContextID == "" || r.Task.Status.State == "" {
			t.Errorf("accepted a record without id, context or state: %+v", r)
		}
		each(&r.Task, func(p *Part) {
			if m := p.Frag; m != nil && m.check() != nil {
				t.Errorf("accepted an inconsistent manifest %+v", m)
			}
		})
	})
}

// turnRecord is a task as the ingress stores it on submit: one user
// message in its history.
func turnRecord(id string) *Record {
	now := time.Now()
	r := record("alice", "support", "ctx-1", id, StateSubmitted)
	r.Task.Status.Timestamp = &now
	r.Task.History = []Message{{MessageID: NewID(), ContextID: "ctx-1", TaskID: id, Role: RoleUser, Parts: []Part{TextPart("hello there")}}}
	return r
}

// BenchmarkStorePut: one submitted task written to the file, as every
// message's first step does before its input goes to the instance.
func BenchmarkStorePut(b *testing.B) {
	var logs bytes.Buffer
	s := OpenStore(b.TempDir(), testPolicy(), quietLog(&logs))
	defer s.Close()
	r := turnRecord("t1")
	b.ReportAllocs()
	for b.Loop() {
		s.Put(r)
	}
}

// BenchmarkStoreUpdate: a move between live states, kept in memory.
func BenchmarkStoreUpdate(b *testing.B) {
	var logs bytes.Buffer
	s := OpenStore(b.TempDir(), testPolicy(), quietLog(&logs))
	defer s.Close()
	r := turnRecord("t1")
	s.Put(r)
	r.Task.Status.State = StateWorking
	b.ReportAllocs()
	for b.Loop() {
		s.Update(r)
	}
}
