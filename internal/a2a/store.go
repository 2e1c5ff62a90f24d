package a2a

import (
	"bytes"
	"container/list"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/atomicfile"
	"github.com/nexus-broker/nexus-broker/internal/rawsock"
)

// The task store, <state_dir>/a2a-tasks.jsonl: the lease journal's file
// shape (append, compact on open and every storeCompactEvery appends, a torn
// line skipped with a WARN) holding one snapshot line per task change. A
// text longer than FragmentSize is not written inline: it is cut into
// immutable, content-addressed fragments under a2a-fragments/, and the line
// carries only a small manifest, appended after every fragment is written,
// so a line that made it to disk always points at whole fragments. Neither
// the file nor the fragments are fsynced per frame (the spec's auxiliary
// files are not either): a host crash can lose the tail, never corrupt
// what reads back.
const (
	TasksFile     = "a2a-tasks.jsonl"
	FragmentsDir  = "a2a-fragments"
	FragmentSize  = 8 << 10
	MaxTasks      = 2048 // the spec's fixed global ceiling
	compactEvery  = 512
	inflightFault = "the broker stopped while this task was still running, so it will never complete" // upstream's words
)

// Manifest is where a long text lives: its fragments in order, its length
// and its digest.
type Manifest struct {
	Len    int      `json:"len"`
	SHA256 string   `json:"sha256"`
	Frags  []string `json:"frags"`
}

// Policy is the retention the a2a.tasks block configures.
type Policy struct {
	TTL           time.Duration
	MaxPerContext int
	MaxBytes      int64
}

// Record is one stored task and the scope it is readable in.
type Record struct {
	Principal string    `json:"principal"`
	Profile   string    `json:"profile"`
	Created   time.Time `json:"created"`
	Updated   time.Time `json:"updated"`
	Task      Task      `json:"task"`
}

func (r *Record) bytes() int64 {
	var n int64
	each(&r.Task, func(p *Part) {
		if p.Text != nil {
			n += int64(len(*p.Text))
		}
	})
	return n
}

// each visits every part of t: history, status message, artifacts.
func each(t *Task, f func(*Part)) {
	for i := range t.History {
		for j := range t.History[i].Parts {
			f(&t.History[i].Parts[j])
		}
	}
	if m := t.Status.Message; m != nil {
		for j := range m.Parts {
			f(&m.Parts[j])
		}
	}
	for i := range t.Artifacts {
		for j := range t.Artifacts[i].Parts {
			f(&t.Artifacts[i].Parts[j])
		}
	}
}

// scope is a conversation: the unit max_per_context counts in.
type scope struct{ principal, profile, context string }

// entry is one stored task with its places in the two retention orders.
type entry struct {
	rec    *Record
	size   int64         // text bytes, counted against MaxBytes
	all    *list.Element // in Store.order
	conv   *list.Element // in its conversation's list, convOf
	convOf *list.List
}

func (e *entry) scope() scope {
	return scope{e.rec.Principal, e.rec.Profile, e.rec.Task.ContextID}
}

// Store holds every task in memory and mirrors it to the file. A nil dir is
// memory-only. Methods are safe for concurrent use.
//
// Every change moves its task to the back of two lists, the whole store's
// and its conversation's, so both are oldest change first and retention
// never sorts: it drops from the fronts.
type Store struct {
	log    *slog.Logger
	path   string // "" when memory-only
	frags  string
	policy Policy

	mu sync.Mutex
	// f is written with raw system calls: a line is appended before every
	// change is delivered, and a normal write would wake the Go runtime's
	// monitor thread on the way to each turn's input (see rawsock.File).
	f *rawsock.File
	// interrupted are the conversations that had a task in flight when
	// the broker stopped, found on reopen.
	interrupted map[scope]bool
	appends     int
	line        bytes.Buffer
	enc         *json.Encoder // writes into line
	tasks       map[string]*entry
	order       *list.List           // of *entry
	convs       map[scope]*list.List // of *entry
	bytes       int64
}

