package spawnd

import (
	"bytes"
	"container/list"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sync"

	"github.com/nexus-broker/nexus-broker/internal/atomicfile"
	"github.com/nexus-broker/nexus-broker/internal/safedir"
	"github.com/nexus-broker/nexus-broker/pkg/sessionid"
)

// The session → binary index, <state_dir>/session-binaries.jsonl, remembers
// which entry ran a session after its lease is gone, so the gateway can hold
// a resume to the binary that created the session (Binding). The lease
// journal cannot: it is compacted down to live leases, and a resume always
// follows a release.
//
// It is best-effort by design, unlike the journal: an unknown session means
// "no opinion, proceed", so losing the tail to a crash only degrades to how
// resumes behaved before the index existed. That is why it is never fsynced,
// why a bad line is skipped, and why an index that cannot be opened turns
// the feature off instead of failing the boot.

const (
	indexFile = "session-binaries.jsonl"
	// maxBindings caps the index; the binding written longest ago goes first.
	maxBindings = 4096
	// indexCompactEvery bounds the file to maxBindings plus this many lines.
	indexCompactEvery = 256
)

// binding is one line of the index.
type binding struct {
	SessionID string `json:"session_id"`
	Entry     string `json:"entry"`
}

// sessionIndex is the index in memory, oldest binding first, and the file
// it appends to. A nil *sessionIndex is an index that is off.
type sessionIndex struct {
	log   *slog.Logger
	path  string
	limit int

	mu        sync.Mutex
	f         *os.File // nil once closed
	appends   int      // since the last compaction
	order     *list.List
	bySession map[string]*list.Element
}

// openSessionIndex replays and compacts <stateDir>/session-binaries.jsonl,
// holding at most limit bindings. It returns nil, after one WARN, when the
// file cannot be read or rewritten.
func openSessionIndex(stateDir string, limit int, log *slog.Logger) *sessionIndex {
	x := &sessionIndex{
		log:       log,
		path:      filepath.Join(stateDir, indexFile),
		limit:     limit,
		order:     list.New(),
		bySession: map[string]*list.Element{},
	}
	atomicfile.RemoveTemps(filepath.Join(stateDir, indexFile))
	data, err := safedir.ReadOwned(x.path)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		// The index never prevents a boot: one spawnd did not write alone
		// (or cannot read) is set aside, kept for the operator, and a
		// fresh one started.
		aside := x.path + ".set-aside"
		if rerr := os.Rename(x.path, aside); rerr != nil {
			x.off(fmt.Errorf("%w; and setting it aside failed: %v", err, rerr))
			return nil
		}
		log.Warn("the session → binary index is not nexus-spawnd's own, so it was set aside and a fresh one started; "+
			"resumes of sessions it recorded are not checked against their binary", "path", x.path, "set_aside", aside, "error", err)
		data = nil
	}
	n := 0
	for raw := range bytes.Lines(data) {
		n++
		var b binding
		if err := json.Unmarshal(raw, &b); err != nil || sessionid.Validate(b.SessionID) != nil || b.Entry == "" {
			log.Warn("skipping a session → binary index line that is not a whole binding (torn by a crash mid-write, edited, or written before session ids were checked)",
				"path", x.path, "line", n)
			continue
		}
		x.remember(b)
	}
	if err := x.compact(); err != nil {
		x.off(err)
		return nil
	}
	return x
}

func (x *sessionIndex) off(err error) {
	x.log.Warn("the session → binary index cannot be used, so resumes are not checked against the binary that created their session; "+
		"fix or remove the file and restart nexus-spawnd to turn the check back on",
		"path", x.path, "error", err)
}

// bind records that entry ran session.
func (x *sessionIndex) bind(session, entry string) {
	if x == nil || session == "" {
		return
	}
	b := binding{SessionID: session, Entry: entry}
	line, err := json.Marshal(b)
	if err != nil {
		return
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.f == nil {
		return
	}
	x.remember(b)
	if _, err := x.f.Write(append(line, '\n')); err != nil {
		x.log.Warn("appending to the session → binary index failed; this binding is kept in memory only",
			"path", x.path, "error", err)
	}
	x.appends++
	if x.appends >= indexCompactEvery {
		x.appends = 0
		if err := x.compact(); err != nil {
			x.log.Warn("compacting the session → binary index failed; appending to it uncompacted until the next try",
				"path", x.path, "error", err)
		}
	}
}

// remember makes b the newest binding, dropping the oldest beyond the cap.
// Replaying the file through it rebuilds exactly the set it built live.
func (x *sessionIndex) remember(b binding) {
	if e := x.bySession[b.SessionID]; e != nil {
		x.order.MoveToBack(e)
		e.Value = b
	} else {
		x.bySession[b.SessionID] = x.order.PushBack(b)
	}
	for x.order.Len() > x.limit {
		oldest := x.order.Remove(x.order.Front()).(binding)
		delete(x.bySession, oldest.SessionID)
	}
}

// lookup is the entry bound to session, or "" for no opinion.
func (x *sessionIndex) lookup(session string) string {
	if x == nil {
		return ""
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if e := x.bySession[session]; e != nil {
		return e.Value.(binding).Entry
	}
	return ""
}

// compact rewrites the file as the bindings in memory, oldest first.
func (x *sessionIndex) compact() error {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	for e := x.order.Front(); e != nil; e = e.Next() {
		if err := enc.Encode(e.Value.(binding)); err != nil {
			return err
		}
	}
	f, err := atomicfile.Replace(x.path, buf.Bytes(), false, nil)
	if err != nil {
		return err
	}
	if x.f != nil {
		_ = x.f.Close()
	}
	x.f = f
	return nil
}

func (x *sessionIndex) close() {
	if x == nil {
		return
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.f != nil {
		_ = x.f.Close()
		x.f = nil
	}
}
