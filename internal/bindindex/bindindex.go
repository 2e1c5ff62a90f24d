// Package bindindex is the best-effort, capped key → binding file both
// auxiliary indexes of a state_dir use: spawnd's session → binary index and
// the gateway's A2A context → session index. One JSON line per binding,
// appended and never fsynced, rewritten on open and every CompactEvery
// appends, capped with the binding written longest ago dropped first. A
// torn line is skipped with a WARN and an index that cannot be opened turns
// itself off with one WARN, never failing the boot: an unknown key always
// means "no opinion", so losing the tail only degrades to forgetting. Without
// a file (no state_dir) an index lives in memory, capped the same way.
package bindindex

import (
	"bytes"
	"container/list"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"sync"

	"github.com/nexus-broker/nexus-broker/internal/atomicfile"
)

// CompactEvery bounds the file to the cap plus this many lines.
const CompactEvery = 256

// Spec describes one index: its file, its cap, how a binding names its key
// (ok false for a line that is not a whole binding), and the words its
// WARNs use.
type Spec[B any] struct {
	// Path is the file; "" keeps the index in memory only, capped alike.
	Path  string
	Limit int
	Key   func(B) (key string, ok bool)
	// What names the index in log lines ("session → binary index").
	What string
	// Off says what is lost while the index is off, and how to get it
	// back.
	Off string
	// Torn says, in the skip WARN, why a line may not be a whole binding.
	Torn string
	// Read reads the file; nil is os.ReadFile.
	Read func(path string) ([]byte, error)
	// SetAside, when set, is the WARN for a file Read refuses: it is
	// renamed to <path>.set-aside and a fresh index started, rather than
	// the index turning itself off.
	SetAside string
}

type entry[B any] struct {
	key string
	b   B
}

// Index is the index in memory, oldest binding first, and the file it
// appends to. A nil *Index is an index that is off.
type Index[B any] struct {
	spec Spec[B]
	log  *slog.Logger

	mu      sync.Mutex
	f       *os.File // nil when memory-only or closed
	closed  bool
	appends int
	order   *list.List
	byKey   map[string]*list.Element
}

// Open replays and compacts the file. It returns nil, after one WARN, when
// the file cannot be read or rewritten.
func Open[B any](spec Spec[B], log *slog.Logger) *Index[B] {
	x := &Index[B]{spec: spec, log: log, order: list.New(), byKey: map[string]*list.Element{}}
	if spec.Path == "" {
		return x
	}
	atomicfile.RemoveTemps(spec.Path)
	read := spec.Read
	if read == nil {
		read = os.ReadFile
	}
	data, err := read(spec.Path)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		if spec.SetAside == "" {
			x.off(err)
			return nil
		}
		aside := spec.Path + ".set-aside"
		if rerr := os.Rename(spec.Path, aside); rerr != nil {
			x.off(fmt.Errorf("%w; and setting it aside failed: %v", err, rerr))
			return nil
		}
		log.Warn(spec.SetAside, "path", spec.Path, "set_aside", aside, "error", err)
		data = nil
	}
	n := 0
	for raw := range bytes.Lines(data) {
		n++
		var b B
		key, ok := "", json.Unmarshal(raw, &b) == nil
		if ok {
			key, ok = spec.Key(b)
		}
		if !ok {
			log.Warn("skipping a "+spec.What+" line that is not a whole binding ("+spec.Torn+")",
				"path", spec.Path, "line", n)
			continue
		}
		x.remember(key, b)
	}
	if err := x.compact(); err != nil {
		x.off(err)
		return nil
	}
	return x
}

func (x *Index[B]) off(err error) {
	x.log.Warn("the "+x.spec.What+" cannot be used, so "+x.spec.Off,
		"path", x.spec.Path, "error", err)
}

// Put records b, the newest binding of its key.
func (x *Index[B]) Put(b B) {
	if x == nil {
		return
	}
	key, ok := x.spec.Key(b)
	if !ok {
		return
	}
	line, err := json.Marshal(b)
	if err != nil {
		return
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.closed {
		return
	}
	x.remember(key, b)
	if x.f == nil {
		return // memory-only
	}
	if _, err := x.f.Write(append(line, '\n')); err != nil {
		x.log.Warn("appending to the "+x.spec.What+" failed; this binding is kept in memory only",
			"path", x.spec.Path, "error", err)
	}
	x.appends++
	if x.appends >= CompactEvery {
		x.appends = 0
		if err := x.compact(); err != nil {
			x.log.Warn("compacting the "+x.spec.What+" failed; appending to it uncompacted until the next try",
				"path", x.spec.Path, "error", err)
		}
	}
}

// remember makes b the newest binding, dropping the oldest beyond the cap.
// Replaying the file through it rebuilds exactly the set it built live.
func (x *Index[B]) remember(key string, b B) {
	if e := x.byKey[key]; e != nil {
		x.order.MoveToBack(e)
		e.Value = entry[B]{key, b}
	} else {
		x.byKey[key] = x.order.PushBack(entry[B]{key, b})
	}
	for x.order.Len() > x.spec.Limit {
		oldest := x.order.Remove(x.order.Front()).(entry[B])
		delete(x.byKey, oldest.key)
	}
}

// Get is the binding of key; ok false means no opinion.
func (x *Index[B]) Get(key string) (b B, ok bool) {
	if x == nil {
		return b, false
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if e := x.byKey[key]; e != nil {
		return e.Value.(entry[B]).b, true
	}
	return b, false
}

// compact rewrites the file as the bindings in memory, oldest first.
func (x *Index[B]) compact() error {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	for e := x.order.Front(); e != nil; e = e.Next() {
		if err := enc.Encode(e.Value.(entry[B]).b); err != nil {
			return err
		}
	}
	f, err := atomicfile.Replace(x.spec.Path, buf.Bytes(), false, nil)
	if err != nil {
		return err
	}
	if x.f != nil {
		_ = x.f.Close()
	}
	x.f = f
	return nil
}

// Close closes the file; later Puts are dropped.
func (x *Index[B]) Close() {
	if x == nil {
		return
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	x.closed = true
	if x.f != nil {
		_ = x.f.Close()
		x.f = nil
	}
}

// Len is how many bindings the index holds.
func (x *Index[B]) Len() int {
	if x == nil {
		return 0
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.order.Len()
}