// OpenStore replays <dir>/a2a-tasks.jsonl and settles every task a stopped
// broker left in flight at FAILED. dir "" is memory-only. A file that cannot
// be used logs a WARN and leaves the store memory-only: read-back is a
// convenience, never a reason to refuse the boot.
func OpenStore(dir string, p Policy, log *slog.Logger) *Store {
	s := &Store{log: log, policy: p, tasks: map[string]*entry{}, order: list.New(), convs: map[scope]*list.List{}, interrupted: map[scope]bool{}}
	if dir == "" {
		return s
	}
	s.path = filepath.Join(dir, TasksFile)
	s.frags = filepath.Join(dir, FragmentsDir)
	atomicfile.RemoveTemps(s.path)
	skipped, err := s.replay()
	if err != nil {
		s.off(err)
		return s
	}
	now := time.Now()
	orphans := 0
	for _, e := range s.records() {
		if r := e.rec; !Terminal(r.Task.Status.State) {
			r.Task.Status = Status{State: StateFailed, Timestamp: &now, Message: AgentMessage(r.Task, inflightFault)}
			r.Updated = now
			s.putLocked(r)
			s.interrupted[e.scope()] = true
			orphans++
		}
	}
	if orphans > 0 {
		s.log.Warn("a2a tasks were left in flight by a previous broker and have been failed", "tasks", orphans)
	}
	for _, l := range s.convs {
		s.trimConvLocked(l)
	}
	s.expireLocked(now)
	if err := s.compactLocked(); err != nil {
		s.off(err)
		return s
	}
	s.log.Info("a2a task store opened", "path", s.path, "tasks", len(s.tasks), "settled_orphans", orphans, "skipped_records", skipped)
	return s
}

func (s *Store) off(err error) {
	s.log.Warn("the A2A task store cannot be used; tasks are kept in memory only and will not read back after a restart (a2a.state_dir names a directory the gateway can write)",
		"path", s.path, "error", err)
	if s.f != nil {
		_ = s.f.Close()
		s.f = nil
	}
	s.path = ""
}

// replay folds the file into memory and reports how many lines it skipped:
// one torn by a crash mid-write (or edited), or a task whose long text
// cannot be read back whole. One WARN counts them, in upstream's words,
// naming the first line skipped and why.
func (s *Store) replay() (int, error) {
	data, err := os.ReadFile(s.path)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, os.MkdirAll(s.frags, 0o700)
	}
	if err != nil {
		return 0, err
	}
	if err := os.MkdirAll(s.frags, 0o700); err != nil {
		return 0, err
	}
	n, read, skipped, first := 0, 0, 0, []any(nil)
	for line := range bytes.Lines(data) {
		n++
		r, err := DecodeRecord(line)
		if err == nil {
			err = s.inflate(&r.Task)
		}
		if err != nil {
			if skipped++; first == nil {
				first = []any{"first_line", n, "error", err}
			}
			continue
		}
		read++
		s.putLocked(r)
	}
	if skipped > 0 {
		s.log.Warn("skipped unreadable a2a task records; the broker was most likely killed mid-write",
			append([]any{"path", s.path, "skipped", skipped, "read", read}, first...)...)
	}
	return skipped, nil
}

// DecodeRecord parses one store line, refusing what a reader could not use.
func DecodeRecord(line []byte) (*Record, error) {
	var r Record
	if err := json.Unmarshal(line, &r); err != nil {
		return nil, err
	}
	if r.Task.ID == "" || r.Task.ContextID == "" || r.Task.Status.State == "" {
		return nil, errors.New("a record needs a task id, a context id and a state")
	}
	var bad error
	each(&r.Task, func(p *Part) {
		if m := p.Frag; m != nil && bad == nil {
			bad = m.check()
		}
	})
	return &r, bad
}

func (m *Manifest) check() error {
	if m.Len < 0 || len(m.SHA256) != 64 || len(m.Frags) != (m.Len+FragmentSize-1)/FragmentSize {
		return fmt.Errorf("a text manifest of %d bytes in %d fragments is inconsistent", m.Len, len(m.Frags))
	}
	for _, f := range m.Frags {
		if len(f) != 64 || strings.Trim(f, "0123456789abcdef") != "" {
			return fmt.Errorf("fragment name %q is not a sha256 digest", f)
		}
	}
	return nil
}

// inflate reads every fragmented text of t back into its part, checking
// length and digest.
func (s *Store) inflate(t *Task) error {
	var err error
	each(t, func(p *Part) {
		m := p.Frag
		if m == nil || err != nil {
			return
		}
		var b strings.Builder
		b.Grow(m.Len)
		for _, name := range m.Frags {
			data, rerr := os.ReadFile(filepath.Join(s.frags, name))
			if rerr != nil {
				err = rerr
				return
			}
			b.Write(data)
		}
		text := b.String()
		sum := sha256.Sum256([]byte(text))
		if len(text) != m.Len || hex.EncodeToString(sum[:]) != m.SHA256 {
			err = fmt.Errorf("fragments give %d bytes, the manifest says %d with another digest", len(text), m.Len)
			return
		}
		p.Text, p.Frag = &text, nil
	})
	return err
}

