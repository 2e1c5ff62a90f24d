package spawnd

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/atomicfile"
	"github.com/nexus-broker/nexus-broker/internal/safedir"
)

// The lease journal, <state_dir>/leases.jsonl, is what lets a restarted
// nexus-spawnd re-adopt the instances its predecessor left running
// (recover.go). Without a state_dir there is none, and lease state lives in
// memory only.
//
// Each line is one JSON object: the kind of transition and the whole lease as
// it stood after it, so a lease's last line is its state and replay never
// merges fields. Every append is fsynced before it returns: the record that
// carries an instance's pid and start time is the one a power loss must not
// take, because without it the instance is an orphan nobody can prove is
// ours. A failed write or fsync is logged and never fails the verb that
// caused it: a lost record costs a re-adoption, a refused spawn costs a
// user's session.

const (
	journalFile = "leases.jsonl"
	// stateLockFile is flocked for the Daemon's whole life, so two
	// nexus-spawnds never append to one journal. It is not the run
	// directory's spawnd.lock, so a state_dir that is also the run directory
	// does not lock itself out.
	stateLockFile = "state.lock"
	// journalCompactEvery bounds the file between boots: about three
	// records per lease, so the file holds roughly the live set plus the
	// last few hundred leases.
	journalCompactEvery = 512
)

// recordKind is the transition a journal line records.
type recordKind string

const (
	kindMinted   recordKind = "minted"   // Spawn admitted the lease; no process yet
	kindStarted  recordKind = "started"  // the instance runs: pid, start time, boot id known
	kindRecorded recordKind = "recorded" // Record learned the lease's session id
	kindEnded    recordKind = "ended"    // torn down; Reason says why
)

// Teardown reasons spawnd writes itself; the others are Terminate's.
const (
	// reasonCrashed: the instance exited before any Terminate began its
	// teardown, as the spec's crash is "died without a release" whatever its
	// status (the log line of the exit carries that).
	reasonCrashed = "crashed"
	// reasonSpawnFailed: exec failed; there never was a process.
	reasonSpawnFailed = "spawn failed"
)

// leaseRecord is a lease as the journal stores it. It never holds a secret:
// the spawn secret is derived again from the spawn-key and the lease id.
type leaseRecord struct {
	LeaseID   string `json:"lease_id"`
	Principal string `json:"principal"`
	SessionID string `json:"session_id,omitempty"`
	// Entry is the binaries: entry name, never its path.
	Entry string `json:"entry"`
	PID   int    `json:"pid,omitempty"`
	// StartTime is field 22 of /proc/<pid>/stat, in clock ticks since boot,
	// and BootID is /proc/sys/kernel/random/boot_id. With the pid they tell
	// a surviving instance from an unrelated process that was handed the
	// same pid while nexus-spawnd was down, or after a reboot.
	StartTime     uint64    `json:"start_time,omitempty"`
	BootID        string    `json:"boot_id,omitempty"`
	CreatedAt     time.Time `json:"created_at"`
	BrokerID      string    `json:"broker_id"`
	AdvertiseAddr string    `json:"advertise_addr,omitempty"`
	// ConfigPath is the instance's temp config, for whichever nexus-spawnd
	// sees the instance go to remove.
	ConfigPath string `json:"config_path,omitempty"`
	// Reason is why the lease ended (kindEnded only).
	Reason string `json:"reason,omitempty"`
	// CgroupLeft is why the lease's cgroup was still there when it ended
	// (kindEnded only): its members, and their state. spawnd retries the
	// removal, and a later boot's sweep finishes it.
	CgroupLeft string `json:"cgroup_left,omitempty"`

	// seq orders snapshots of one lease (lease.snapshot). Verbs append
	// after releasing Daemon.mu, so two snapshots may reach the journal in
	// the other order; the older is then dropped.
	seq uint64
}

// journalLine is one line of leases.jsonl.
type journalLine struct {
	Kind recordKind `json:"kind"`
	leaseRecord
}

