package spawnd

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// spawnWarm spawns lease id as a warm lease of pool and waits for its fake
// instance's report.
func (h *harness) spawnWarm(id, pool string) *fakeConn {
	h.t.Helper()
	if _, err := h.client.Spawn(h.ctx(), &spawnpb.SpawnRequest{LeaseId: id, Entry: "nexus", Config: []byte("core: {}\n"), Pool: pool}); err != nil {
		h.t.Fatalf("Spawn(%s, pool %s): %v", id, pool, err)
	}
	return h.accept()
}

// listed is List's record of lease id, nil for none.
func (h *harness) listed(id string) *spawnpb.Lease {
	h.t.Helper()
	list, err := h.client.List(h.ctx(), &spawnpb.ListRequest{})
	if err != nil {
		h.t.Fatal(err)
	}
	for _, l := range list.Leases {
		if l.LeaseId == id {
			return l
		}
	}
	return nil
}

func (h *harness) ownership(session, principal string) spawnpb.Ownership {
	h.t.Helper()
	res, err := h.client.Binding(h.ctx(), &spawnpb.BindingRequest{SessionId: session, Principal: principal})
	if err != nil {
		h.t.Fatal(err)
	}
	return res.Ownership
}

// TestAWarmLeaseIsJournaledWithItsPool: a warm lease is journaled with its
// pool and no principal, comes back after a restart with both, is handed
// out once (its owner journaled before Record answers, and its session's
// in the index Binding reads), and is an ordinary owned lease after that,
// across another restart.
func TestAWarmLeaseIsJournaledWithItsPool(t *testing.T) {
	h := newHarness(t, defaultYAML)
	h.spawnWarm("lease-warm", "default")
	if _, err := h.client.Record(h.ctx(), &spawnpb.RecordRequest{LeaseId: "lease-warm", SessionId: "sess-warm"}); err != nil {
		t.Fatal(err)
	}
	journal := filepath.Join(h.stateDir, journalFile)
	_, recs := journalLines(t, journal)
	for _, r := range linesOf(recs, "lease-warm") {
		if r.Pool != "default" || r.Principal != "" {
			t.Fatalf("journal record %+v, want pool default and no principal", r)
		}
	}
	if got := h.ownership("sess-warm", "alice"); got != spawnpb.Ownership_OWNERSHIP_UNRECORDED {
		t.Fatalf("a warm lease's session for alice = %v, want unrecorded", got)
	}

	h.restartWithLive("lease-warm")
	l := h.listed("lease-warm")
	if l.GetPool() != "default" || l.GetPrincipal() != "" || l.GetSessionId() != "sess-warm" || !l.GetAdopted() {
		t.Fatalf("List after the restart = %v, want adopted, pool default, no principal, sess-warm", l)
	}

	handOut := func(session, principal string) error {
		_, err := h.client.Record(h.ctx(), &spawnpb.RecordRequest{LeaseId: "lease-warm", SessionId: session, Principal: principal, HandOut: true})
		return err
	}
	if err := handOut("sess-other", "alice"); status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), `reported session "sess-warm"`) {
		t.Fatalf("hand-out naming another session = %v, want FailedPrecondition naming the one reported", err)
	}
	if err := handOut("", "alice"); err != nil {
		t.Fatalf("hand-out to alice: %v", err)
	}
	_, recs = journalLines(t, journal)
	if got := linesOf(recs, "lease-warm"); got[len(got)-1].Principal != "alice" || got[len(got)-1].Pool != "default" || !got[len(got)-1].HandedOut {
		t.Fatalf("last journal record after the hand-out = %+v, want alice's, handed out of pool default", got[len(got)-1])
	}
	if err := handOut("sess-warm", "bob"); status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "already handed out") {
		t.Fatalf("second hand-out = %v, want FailedPrecondition: already handed out", err)
	}
	if strings.Contains(status.Convert(handOut("", "bob")).Message(), "alice") {
		t.Fatal("a refused hand-out names the owner")
	}
	for _, boot := range []string{"live", "restarted"} {
		if got := h.ownership("sess-warm", "alice"); got != spawnpb.Ownership_OWNERSHIP_OWN {
			t.Errorf("%s: the handed-out session for alice = %v", boot, got)
		}
		if got := h.ownership("sess-warm", "bob"); got != spawnpb.Ownership_OWNERSHIP_OTHER {
			t.Errorf("%s: the handed-out session for bob = %v", boot, got)
		}
		if l := h.listed("lease-warm"); l.GetPrincipal() != "alice" || l.GetPool() != "" {
			t.Errorf("%s: List = %v, want alice's, no pool", boot, l)
		}
		if boot == "live" {
			h.restartWithLive("lease-warm")
		}
	}
	if err := handOut("", "bob"); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("hand-out after the restart = %v, want FailedPrecondition", err)
	}
}

