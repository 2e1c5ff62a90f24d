package spawnd

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/bindindex"
	"github.com/nexus-broker/nexus-broker/internal/safedir"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// The lease journal, <state_dir>/leases.jsonl, lets a restarted nexus-spawnd
// re-adopt the instances its predecessor left running (recover.go). Each line
// is a transition and the whole lease after it, so a lease's last line is its
// state. Every append is fsynced: a power loss must not take the record that
// carries an instance's pid, without which it is an orphan nobody can prove
// is ours. A lease the journal cannot record is refused (Spawn fails with
// SPAWN_STEP_JOURNAL): answered, it would be lost to the next restart with
// its instance orphaned. After a failed write or fsync the journal is down
// (bindindex) until rewritten whole from the leases in memory, which
// healJournal retries; teardowns never wait for it, and the rewrite records
// them.

const (
	journalFile = "leases.jsonl"
	// stateLockFile is flocked for the Daemon's life, so two nexus-spawnds
	// never append to one journal; not spawnd.lock, so a state_dir that is
	// also the run directory does not lock itself out.
	stateLockFile = "state.lock"
	// journalCompactEvery bounds the file between boots (about three
	// records per lease).
	journalCompactEvery = 512
)

// recordKind is the transition a journal line records.
type recordKind string

const (
	kindMinted   recordKind = "minted"   // Spawn admitted the lease; no process yet
	kindStarted  recordKind = "started"  // the instance runs: pid, start time, boot id known
	kindRecorded recordKind = "recorded" // Record learned the lease's session id, or its owner at a hand-out
	kindEnded    recordKind = "ended"    // torn down; Reason says why
)

// Teardown reasons spawnd writes itself; the others are Terminate's.
const (
	// reasonCrashed: exited before any Terminate, whatever its status (the
	// spec's crash is "died without a release").
	reasonCrashed = "crashed"
	// reasonSpawnFailed: exec failed; there never was a process.
	reasonSpawnFailed = "spawn failed"
	// reasonJournalFailed: the journal could not record the lease, so it
	// was refused (its instance, if it had started, killed).
	reasonJournalFailed = "journal unavailable"
)

// leaseRecord is a lease as the journal stores it. It never holds a secret:
// the spawn secret is derived again from the spawn-key and the lease id.
type leaseRecord struct {
	LeaseID   string `json:"lease_id"`
	Principal string `json:"principal"`
	SessionID string `json:"session_id,omitempty"`
	// Entry is the binaries: entry name, never its path.
	Entry string `json:"entry"`
	// Pool is the gateway's pool a warm lease was spawned for (its
	// Principal "" until the hand-out); kept after it, as HandedOut says.
	Pool      string `json:"pool,omitempty"`
	HandedOut bool   `json:"handed_out,omitempty"`
	PID       int    `json:"pid,omitempty"`
	// StartTime (field 22 of /proc/<pid>/stat) and BootID, with the pid,
	// tell a surviving instance from a process that was handed the same
	// pid while nexus-spawnd was down, or after a reboot.
	StartTime     uint64    `json:"start_time,omitempty"`
	BootID        string    `json:"boot_id,omitempty"`
	CreatedAt     time.Time `json:"created_at"`
	BrokerID      string    `json:"broker_id"`
	AdvertiseAddr string    `json:"advertise_addr,omitempty"`
	// ConfigPath is the temp config, removed by whichever nexus-spawnd
	// sees the instance go.
	ConfigPath string `json:"config_path,omitempty"`
	// Reason is why the lease ended (kindEnded only).
	Reason string `json:"reason,omitempty"`
	// CgroupLeft is why the lease's cgroup outlived it (kindEnded only);
	// its removal is retried.
	CgroupLeft string `json:"cgroup_left,omitempty"`

	// seq orders snapshots of one lease: verbs append after releasing
	// Daemon.mu, so an older snapshot may arrive last, and is dropped.
	seq uint64
}

// journalLine is one line of leases.jsonl.
type journalLine struct {
	Kind recordKind `json:"kind"`
	leaseRecord
}

// valid is what replay requires of a line before trusting it.
func (jl journalLine) valid() bool {
	switch jl.Kind {
	case kindMinted, kindStarted, kindRecorded, kindEnded:
		return validLeaseID(jl.LeaseID) && jl.BrokerID != ""
	}
	return false
}

