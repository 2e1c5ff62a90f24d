package spawnd

import (
	"cmp"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// Warm leases: a gateway's pools: keep instances booted before anyone
// claims them. spawnd knows no pool; it carries the name. A warm lease is
// spawned with a pool and no principal, journaled (fsynced) and re-adopted
// like any lease, with its pool, and is in waiting until Record with
// hand_out hands it out, once: its owner (the claim's principal, "" for an
// anonymous one) and the hand-out are journaled, and its session's owner
// indexed, both durably, before Record answers. From then on it is an
// ordinary lease: List names no pool for it, the journal keeps the name.

// maxPoolLen bounds a pool name, which spawnd only journals and lists (the
// gateway's is a pools: name of at most 64 bytes and a digest).
const maxPoolLen = 128

// checkWarm refuses a pool name that is not 1 to maxPoolLen bytes of
// printable ASCII, and a warm lease with an owner or a session to resume.
func checkWarm(req *spawnpb.SpawnRequest) error {
	pool := req.GetPool()
	if pool == "" {
		return nil
	}
	if len(pool) > maxPoolLen || strings.ContainsFunc(pool, func(r rune) bool { return r < 0x20 || r > 0x7e }) {
		return status.Errorf(codes.InvalidArgument, "Spawn: a pool name of %d bytes is not 1 to %d printable ASCII characters", len(pool), maxPoolLen)
	}
	switch {
	case req.GetPrincipal() != "":
		return status.Errorf(codes.InvalidArgument, "Spawn: pool %q: a warm lease has no principal until Record hands it out", pool)
	case req.GetRecallSessionId() != "":
		return status.Errorf(codes.InvalidArgument, "Spawn: pool %q: a warm lease resumes no session", pool)
	}
	return nil
}

// waitingIn is the pool of a warm lease in waiting, "" for any other.
func (r leaseRecord) waitingIn() string {
	if r.HandedOut {
		return ""
	}
	return r.Pool
}

// handOut is Record with hand_out: the running pool lease in waiting whose
// session id is recorded (or given here) becomes principal's, and so does
// its session (the index Binding reads), both on disk before it answers.
// Anything else is FAILED_PRECONDITION naming what was wrong; a journal or
// index that cannot record it is UNAVAILABLE, and the lease stays in
// waiting.
func (d *Daemon) handOut(req *spawnpb.RecordRequest) (*spawnpb.RecordResponse, error) {
	principal, session := req.GetPrincipal(), req.GetSessionId()
	if err := checkPrincipal(principal); err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "Record: %v", err)
	}
	d.mu.Lock()
	l, err := d.admit(verbHandOut, req.GetLeaseId())
	if err == nil {
		err = d.handOutRefusal(l, session, principal)
	}
	if err == nil && l.rec.SessionID == "" {
		l.reports++
		err = d.bindLocked(l, session)
	}
	if err != nil {
		d.mu.Unlock()
		return nil, err
	}
	id, session := l.rec.LeaseID, l.rec.SessionID
	had, _ := d.index.Get(session)
	before := binding{session, l.rec.Entry, had.Principal} // "" or principal: handOutRefusal
	// Set before the writes, so a second hand-out meanwhile is refused and
	// every later snapshot of the lease carries its owner.
	l.rec.HandedOut, l.rec.Principal = true, principal
	indexErr := d.index.Put(binding{session, l.rec.Entry, principal})
	if indexErr == nil {
		indexErr = d.index.Rewrite() // a repeat is not written: is what it repeats on disk?
	}
	rec := l.snapshot()
	d.wg.Add(1) // so Close waits for these writes rather than racing them
	d.mu.Unlock()
	defer d.wg.Done()
	what, err := "session → binary index", indexErr
	if err == nil {
		what, err = "lease journal", d.journal.Put(journalLine{kindRecorded, rec})
	}
	if err == nil {
		d.log.Info("warm lease handed out", "lease_id", id, "pool", rec.Pool, "entry", rec.Entry, "session_id", session)
		return &spawnpb.RecordResponse{}, nil
	}

	// Undone in memory and appended (durably if the file works, else by
	// its rewrite), so that no restart finds a hand-out this call refused,
	// whichever snapshot of the lease reached the journal meanwhile.
	d.mu.Lock()
	l.rec.HandedOut, l.rec.Principal = false, ""
	rec = l.snapshot()
	d.mu.Unlock()
	_ = d.journal.Put(journalLine{kindRecorded, rec})
	_ = d.index.Put(before)
	d.log.Error("hand-out of a warm lease refused: the "+what+" cannot record it; the lease stays in waiting",
		"lease_id", id, "pool", rec.Pool, "state_dir", d.stateDir, "error", err)
	return nil, status.Errorf(codes.Unavailable, "Record: the %s cannot record the hand-out (%s); lease %q stays in waiting; retry once it is rewritten",
		what, errnoWords(err, "it cannot be written"), id)
}

// handOutRefusal is why l cannot be handed to principal with session ("":
// the one it recorded), nil if it can. The caller holds d.mu.
func (d *Daemon) handOutRefusal(l *lease, session, principal string) error {
	id, had := l.rec.LeaseID, l.rec.SessionID
	switch {
	case l.rec.Pool == "":
		return status.Errorf(codes.FailedPrecondition, "Record: lease %q is no pool lease; only a warm lease is handed out", id)
	case l.rec.HandedOut:
		return status.Errorf(codes.FailedPrecondition, "Record: lease %q is already handed out; a warm lease is handed out once", id)
	case d.tenancy != nil:
		return status.Errorf(codes.FailedPrecondition, "Record: lease %q of pool %q runs as no principal's uid, and tenancy: gives each principal its own", id, l.rec.Pool)
	case had == "" && session == "":
		return status.Errorf(codes.FailedPrecondition, "Record: lease %q has reported no session id yet; hand it out once it has, or give it", id)
	case had != "" && session != "" && session != had:
		return status.Errorf(codes.FailedPrecondition, "Record: lease %q reported session %q, not %q", id, had, session)
	}
	if s := cmp.Or(session, had); d.ownership(s, principal) == spawnpb.Ownership_OWNERSHIP_OTHER {
		return status.Errorf(codes.FailedPrecondition, "Record: session %q of lease %q belongs to another principal", s, id)
	}
	return nil
}
