// Package bindindex is the key → record file of a state_dir (spawnd's lease
// journal and session → binary index, the gateway's A2A context index): one
// JSON line per record, appended, replayed so each key's last line is its
// record, and rewritten on open and every CompactEvery appends.
//
// An index is best-effort, since an unknown key means "no opinion": never
// fsynced, capped (oldest dropped first), and turned off with one WARN when
// it cannot be opened. A durable file (the journal) is fsynced on every
// append, refuses the boot when unreadable, and fails on the first write
// or fsync error: Put then reports every record it could not make durable,
// and the file is rewritten whole from memory once writes work again
// (Failed, Rewrite). A torn or invalid line is skipped with a WARN. Without
// a file an index lives in memory, capped.
//
// Both nexus-broker and nexus-spawnd link it, so it may import none of
// the gateway's layers nor anything else gateway-side
// (internal/gateway/layers_test.go and cmd/nexus-spawnd's deps test check
// it).
package bindindex

import (
	"bytes"
	"cmp"
	"container/list"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sync"

	"github.com/nexus-broker/nexus-broker/internal/atomicfile"
)

// CompactEvery is the default number of appends between rewrites.
const CompactEvery = 256

// Spec describes one file, how a record names its key (ok false: not a
// whole record), and the words of its log lines.
type Spec[B any] struct {
	// Path is the file; "" keeps the index in memory only, capped alike.
	Path string
	// Limit caps the records kept; 0 keeps every one.
	Limit int
	Key   func(B) (key string, ok bool)
	// Ends, when set, reports a record that ends its key: it is written,
	// and the key forgotten.
	Ends func(B) bool
	// Accept, when set, decides under the lock whether b is written, given
	// the key's record (had: whether it has one).
	Accept func(old B, had bool, b B) bool
	// Durable fsyncs every append and rewrite.
	Durable bool
	// WrittenFirst keeps a record in memory only once it is written
	// (fsynced, when Durable): a Put that fails leaves the index as it
	// was, for records that must not be acted on unless they outlive a
	// restart (a principal's uid).
	WrittenFirst bool
	// CompactEvery overrides the package's.
	CompactEvery int
	// What names the file in log lines ("session → binary index").
	What string
	// Off says what is lost while the index is off, and the remedy.
	Off string
	// Failed, when set, is the WARN of a file that cannot be opened (the
	// message of upstream's counterpart), Off then a key of it.
	Failed string
	// Skip is the WARN of a line that is not a whole record.
	Skip string
	// Lost says what a failed append costs (a durable file: until it is
	// rewritten).
	Lost string
	// Read reads the file; nil is os.ReadFile.
	Read func(path string) ([]byte, error)
	// SetAside, when set, is the WARN for a file Read refuses, renamed to
	// <path>.set-aside and replaced by a fresh one instead of turning off.
	SetAside string
}

// entry is a record and its line as read, which a compaction writes back
// byte for byte (another writer's fields included).
type entry[B any] struct {
	key  string
	b    B
	line []byte
}

// Index is the records in memory, oldest first, and the file it
// appends to. A nil *Index is an index that is off.
type Index[B any] struct {
	spec Spec[B]
	log  *slog.Logger

	mu     sync.Mutex
	f      *os.File // nil when memory-only or closed
	closed bool
	// torn: the file may not end in a newline (a failed write), so the
	// next append starts a new line.
	torn bool
	// failed is the write or fsync error that took a durable file down;
	// f is closed then and never written again: after a failed fsync the
	// kernel may have dropped the pages it could not write and marked them
	// clean, so a second fsync of that descriptor could succeed over a
	// hole. Until a rewrite succeeds, every Put rewrites the file from the
	// records in memory (with the new one) instead of appending.
	failed  error
	appends int
	skipped int // lines replay could not use
	order   *list.List
	byKey   map[string]*list.Element
}

// Open replays and compacts the file. It returns nil, after one WARN, when
// the file cannot be read or rewritten.
func Open[B any](spec Spec[B], log *slog.Logger) *Index[B] {
	x, err := OpenRequired(spec, log)
	if err != nil {
		if spec.Failed != "" {
			log.Warn(spec.Failed, "state_dir", filepath.Dir(spec.Path), "error", err, "path", spec.Path, "remedy", spec.Off)
		} else {
			log.Warn("the "+spec.What+" cannot be used, so "+spec.Off, "path", spec.Path, "error", err)
		}
		return nil
	}
	return x
}