// Update stores r's current status in memory only, for a change that
// moves a task between states short of terminal and touches nothing else
// (its history, its artifacts). A reopen settles such a task FAILED
// whatever its line says, so writing the change would alter nothing that
// can ever read back from the file, and a turn's path is one write
// shorter. Only the status is copied: the rest of the stored task is
// already r's.
func (s *Store) Update(r *Record) {
	st := r.Task.Status
	st.Message = st.Message.clone()
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.tasks[r.Task.ID]
	if e == nil {
		s.storeLocked(r.copy(), false) // evicted meanwhile: stored whole again
		return
	}
	now := time.Now()
	e.rec.Task.Status, e.rec.Updated = st, now
	s.touchLocked(e)
	s.expireLocked(now)
}

// Put stores r's current state, persisted before it returns: the ingress
// publishes a change only after Put.
func (s *Store) Put(r *Record) {
	c := r.copy()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.storeLocked(c, true)
}

// copy is r with a task of its own (see Task.Clone).
func (r *Record) copy() *Record {
	c := *r
	c.Task = r.Task.Clone()
	return &c
}

// storeLocked makes r (the store's own) its task's record, with write
// appended to the file.
func (s *Store) storeLocked(r *Record, write bool) {
	now := time.Now()
	r.Updated = now
	e := s.putLocked(r)
	if write {
		s.appendLocked(r)
	}
	s.trimConvLocked(e.convOf)
	s.expireLocked(now)
}

// putLocked makes r its task's record, at the back of both orders.
func (s *Store) putLocked(r *Record) *entry {
	if old := s.tasks[r.Task.ID]; old != nil {
		if old.scope() == (scope{r.Principal, r.Profile, r.Task.ContextID}) {
			old.rec = r
			s.touchLocked(old)
			return old
		}
		s.dropLocked(old)
	}
	e := &entry{rec: r, size: r.bytes()}
	l := s.convs[e.scope()]
	if l == nil {
		l = list.New()
		s.convs[e.scope()] = l
	}
	e.all, e.conv, e.convOf = s.order.PushBack(e), l.PushBack(e), l
	s.tasks[r.Task.ID] = e
	s.bytes += e.size
	return e
}

// touchLocked recounts e's bytes after its record changed and moves it to
// the back of both orders.
func (s *Store) touchLocked(e *entry) {
	s.bytes -= e.size
	e.size = e.rec.bytes()
	s.bytes += e.size
	s.order.MoveToBack(e.all)
	e.convOf.MoveToBack(e.conv)
}

func (s *Store) dropLocked(e *entry) {
	s.order.Remove(e.all)
	l := e.convOf
	l.Remove(e.conv)
	if l.Len() == 0 {
		delete(s.convs, e.scope())
	}
	delete(s.tasks, e.rec.Task.ID)
	s.bytes -= e.size
}

func (s *Store) appendLocked(r *Record) {
	if s.path == "" {
		return
	}
	line, err := s.encodeLocked(r)
	if err == nil {
		if s.f == nil {
			err = errors.New("the task file is not open")
		} else {
			_, err = s.f.Write(line)
		}
	}
	if err != nil {
		s.log.Warn("appending to the A2A task store failed; this change is kept in memory only", "path", s.path, "task_id", r.Task.ID, "error", err)
		return
	}
	s.appends++
	if s.appends >= compactEvery {
		if err := s.compactLocked(); err != nil {
			s.log.Warn("compacting the A2A task store failed; appending uncompacted until the next try", "path", s.path, "error", err)
		}
	}
}

// encodeLocked renders r as one line, writing its long texts as fragments
// first. The line is valid until the next call.
func (s *Store) encodeLocked(r *Record) ([]byte, error) {
	long := false
	each(&r.Task, func(p *Part) { long = long || p.Text != nil && len(*p.Text) > FragmentSize })
	if long {
		c := r.copy()
		var err error
		each(&c.Task, func(p *Part) {
			if err != nil || p.Text == nil || len(*p.Text) <= FragmentSize {
				return
			}
			var m *Manifest
			m, err = s.writeFragments(*p.Text)
			p.Text, p.Frag = nil, m
		})
		if err != nil {
			return nil, err
		}
		r = c
	}
	s.line.Reset()
	if s.enc == nil {
		s.enc = json.NewEncoder(&s.line)
	}
	err := s.enc.Encode(r) // one line, newline included
	return s.line.Bytes(), err
}

func (s *Store) writeFragments(text string) (*Manifest, error) {
	sum := sha256.Sum256([]byte(text))
	m := &Manifest{Len: len(text), SHA256: hex.EncodeToString(sum[:])}
	for off := 0; off < len(text); off += FragmentSize {
		chunk := []byte(text[off:min(off+FragmentSize, len(text))])
		fs := sha256.Sum256(chunk)
		name := hex.EncodeToString(fs[:])
		path := filepath.Join(s.frags, name)
		if _, err := os.Stat(path); err != nil {
			// Content-addressed and immutable: an existing one is this one.
			f, err := atomicfile.Replace(path, chunk, false, nil)
			if err != nil {
				return nil, err
			}
			_ = f.Close()
		}
		m.Frags = append(m.Frags, name)
	}
	return m, nil
}

