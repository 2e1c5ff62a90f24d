package a2a

import (
	"bytes"
	"container/list"
	"encoding/json"
	"errors"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
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
