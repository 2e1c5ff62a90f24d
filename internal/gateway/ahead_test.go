package gateway

import (
	"context"
	"io"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/config"
	"github.com/nexus-broker/nexus-broker/internal/gateway/spawner"
)

// heldRecords is a spawnd whose Records wait for release, in the order
// they entered, and answer fail; every other verb but Terminate refuses.
type heldRecords struct {
	spawner.Spawner
	fail    error
	release chan struct{} // one send lets one Record answer
	entered chan string

	mu    sync.Mutex
	trace []string // "enter A", "answer A", …
}

func newHeldRecords(fail error) *heldRecords {
	return &heldRecords{fail: fail, release: make(chan struct{}), entered: make(chan string, 8)}
}

func (s *heldRecords) note(what string) {
	s.mu.Lock()
	s.trace = append(s.trace, what)
	s.mu.Unlock()
}

func (s *heldRecords) Record(_ context.Context, lease, _, _ string) error {
	s.note("enter " + lease)
	s.entered <- lease
	<-s.release
	s.note("answer " + lease)
	return s.fail
}

func (s *heldRecords) Terminate(context.Context, spawner.Termination) error { return nil }

func (s *heldRecords) traced() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.trace)
}

// aheadGateway is a gateway over sp with one booting lease per id given,
// each of entry nexus but "other-*".
func aheadGateway(t *testing.T, sp spawner.Spawner, edit func(*config.Config), ids ...string) (*Gateway, map[string]*lease) {
	t.Helper()
	cfg := config.Default()
	cfg.StateDir = ""
	if edit != nil {
		edit(cfg)
	}
	g := New(Options{Config: cfg, Spawner: sp, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	ls := map[string]*lease{}
	for _, id := range ids {
		entry := "nexus"
		if len(id) > 6 && id[:6] == "other-" {
			entry = "other"
		}
		l := g.newLease(id, "", entry, time.Now())
		l.spawned = true
		l.prove([]byte("verifier")) // spawnd answered its Spawn
		g.cap.Take()
		g.leases[id] = l
		ls[id] = l
	}
	return g, ls
}

func settledWithin(t *testing.T, l *lease) {
	t.Helper()
	select {
	case <-l.sessionReported:
	case <-time.After(10 * time.Second):
		t.Fatalf("lease %s: the claim still waits on its session id", l.id)
	}
}

func settled(l *lease) bool {
	select {
	case <-l.sessionReported:
		return true
	default:
		return false
	}
}

// TestSessionIdAnsweredAheadOfItsRecord: with neither auth: nor
// state_dir, a claimed lease's first session id settles the claim while
// its Record is still in flight; another entry's lease reporting the same
// id takes the ordinary path, its Record sent only after the first one's
// answer, and so does a resume's Spawn of it.
func TestSessionIdAnsweredAheadOfItsRecord(t *testing.T) {
	sp := newHeldRecords(nil)
	g, ls := aheadGateway(t, sp, nil, "A", "other-B")
	a, b := ls["A"], ls["other-B"]
	a.markSession("s-1")
	if got := <-sp.entered; got != "A" {
		t.Fatalf("Record of %s entered first", got)
	}
	settledWithin(t, a) // Record of A is held: the claim did not wait for it
	if a.sessionID != "s-1" {
		t.Fatalf("lease A carries %q", a.sessionID)
	}

	b.markSession("s-1")
	resumed := make(chan struct{})
	go func() {
		g.awaitAhead("s-1")
		close(resumed)
	}()
	g.mu.Lock()
	_, inFlight := g.ahead["s-1"]
	g.mu.Unlock()
	if !inFlight || settled(b) {
		t.Fatalf("while A's Record is held: s-1 in flight %v, B settled %v; want in flight, B waiting", inFlight, settled(b))
	}
	sp.release <- struct{}{} // A's answer
	<-resumed
	if got := <-sp.entered; got != "other-B" {
		t.Fatalf("Record of %s entered second", got)
	}
	sp.release <- struct{}{}
	settledWithin(t, b)
	if want := []string{"enter A", "answer A", "enter other-B", "answer other-B"}; !slices.Equal(sp.traced(), want) {
		t.Fatalf("spawnd saw %q, want %q: B's Record must wait for A's", sp.traced(), want)
	}
}

// TestNoIdIsTakenAheadWhileItsRecordIsInFlight: an ordinary Record of an
// id in flight (a lease's second id, say), which spawnd may be applying,
// keeps another lease's first report of the same id off the ahead path.
func TestNoIdIsTakenAheadWhileItsRecordIsInFlight(t *testing.T) {
	sp := newHeldRecords(nil)
	_, ls := aheadGateway(t, sp, nil, "A", "other-B")
	a, b := ls["A"], ls["other-B"]
	a.markSession("s-0") // ahead
	<-sp.entered
	sp.release <- struct{}{}
	a.markSession("s-1") // A's second id: the ordinary path, held
	if got := <-sp.entered; got != "A" {
		t.Fatalf("Record of %s entered, want A's second", got)
	}
	b.markSession("s-1")
	if got := <-sp.entered; got != "other-B" {
		t.Fatalf("Record of %s entered, want B's", got)
	}
	if settled(b) {
		t.Fatal("B's claim was answered ahead while A's Record of the same id was in flight")
	}
	sp.release <- struct{}{}
	sp.release <- struct{}{}
	settledWithin(t, b)
}

// TestSessionIdWaitsForItsRecord: with state_dir (its journal line may
// fail) the claim waits for Record's answer as before; and a lease's
// second id is the lease's only once spawnd recorded it.
func TestSessionIdWaitsForItsRecord(t *testing.T) {
	t.Run("state_dir", func(t *testing.T) {
		sp := newHeldRecords(nil)
		_, ls := aheadGateway(t, sp, func(c *config.Config) { c.StateDir = t.TempDir() }, "A")
		a := ls["A"]
		a.markSession("s-1")
		<-sp.entered
		if settled(a) {
			t.Fatal("the claim was answered before spawnd recorded the session id")
		}
		sp.release <- struct{}{}
		settledWithin(t, a)
	})
	t.Run("second id", func(t *testing.T) {
		sp := newHeldRecords(nil)
		_, ls := aheadGateway(t, sp, nil, "A")
		a := ls["A"]
		a.markSession("s-1")
		<-sp.entered
		sp.release <- struct{}{}
		a.markSession("s-2")
		<-sp.entered // after s-1's answer: a lease's ids are recorded in order
		a.mu.Lock()
		carried := a.sessionID
		a.mu.Unlock()
		if carried != "s-1" {
			t.Fatalf("lease carries %q while s-2's Record is held, want s-1", carried)
		}
		sp.release <- struct{}{}
		a.mu.Lock()
		done := a.recording
		a.mu.Unlock()
		<-done
		if a.sessionID != "s-2" {
			t.Fatalf("lease carries %q once s-2 was recorded", a.sessionID)
		}
	})
}

// TestARefusedAheadRecordEndsTheLease: spawnd refusing an id answered
// ahead (which takeAhead's conditions rule out) ends the lease.
func TestARefusedAheadRecordEndsTheLease(t *testing.T) {
	sp := newHeldRecords(&spawner.Error{Code: spawner.FailedPrecondition, Message: `Record: session "s-1" belongs to entry "other", not "nexus"`})
	_, ls := aheadGateway(t, sp, nil, "A")
	a := ls["A"]
	a.markSession("s-1")
	<-sp.entered
	settledWithin(t, a)
	sp.release <- struct{}{}
	select {
	case <-a.tornDown:
	case <-time.After(10 * time.Second):
		t.Fatal("the lease was not ended")
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.sessionID != "" || a.reason != reasonRecordRefused {
		t.Fatalf("ended lease: session %q, reason %q", a.sessionID, a.reason)
	}
}