// compactLocked rewrites the file as one line per task, oldest first, and
// removes the fragments no line points at.
func (s *Store) compactLocked() error {
	if s.path == "" {
		return nil
	}
	rs := s.records()
	var buf bytes.Buffer
	for _, e := range rs {
		line, err := s.encodeLocked(e.rec)
		if err != nil {
			return err
		}
		buf.Write(line)
	}
	f, err := atomicfile.Replace(s.path, buf.Bytes(), false, nil)
	if err != nil {
		return err
	}
	rf, err := rawsock.NewFile(f)
	if err != nil {
		_ = f.Close()
		return err
	}
	if s.f != nil {
		_ = s.f.Close()
	}
	s.f, s.appends = rf, 0
	s.sweepFragmentsLocked(rs)
	return nil
}

func (s *Store) sweepFragmentsLocked(rs []*entry) {
	live := map[string]bool{}
	for _, e := range rs {
		each(&e.rec.Task, func(p *Part) {
			if p.Text == nil || len(*p.Text) <= FragmentSize {
				return
			}
			for off := 0; off < len(*p.Text); off += FragmentSize {
				sum := sha256.Sum256([]byte((*p.Text)[off:min(off+FragmentSize, len(*p.Text))]))
				live[hex.EncodeToString(sum[:])] = true
			}
		})
	}
	entries, err := os.ReadDir(s.frags)
	if err != nil {
		return
	}
	for _, e := range entries {
		if !live[e.Name()] {
			_ = os.Remove(filepath.Join(s.frags, e.Name()))
		}
	}
}

// records is every entry, oldest change first.
func (s *Store) records() []*entry {
	rs := make([]*entry, 0, s.order.Len())
	for el := s.order.Front(); el != nil; el = el.Next() {
		rs = append(rs, el.Value.(*entry))
	}
	return rs
}

// trimConvLocked applies max_per_context to one conversation: its oldest
// finished tasks go first. Only the conversation a change touched can have
// grown past it.
func (s *Store) trimConvLocked(l *list.List) {
	for el := l.Front(); el != nil && l.Len() > s.policy.MaxPerContext; {
		next := el.Next()
		if e := el.Value.(*entry); Terminal(e.rec.Task.Status.State) {
			s.dropLocked(e)
		}
		el = next
	}
}

// expireLocked applies the TTL, the global ceiling and the byte bound,
// oldest change first. A task still in flight is never evicted.
func (s *Store) expireLocked(now time.Time) {
	for el := s.order.Front(); el != nil; {
		e := el.Value.(*entry)
		if now.Sub(e.rec.Updated) <= s.policy.TTL && len(s.tasks) <= MaxTasks && s.bytes <= s.policy.MaxBytes {
			return
		}
		next := el.Next()
		if Terminal(e.rec.Task.Status.State) {
			s.dropLocked(e)
		}
		el = next
	}
}

// Get is the task id in the caller's scope; a task outside it does not
// exist.
func (s *Store) Get(principal, profile, id string) (*Record, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.expireLocked(time.Now())
	e := s.tasks[id]
	if e == nil || e.rec.Principal != principal || e.rec.Profile != profile {
		return nil, false
	}
	return e.rec.copy(), true
}

// List is the caller's tasks on profile matching f, newest change first.
func (s *Store) List(principal, profile string, f func(*Record) bool) []*Record {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.expireLocked(time.Now())
	var out []*Record
	for el := s.order.Back(); el != nil; el = el.Prev() {
		r := el.Value.(*entry).rec
		if r.Principal == principal && r.Profile == profile && f(r) {
			out = append(out, r.copy())
		}
	}
	return out
}

// TakeInterrupted reports, once, whether the conversation had a task in
// flight when the broker stopped: its instance, if it survived, may still
// be inside that turn.
func (s *Store) TakeInterrupted(principal, profile, context string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	k := scope{principal, profile, context}
	was := s.interrupted[k]
	delete(s.interrupted, k)
	return was
}

// Close closes the file.
func (s *Store) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.f != nil {
		_ = s.f.Close()
		s.f = nil
	}
}

// AgentMessage is a status message from the agent's side of t.
func AgentMessage(t Task, text string) *Message {
	return &Message{MessageID: NewID(), ContextID: t.ContextID, TaskID: t.ID, Role: RoleAgent, Parts: []Part{TextPart(text)}}
}