// leaseJournal appends to leases.jsonl and keeps, in memory, exactly what a
// compaction writes back: this broker's live leases, one line each, and the
// lines of other broker ids verbatim.
type leaseJournal struct {
	log  *slog.Logger
	path string
	// skipSync leaves out every fsync; only BenchmarkJournalAppend's
	// baseline sets it, to measure what the barrier costs.
	skipSync bool

	mu sync.Mutex
	f  *os.File // nil once closed
	// torn is set when the file may not end in a newline (a torn line
	// found at open, a failed write): the next append starts a new line
	// rather than completing the broken one.
	torn    bool
	appends int // since the last compaction
	live    map[string]*liveLine
	next    int // orders live lines as they were first written
	// foreign are the lines of other broker ids, kept byte for byte: they
	// are not ours to adopt, close out or rewrite.
	foreign [][]byte
}

type liveLine struct {
	pos  int
	seq  uint64
	line []byte
}

// openJournal replays <stateDir>/leases.jsonl and compacts it, returning the
// journal and this broker's live leases in the order they were minted. A
// torn or corrupt line is skipped with a WARN naming it. Only a journal that
// cannot be read or written at all refuses the boot: running on without it
// would strand every instance it records.
func openJournal(stateDir, brokerID string, log *slog.Logger) (*leaseJournal, []leaseRecord, error) {
	j := &leaseJournal{log: log, path: filepath.Join(stateDir, journalFile), live: map[string]*liveLine{}}
	atomicfile.RemoveTemps(filepath.Join(stateDir, journalFile)) // only the state_dir lock holder gets here
	// spawnd signals what its journal records: one it did not write itself
	// is never read.
	data, err := safedir.ReadOwned(j.path)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, nil, fmt.Errorf("lease journal %s cannot be read: %w; fix it (it must be a regular file of nexus-spawnd's own, mode 0600), "+
			"or move it aside to boot without re-adopting the instances it records", j.path, err)
	}
	recs := map[string]leaseRecord{}
	n := 0
	for raw := range bytes.Lines(data) {
		n++
		line := bytes.TrimSuffix(raw, []byte("\n"))
		if len(bytes.TrimSpace(line)) == 0 {
			continue // the newline a write after a torn line starts with
		}
		var jl journalLine
		if err := json.Unmarshal(line, &jl); err != nil || !jl.valid() {
			if err == nil {
				err = errors.New("not a complete lease record")
			}
			log.Warn("skipping a lease journal line that is not a whole record (torn by a crash mid-write, or edited)",
				"path", j.path, "line", n, "error", err)
			continue
		}
		line = slices.Clone(line)
		switch {
		case jl.BrokerID != brokerID:
			j.foreign = append(j.foreign, line)
		case jl.Kind == kindEnded:
			delete(j.live, jl.LeaseID)
			delete(recs, jl.LeaseID)
		default:
			if l := j.live[jl.LeaseID]; l != nil {
				l.line = line
			} else {
				j.live[jl.LeaseID] = &liveLine{pos: j.next, line: line}
				j.next++
			}
			recs[jl.LeaseID] = jl.leaseRecord
		}
	}
	j.torn = len(data) > 0 && data[len(data)-1] != '\n'

	if err := j.compact(); err != nil {
		// The file as it is still replays to the same state; append to it.
		log.Error("compacting the lease journal at boot failed; appending to it uncompacted", "path", j.path, "error", err)
		if j.f, err = os.OpenFile(j.path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600); err != nil {
			return nil, nil, fmt.Errorf("lease journal %s cannot be opened for appending: %w; fix its permissions or the file system under state_dir", j.path, err)
		}
	}
	live := make([]leaseRecord, 0, len(recs))
	for _, id := range j.liveOrder() {
		live = append(live, recs[id])
	}
	return j, live, nil
}

// valid is what replay requires of a line before trusting it.
func (jl *journalLine) valid() bool {
	switch jl.Kind {
	case kindMinted, kindStarted, kindRecorded, kindEnded:
		return validLeaseID(jl.LeaseID) && jl.BrokerID != ""
	}
	return false
}

