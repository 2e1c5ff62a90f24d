package spawnd

// journal makes lease transitions durable. It is the seam for a later change
// that appends to <state_dir>/leases.jsonl (fsynced) and, at boot, re-adopts
// the instances a previous nexus-spawnd left running, proving each one's
// identity by pid and start time rather than by a live pid alone. Until then
// Daemon.journal is nil and every call below is skipped.
//
// A journal write must never fail the verb that caused it: a lost record
// costs a re-adoption, a refused spawn costs a user's session.
type journal interface {
	// minted is called when Spawn admits a lease, before exec.
	minted(leaseRecord)
	// started is called once the instance runs and its pid and start time
	// are known.
	started(leaseRecord)
	// recorded is called when Record learns the lease's session id.
	recorded(leaseRecord)
	// ended is called after the instance is reaped, with Reason set.
	ended(leaseRecord)
}

// leaseRecord is a lease as the journal will store it, one JSON line per
// transition. It never holds a secret: the spawn secret is derived again
// from the spawn-key and the lease id when it is needed.
type leaseRecord struct {
	LeaseID   string `json:"lease_id"`
	Principal string `json:"principal,omitempty"`
	// Entry is the binaries: entry name, never its path.
	Entry     string `json:"entry"`
	SessionID string `json:"session_id,omitempty"`
	PID       int    `json:"pid,omitempty"`
	// StartTime is field 22 of /proc/<pid>/stat, in clock ticks since boot.
	// With the pid it tells a surviving instance from an unrelated process
	// that was handed the same pid while nexus-spawnd was down.
	StartTime       uint64 `json:"start_time,omitempty"`
	CreatedUnixNano int64  `json:"created_unix_nano"`
	// Reason is why the lease ended: the Terminate reason, or
	// reasonExited when the instance exited on its own.
	Reason string `json:"reason,omitempty"`
}

// reasonExited is the teardown reason of an instance that exited without
// being asked to.
const reasonExited = "instance exited"

// journalize hands rec to one journal step when a journal is installed.
func (d *Daemon) journalize(step func(journal, leaseRecord), rec leaseRecord) {
	if d.journal != nil {
		step(d.journal, rec)
	}
}