// OpenRequired replays and compacts a file its caller needs, returning an
// error when it cannot be read. A durable file it cannot rewrite is appended
// to as it is, after an ERROR: it replays to the same records.
func OpenRequired[B any](spec Spec[B], log *slog.Logger) (*Index[B], error) {
	x := &Index[B]{spec: spec, log: log, order: list.New(), byKey: map[string]*list.Element{}}
	if spec.Path == "" {
		return x, nil
	}
	atomicfile.RemoveTemps(spec.Path)
	read := spec.Read
	if read == nil {
		read = os.ReadFile
	}
	data, err := read(spec.Path)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		if spec.SetAside == "" {
			return x, err
		}
		aside := spec.Path + ".set-aside"
		if rerr := os.Rename(spec.Path, aside); rerr != nil {
			return x, fmt.Errorf("%w; and setting it aside failed: %v", err, rerr)
		}
		log.Warn(spec.SetAside, "path", spec.Path, "set_aside", aside, "error", err)
		data = nil
	}
	n := 0
	for raw := range bytes.Lines(data) {
		n++
		if len(bytes.TrimSpace(raw)) == 0 {
			continue // the newline an append after a torn line starts with
		}
		var b B
		key, ok := "", json.Unmarshal(raw, &b) == nil
		if ok {
			key, ok = spec.Key(b)
		}
		if !ok {
			log.Warn(spec.Skip, "path", spec.Path, "line", n)
			x.skipped++
			continue
		}
		x.remember(key, b, slices.Clone(bytes.TrimSuffix(raw, []byte("\n"))))
	}
	err = x.compact(nil)
	if err != nil && spec.Durable {
		log.Error("compacting the "+spec.What+" at boot failed; appending to it uncompacted", "path", spec.Path, "error", err)
		x.torn = len(data) > 0 && data[len(data)-1] != '\n'
		x.f, err = os.OpenFile(spec.Path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	}
	return x, err
}