// append journals one transition of one lease. A snapshot of a lease the
// journal has already ended, or older than one already written, is dropped:
// it comes from a verb that raced the lease's exit or another verb.
func (j *leaseJournal) append(kind recordKind, rec leaseRecord) {
	if j == nil {
		return
	}
	line, err := json.Marshal(journalLine{Kind: kind, leaseRecord: rec})
	if err != nil {
		j.log.Error("encoding a lease journal record failed", "lease_id", rec.LeaseID, "kind", kind, "error", err)
		return
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	l := j.live[rec.LeaseID]
	switch {
	case j.f == nil:
		return
	case kind == kindMinted:
		if l != nil {
			return
		}
		l = &liveLine{pos: j.next}
		j.next++
		j.live[rec.LeaseID] = l
	case l == nil || rec.seq <= l.seq:
		return
	}
	// The in-memory set changes even when the write fails, so the next
	// compaction writes what the failed append could not.
	if kind == kindEnded {
		delete(j.live, rec.LeaseID)
	} else {
		l.seq, l.line = rec.seq, line
	}
	if err := j.write(line); err != nil {
		j.log.Error("appending to the lease journal failed; the lease goes on, but a nexus-spawnd restart may not re-adopt its instance",
			"path", j.path, "lease_id", rec.LeaseID, "kind", kind, "error", err)
	}
	j.appends++
	if j.appends >= journalCompactEvery {
		j.appends = 0
		if err := j.compact(); err != nil {
			j.log.Error("compacting the lease journal failed; appending to it uncompacted until the next try",
				"path", j.path, "error", err)
		}
	}
}

// write appends one line in a single write(2) and fsyncs it. The caller
// holds j.mu.
func (j *leaseJournal) write(line []byte) error {
	buf := make([]byte, 0, len(line)+2)
	if j.torn {
		buf = append(buf, '\n')
	}
	buf = append(append(buf, line...), '\n')
	_, err := j.f.Write(buf)
	j.torn = err != nil
	if err == nil && !j.skipSync {
		err = j.f.Sync()
	}
	return err
}

// compact rewrites the journal as the foreign lines and one line per live
// lease: a temp file, fsynced, renamed over the journal, then the directory
// fsynced, so a crash at any point leaves the old file or the new one, never
// an empty or partial one. The caller holds j.mu (or is openJournal).
func (j *leaseJournal) compact() error {
	var buf bytes.Buffer
	for _, line := range j.foreign {
		buf.Write(line)
		buf.WriteByte('\n')
	}
	for _, id := range j.liveOrder() {
		buf.Write(j.live[id].line)
		buf.WriteByte('\n')
	}
	f, err := atomicfile.Replace(j.path, buf.Bytes(), !j.skipSync, nil)
	if err != nil {
		return err
	}
	if j.f != nil {
		_ = j.f.Close()
	}
	j.f, j.torn = f, false
	return nil
}

// liveOrder is the live lease ids, oldest first.
func (j *leaseJournal) liveOrder() []string {
	ids := make([]string, 0, len(j.live))
	for id := range j.live {
		ids = append(ids, id)
	}
	slices.SortFunc(ids, func(a, b string) int { return cmp.Compare(j.live[a].pos, j.live[b].pos) })
	return ids
}

// close closes the file; later appends are dropped. Live leases stay live in
// the journal: the next nexus-spawnd re-adopts them.
func (j *leaseJournal) close() {
	if j == nil {
		return
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.f != nil {
		_ = j.f.Close()
		j.f = nil
	}
}

// lockStateDir takes <stateDir>/state.lock for the Daemon's life and writes
// its pid there for the error a second nexus-spawnd gets. The descriptor is
// close-on-exec, so no instance inherits the lock and outlives us holding it.
func lockStateDir(stateDir string) (*os.File, error) {
	path := filepath.Join(stateDir, stateLockFile)
	f, err := safedir.LockPid(path, 0o600, func(f *os.File) error { return safedir.Owned(f, os.Geteuid()) })
	if held := (*safedir.HeldError)(nil); errors.As(err, &held) {
		return nil, fmt.Errorf("state_dir %s is in use by another nexus-spawnd (%v); two cannot share a lease journal: "+
			"stop that one, or give this one its own state_dir", stateDir, held)
	}
	if err != nil {
		return nil, fmt.Errorf("state_dir lock %s: %w", path, err)
	}
	return f, nil
}
