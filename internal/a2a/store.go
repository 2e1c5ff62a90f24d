package a2a

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/atomicfile"
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
	inflightFault = "the broker stopped while this task was in flight; send the message again"
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

// Clone deep-copies t through JSON (tasks are small, except their texts,
// which are shared immutable strings either way).
func (t *Task) Clone() Task {
	data, _ := json.Marshal(t) // a Task always marshals
	var c Task
	_ = json.Unmarshal(data, &c)
	return c
}

// Store holds every task in memory and mirrors it to the file. A nil dir is
// memory-only. Methods are safe for concurrent use.
type Store struct {
	log    *slog.Logger
	path   string // "" when memory-only
	frags  string
	policy Policy

	mu      sync.Mutex
	f       *os.File
	appends int
	tasks   map[string]*Record
	bytes   int64
}

// OpenStore replays <dir>/a2a-tasks.jsonl and settles every task a stopped
// broker left in flight at FAILED. dir "" is memory-only. A file that cannot
// be used logs a WARN and leaves the store memory-only: read-back is a
// convenience, never a reason to refuse the boot.
func OpenStore(dir string, p Policy, log *slog.Logger) *Store {
	s := &Store{log: log, policy: p, tasks: map[string]*Record{}}
	if dir == "" {
		return s
	}
	s.path = filepath.Join(dir, TasksFile)
	s.frags = filepath.Join(dir, FragmentsDir)
	atomicfile.RemoveTemps(s.path)
	if err := s.replay(); err != nil {
		s.off(err)
		return s
	}
	now := time.Now()
	for _, r := range s.tasks {
		if !Terminal(r.Task.Status.State) {
			r.Task.Status = Status{State: StateFailed, Timestamp: &now, Message: AgentMessage(r.Task, inflightFault)}
			r.Updated = now
		}
	}
	s.retainLocked(now)
	if err := s.compactLocked(); err != nil {
		s.off(err)
	}
	return s
}

func (s *Store) off(err error) {
	s.log.Warn("the A2A task store cannot be used; tasks are kept in memory only and will not read back after a restart",
		"path", s.path, "error", err)
	if s.f != nil {
		_ = s.f.Close()
		s.f = nil
	}
	s.path = ""
}

func (s *Store) replay() error {
	data, err := os.ReadFile(s.path)
	if errors.Is(err, fs.ErrNotExist) {
		return os.MkdirAll(s.frags, 0o700)
	}
	if err != nil {
		return err
	}
	if err := os.MkdirAll(s.frags, 0o700); err != nil {
		return err
	}
	n := 0
	for line := range bytes.Lines(data) {
		n++
		r, err := DecodeRecord(line)
		if err != nil {
			s.log.Warn("skipping an A2A task store line that is not a whole record (torn by a crash mid-write, or edited)",
				"path", s.path, "line", n, "error", err)
			continue
		}
		if err := s.inflate(&r.Task); err != nil {
			s.log.Warn("skipping an A2A task whose long text cannot be read back whole", "path", s.path, "line", n, "task_id", r.Task.ID, "error", err)
			continue
		}
		s.putLocked(r)
	}
	return nil
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

// Put stores r's current state, persisted before it returns: the ingress
// publishes a change only after Put.
func (s *Store) Put(r *Record) {
	c := *r
	c.Task = r.Task.Clone()
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	c.Updated = now
	s.putLocked(&c)
	s.appendLocked(&c)
	s.retainLocked(now)
}

func (s *Store) putLocked(r *Record) {
	if old := s.tasks[r.Task.ID]; old != nil {
		s.bytes -= old.bytes()
	}
	s.tasks[r.Task.ID] = r
	s.bytes += r.bytes()
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
// first.
func (s *Store) encodeLocked(r *Record) ([]byte, error) {
	c := *r
	c.Task = r.Task.Clone()
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
	line, err := json.Marshal(&c)
	return append(line, '\n'), err
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
	rs := s.sortedLocked()
	var buf bytes.Buffer
	for _, r := range rs {
		line, err := s.encodeLocked(r)
		if err != nil {
			return err
		}
		buf.Write(line)
	}
	f, err := atomicfile.Replace(s.path, buf.Bytes(), false, nil)
	if err != nil {
		return err
	}
	if s.f != nil {
		_ = s.f.Close()
	}
	s.f, s.appends = f, 0
	s.sweepFragmentsLocked(rs)
	return nil
}

func (s *Store) sweepFragmentsLocked(rs []*Record) {
	live := map[string]bool{}
	for _, r := range rs {
		each(&r.Task, func(p *Part) {
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

// sortedLocked is every record, oldest change first.
func (s *Store) sortedLocked() []*Record {
	rs := make([]*Record, 0, len(s.tasks))
	for _, r := range s.tasks {
		rs = append(rs, r)
	}
	sort.Slice(rs, func(i, j int) bool {
		if !rs[i].Updated.Equal(rs[j].Updated) {
			return rs[i].Updated.Before(rs[j].Updated)
		}
		return rs[i].Task.ID < rs[j].Task.ID
	})
	return rs
}

// retainLocked applies the retention policy to finished tasks: the TTL,
// then max_per_context per (caller, profile, context), then the global
// ceiling and the byte bound, oldest first. A task still in flight is never
// evicted.
func (s *Store) retainLocked(now time.Time) {
	perContext := map[[3]string]int{}
	for _, r := range s.tasks {
		perContext[[3]string{r.Principal, r.Profile, r.Task.ContextID}]++
	}
	for _, r := range s.sortedLocked() {
		if !Terminal(r.Task.Status.State) {
			continue
		}
		key := [3]string{r.Principal, r.Profile, r.Task.ContextID}
		if now.Sub(r.Updated) > s.policy.TTL || perContext[key] > s.policy.MaxPerContext ||
			len(s.tasks) > MaxTasks || s.bytes > s.policy.MaxBytes {
			perContext[key]--
			s.bytes -= r.bytes()
			delete(s.tasks, r.Task.ID)
		}
	}
}

// Get is the task id in the caller's scope; a task outside it does not
// exist.
func (s *Store) Get(principal, profile, id string) (*Record, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.retainLocked(time.Now())
	r := s.tasks[id]
	if r == nil || r.Principal != principal || r.Profile != profile {
		return nil, false
	}
	c := *r
	c.Task = r.Task.Clone()
	return &c, true
}

// List is the caller's tasks on profile matching f, newest change first.
func (s *Store) List(principal, profile string, f func(*Record) bool) []*Record {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.retainLocked(time.Now())
	rs := s.sortedLocked()
	out := make([]*Record, 0, len(rs))
	for i := len(rs) - 1; i >= 0; i-- {
		r := rs[i]
		if r.Principal == principal && r.Profile == profile && f(r) {
			c := *r
			c.Task = r.Task.Clone()
			out = append(out, &c)
		}
	}
	return out
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