// TestHandOutNeedsAnOwnerlessRunningPoolLease: a hand-out is refused, with
// FailedPrecondition naming why, for an ordinary lease, an unknown or
// ended one, and a warm lease with no session id yet, unless the call
// gives it; Spawn refuses a warm lease with a principal, a resume or a bad
// pool name.
func TestHandOutNeedsAnOwnerlessRunningPoolLease(t *testing.T) {
	h := newHarness(t, defaultYAML)
	h.spawn("lease-owned", "nexus") // alice's
	if _, err := h.client.Record(h.ctx(), &spawnpb.RecordRequest{LeaseId: "lease-owned", SessionId: "sess-owned"}); err != nil {
		t.Fatal(err)
	}
	h.spawnWarm("lease-warm", "p1")
	for _, tc := range []struct {
		lease, session, want string
	}{
		{"lease-owned", "sess-owned", "is no pool lease"},
		{"lease-never", "s", `lease "lease-never" is unknown`},
		{"lease-warm", "", "has reported no session id yet"},
		{"lease-warm", "sess-owned", "belongs to another principal"},
	} {
		_, err := h.client.Record(h.ctx(), &spawnpb.RecordRequest{LeaseId: tc.lease, SessionId: tc.session, Principal: "bob", HandOut: true})
		if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("hand-out of %s with session %q = %v, want FailedPrecondition: %s", tc.lease, tc.session, err, tc.want)
		}
	}
	if l := h.listed("lease-owned"); l.GetPrincipal() != "alice" {
		t.Errorf("the refused hand-out changed the ordinary lease: %v", l)
	}
	// The session given with the hand-out is recorded with it.
	if _, err := h.client.Record(h.ctx(), &spawnpb.RecordRequest{LeaseId: "lease-warm", SessionId: "sess-new", Principal: "bob", HandOut: true}); err != nil {
		t.Fatal(err)
	}
	if l := h.listed("lease-warm"); l.GetPrincipal() != "bob" || l.GetSessionId() != "sess-new" {
		t.Errorf("List after a hand-out with its session = %v", l)
	}
	if got := h.ownership("sess-new", "bob"); got != spawnpb.Ownership_OWNERSHIP_OWN {
		t.Errorf("the session given at the hand-out for bob = %v", got)
	}
	if _, err := h.terminate("lease-warm", "manual release", true); err != nil {
		t.Fatal(err)
	}
	if _, err := h.client.Record(h.ctx(), &spawnpb.RecordRequest{LeaseId: "lease-warm", Principal: "carol", HandOut: true}); status.Code(err) != codes.FailedPrecondition {
		t.Errorf("hand-out of an ended lease = %v, want FailedPrecondition", err)
	}
	if _, err := h.client.Record(h.ctx(), &spawnpb.RecordRequest{LeaseId: "lease-owned", Principal: "a\x00", HandOut: true}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("hand-out to a principal with a NUL = %v, want InvalidArgument", err)
	}
	if _, err := h.client.Record(h.ctx(), &spawnpb.RecordRequest{LeaseId: "lease-owned", SessionId: "sess-owned", Principal: "bob"}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("Record with a principal and no hand_out = %v, want InvalidArgument", err)
	}

	for _, req := range []*spawnpb.SpawnRequest{
		{LeaseId: "w-1", Entry: "nexus", Pool: "p1", Principal: "alice"},
		{LeaseId: "w-2", Entry: "nexus", Pool: "p1", RecallSessionId: "sess-owned"},
		{LeaseId: "w-3", Entry: "nexus", Pool: strings.Repeat("p", maxPoolLen+1)},
		{LeaseId: "w-4", Entry: "nexus", Pool: "p\n1"},
	} {
		if _, err := h.client.Spawn(h.ctx(), req); status.Code(err) != codes.InvalidArgument {
			t.Errorf("Spawn %v = %v, want InvalidArgument", req, err)
		}
	}
}