// Put records b, the newest record of its key, unless Accept refuses it.
// The record is kept in memory whatever happens on disk, unless the spec
// is WrittenFirst. The error says it is not durable: the write or fsync
// failed, or the file had failed and could not be rewritten yet; nil for a
// record Accept or Key refused.
func (x *Index[B]) Put(b B) error {
	if x == nil {
		return nil
	}
	key, ok := x.spec.Key(b)
	if !ok {
		return nil
	}
	line, err := json.Marshal(b)
	if err != nil {
		return nil
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.closed {
		return nil
	}
	if accept := x.spec.Accept; accept != nil {
		old, had := x.get(key)
		if !accept(old, had, b) {
			return nil
		}
	}
	// Otherwise remembered even if the write fails, for the next rewrite
	// to write.
	if !x.spec.WrittenFirst {
		x.remember(key, b, line)
	}
	switch {
	case x.failed != nil:
		var pending []byte
		if x.spec.WrittenFirst {
			pending = line
		}
		err = x.rewrite(pending) // b included
	case x.f == nil: // memory-only
	default:
		if err = x.write(line); err != nil {
			if x.spec.Durable {
				x.fail(err)
			} else {
				x.log.Warn("appending to the "+x.spec.What+" failed; "+x.spec.Lost, "path", x.spec.Path, "key", key, "error", err)
			}
			return err
		}
		x.appends++
	}
	if err != nil {
		return err
	}
	if x.spec.WrittenFirst {
		x.remember(key, b, line)
	}
	if x.appends >= cmp.Or(x.spec.CompactEvery, CompactEvery) {
		x.appends = 0
		// The file as it is stays whole and open: a failed compaction
		// costs only its size.
		if err := x.compact(nil); err != nil {
			lvl := slog.LevelWarn
			if x.spec.Durable {
				lvl = slog.LevelError
			}
			x.log.Log(context.Background(), lvl, "compacting the "+x.spec.What+" failed; appending to it uncompacted until the next try",
				"path", x.spec.Path, "error", err)
		}
	}
	return nil
}

// fail takes a durable file down after a write or fsync error. The caller
// holds x.mu.
func (x *Index[B]) fail(err error) {
	_ = x.f.Close()
	x.f, x.failed = nil, err
	x.log.Error("writing the "+x.spec.What+" failed; "+x.spec.Lost+"; it is rewritten from memory once writes work again",
		"state_dir", filepath.Dir(x.spec.Path), "path", x.spec.Path, "error", err)
}

// rewrite replaces a failed file with the records in memory and the
// pending line, if any (a temp file, fsynced, renamed over it, the
// directory fsynced). The caller holds x.mu.
func (x *Index[B]) rewrite(pending []byte) error {
	if err := x.compact(pending); err != nil {
		return err
	}
	x.log.Info("the "+x.spec.What+" was rewritten from memory after a failed write; appending to it again",
		"path", x.spec.Path, "records", x.order.Len(), "was", x.failed)
	x.failed, x.appends = nil, 0
	return nil
}

// Failed is the error that took a durable file down, nil while it works.
func (x *Index[B]) Failed() error {
	if x == nil {
		return nil
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.failed
}

// Rewrite retries a failed file's rewrite, so that it recovers without
// waiting for a Put; nil once the file works again (or never failed).
func (x *Index[B]) Rewrite() error {
	if x == nil {
		return nil
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.failed == nil || x.closed {
		return nil
	}
	return x.rewrite(nil)
}

// write appends one line in a single write(2), fsynced when durable. The
// caller holds x.mu.
func (x *Index[B]) write(line []byte) error {
	buf := make([]byte, 0, len(line)+2)
	if x.torn {
		buf = append(buf, '\n')
	}
	buf = append(append(buf, line...), '\n')
	_, err := x.f.Write(buf)
	x.torn = err != nil
	if err == nil && x.spec.Durable {
		err = x.f.Sync()
	}
	return err
}

// remember makes b the newest record (forgetting its key when b ends it)
// and drops the oldest beyond the cap, live and in replay alike.
func (x *Index[B]) remember(key string, b B, line []byte) {
	if e := x.byKey[key]; e != nil {
		x.order.Remove(e)
		delete(x.byKey, key)
	}
	if x.spec.Ends != nil && x.spec.Ends(b) {
		return
	}
	x.byKey[key] = x.order.PushBack(entry[B]{key, b, line})
	for x.spec.Limit > 0 && x.order.Len() > x.spec.Limit {
		oldest := x.order.Remove(x.order.Front()).(entry[B])
		delete(x.byKey, oldest.key)
	}
}

// Get is the record of key; ok false means no opinion.
func (x *Index[B]) Get(key string) (b B, ok bool) {
	if x == nil {
		return b, false
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.get(key)
}

func (x *Index[B]) get(key string) (b B, ok bool) {
	if e := x.byKey[key]; e != nil {
		return e.Value.(entry[B]).b, true
	}
	return b, false
}

// All is every record, oldest first.
func (x *Index[B]) All() []B {
	x.mu.Lock()
	defer x.mu.Unlock()
	out := make([]B, 0, x.order.Len())
	for e := x.order.Front(); e != nil; e = e.Next() {
		out = append(out, e.Value.(entry[B]).b)
	}
	return out
}

// compact rewrites the file as the records in memory, oldest first, then
// the pending line, if any.
func (x *Index[B]) compact(pending []byte) error {
	var buf bytes.Buffer
	for e := x.order.Front(); e != nil; e = e.Next() {
		buf.Write(e.Value.(entry[B]).line)
		buf.WriteByte('\n')
	}
	if pending != nil {
		buf.Write(pending)
		buf.WriteByte('\n')
	}
	f, err := atomicfile.Replace(x.spec.Path, buf.Bytes(), x.spec.Durable, nil)
	if err != nil {
		return err
	}
	if x.f != nil {
		_ = x.f.Close()
	}
	x.f, x.torn = f, false
	return nil
}

// Opened is how many records the open kept and how many lines it skipped,
// for a caller's boot line.
func (x *Index[B]) Opened() (records, skipped int) {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.order.Len(), x.skipped
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