// journalSpec is leases.jsonl of brokerID in stateDir, a bindindex keyed
// file: a lease's last line is its state and an ended lease is forgotten,
// so a compaction writes back this broker's live leases and the last line
// of each lease of another broker id, which is not ours to adopt, close out
// or rewrite.
func journalSpec(stateDir, brokerID string) bindindex.Spec[journalLine] {
	return bindindex.Spec[journalLine]{
		Path: filepath.Join(stateDir, journalFile),
		Key: func(jl journalLine) (string, bool) {
			if jl.BrokerID != brokerID {
				return jl.BrokerID + "/" + jl.LeaseID, jl.valid()
			}
			return jl.LeaseID, jl.valid()
		},
		Ends: func(jl journalLine) bool { return jl.Kind == kindEnded },
		// A snapshot of a lease already ended, or older than one already
		// written, comes from a verb that raced the lease's exit or another
		// verb: it is dropped.
		Accept: func(old journalLine, had bool, jl journalLine) bool {
			if jl.Kind == kindMinted {
				return !had
			}
			return had && jl.seq > old.seq
		},
		Durable:      true,
		CompactEvery: journalCompactEvery,
		What:         "lease journal",
		Skip:         "skipping a lease journal line that is not a whole record (torn by a crash mid-write, or edited)",
		Lost:         "new leases are refused until then, while releases and exits go on",
		// spawnd signals what its journal records: one it did not write
		// itself is never read.
		Read: safedir.ReadOwned,
	}
}

// openJournal replays <stateDir>/leases.jsonl and compacts it, returning the
// journal and this broker's live leases. Only a journal that cannot be read
// or written at all refuses the boot: running on without it would strand
// every instance it records.
func openJournal(stateDir, brokerID string, log *slog.Logger) (*bindindex.Index[journalLine], []leaseRecord, error) {
	spec := journalSpec(stateDir, brokerID)
	idx, err := bindindex.OpenRequired(spec, log)
	if err != nil {
		return nil, nil, fmt.Errorf("lease journal %s cannot be used: %w; fix it (it must be a regular file of nexus-spawnd's own, mode 0600), "+
			"or move it aside to boot without re-adopting the instances it records", spec.Path, err)
	}
	var live []leaseRecord
	for _, jl := range idx.All() {
		if jl.BrokerID == brokerID {
			live = append(live, jl.leaseRecord)
		}
	}
	records, skipped := idx.Opened()
	logOpened(log, spec.Path, "lease journal", records, skipped, "live_leases", len(live))
	return idx, live, nil
}

// logOpened writes upstream's boot lines of a replayed state file: one WARN
// counting the torn records it skipped, and "<what> opened" with count
// under countKey.
func logOpened(log *slog.Logger, path, what string, records, skipped int, countKey string, count int) {
	if skipped > 0 {
		log.Warn("skipped unreadable "+what+" records; the broker was most likely killed mid-write", "path", path, "skipped", skipped, "read", records)
	}
	log.Info(what+" opened", "path", path, countKey, count, "skipped_records", skipped)
}

// lockStateDir takes <stateDir>/state.lock for the Daemon's life, with its
// pid for a second nexus-spawnd's error. It is close-on-exec, so no instance
// inherits the lock.
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

// journalRetryEvery is how often a failed journal's rewrite is retried, so
// that claims (and the gateway's /readyz) recover soon after space comes
// back, with or without a Spawn to try it.
const journalRetryEvery = time.Second

// healJournal retries a failed journal's rewrite until spawnd closes.
func (d *Daemon) healJournal() {
	defer d.wg.Done()
	tick := time.NewTicker(journalRetryEvery)
	defer tick.Stop()
	for {
		select {
		case <-d.closing:
			return
		case <-tick.C:
			_ = d.journal.Rewrite() // logged by bindindex when it works
		}
	}
}

// journalRefusal is Spawn's answer for a lease the journal could not
// record, logged with the state_dir and the error. The answer names neither:
// a client's body never carries a host path.
func (d *Daemon) journalRefusal(id, entry string, err error, done string) error {
	d.log.Error("spawning instance refused: the lease journal cannot record it; "+done,
		"lease_id", id, "entry", entry, "state_dir", d.stateDir, "error", err)
	return spawnFailed(spawnpb.SpawnStep_SPAWN_STEP_JOURNAL,
		fmt.Errorf("the lease journal cannot record the lease (%s); %s; retry once it is rewritten", d.journalError(), done))
}

// journalError is why the journal cannot record a lease now, "" while it
// can (or without a state_dir): the errno's words alone, as the gateway's
// /readyz shows them, never a path.
func (d *Daemon) journalError() string {
	return errnoWords(d.journal.Failed(), "the lease journal cannot be written")
}

// errnoWords is the words of err's errno, else fallback; "" for no error.
func errnoWords(err error, fallback string) string {
	if err == nil {
		return ""
	}
	var errno syscall.Errno
	if errors.As(err, &errno) {
		return errno.Error()
	}
	return fallback
}