// TestAnAnonymousHandOutIsOnce: without auth: the owner a hand-out gives
// is the anonymous "", and the lease is handed out all the same: List names
// no pool for it, and no second hand-out is admitted, across a restart.
func TestAnAnonymousHandOutIsOnce(t *testing.T) {
	h := newHarness(t, defaultYAML)
	h.spawnWarm("lease-warm", "default")
	handOut := func() error {
		_, err := h.client.Record(h.ctx(), &spawnpb.RecordRequest{LeaseId: "lease-warm", SessionId: "sess-anon", HandOut: true})
		return err
	}
	if err := handOut(); err != nil {
		t.Fatal(err)
	}
	h.restartWithLive("lease-warm")
	if l := h.listed("lease-warm"); l.GetPool() != "" || l.GetPrincipal() != "" || l.GetSessionId() != "sess-anon" {
		t.Fatalf("List after an anonymous hand-out and a restart = %v, want no pool, no principal, sess-anon", l)
	}
	if err := handOut(); status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "already handed out") {
		t.Fatalf("second anonymous hand-out = %v, want FailedPrecondition: already handed out", err)
	}
	if got := h.ownership("sess-anon", "alice"); got != spawnpb.Ownership_OWNERSHIP_UNRECORDED {
		t.Fatalf("an anonymous session for alice = %v, want unrecorded", got)
	}
}

// TestAHandOutTheJournalCannotRecordIsRefused: with the journal's disk
// full, a hand-out is Unavailable and the lease stays in waiting, ownerless,
// in memory and in the journal once it is rewritten; then it is handed out.
func TestAHandOutTheJournalCannotRecordIsRefused(t *testing.T) {
	h := fullJournal(t, func(*harness) int { return 0 }, func(h *harness) {
		h.spawnWarm("lease-warm", "default")
		if _, err := h.client.Record(h.ctx(), &spawnpb.RecordRequest{LeaseId: "lease-warm", SessionId: "sess-warm"}); err != nil {
			t.Fatal(err)
		}
	})
	_, err := h.client.Record(h.ctx(), &spawnpb.RecordRequest{LeaseId: "lease-warm", Principal: "alice", HandOut: true})
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "no space left on device") || strings.Contains(err.Error(), h.stateDir) {
		t.Fatalf("hand-out with the journal full = %v, want Unavailable naming ENOSPC and no path", err)
	}
	if l := h.listed("lease-warm"); l.GetPrincipal() != "" || l.GetPool() != "default" {
		t.Fatalf("List after the refused hand-out = %v, want pool default, no principal", l)
	}
	if got := h.ownership("sess-warm", "alice"); got != spawnpb.Ownership_OWNERSHIP_UNRECORDED {
		t.Fatalf("the refused hand-out's session for alice = %v, want unrecorded", got)
	}
	if err := os.Remove(filepath.Join(h.stateDir, "filler")); err != nil {
		t.Fatal(err)
	}
	h.logs.await(t, "the lease journal was rewritten from memory after a failed write; appending to it again")
	_, recs := journalLines(t, filepath.Join(h.stateDir, journalFile))
	if got := linesOf(recs, "lease-warm"); len(got) != 1 || got[0].Principal != "" || got[0].Pool != "default" || got[0].HandedOut {
		t.Fatalf("the rewritten journal's lease-warm = %+v, want one ownerless record of pool default", got)
	}
	if _, err := h.client.Record(h.ctx(), &spawnpb.RecordRequest{LeaseId: "lease-warm", Principal: "alice", HandOut: true}); err != nil {
		t.Fatalf("hand-out once the journal is rewritten: %v", err)
	}
}

// TestAWarmLeaseTerminatingFreesItsPlace: spawnd.max_leases excludes a
// warm lease being torn down, so the gateway that ends one to make room
// spawns at once, before the instance is gone.
func TestAWarmLeaseTerminatingFreesItsPlace(t *testing.T) {
	h := newHarness(t, defaultYAML+"spawnd: {max_leases: 1}\n")
	f := h.spawnWarm("lease-warm", "default")
	if _, err := h.client.Spawn(h.ctx(), &spawnpb.SpawnRequest{LeaseId: "lease-claim", Entry: "nexus", Principal: "alice"}); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("Spawn past max_leases = %v, want ResourceExhausted", err)
	}
	if _, err := h.client.Terminate(h.ctx(), &spawnpb.TerminateRequest{LeaseId: "lease-warm", Reason: "pool yield", NoWait: true}); err != nil {
		t.Fatal(err)
	}
	h.spawn("lease-claim", "nexus")
	if l := h.listed("lease-warm"); l == nil {
		t.Fatal("the warm lease was gone before the claim's Spawn; the test proves nothing")
	}
	f.send("exit 0")
}
