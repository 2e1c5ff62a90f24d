package gateway

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/config"
	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/pool"
	"github.com/nexus-broker/nexus-broker/internal/gateway/spawner"
)

// handOutSpawner is a spawnd whose hand-outs fail (or not) and which
// records what it was asked; every other verb refuses.
type handOutSpawner struct {
	spawner.Spawner
	fail error
	mu   sync.Mutex
	// records are the Record calls' principals, by lease; spawns and
	// terminations the leases of those calls.
	records      map[string][]string
	spawns       int
	terminations []string
}

func (s *handOutSpawner) Record(_ context.Context, lease, _, principal string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.records[lease] = append(s.records[lease], principal)
	return s.fail
}

func (s *handOutSpawner) Spawn(context.Context, spawner.SpawnRequest) (spawner.Spawned, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.spawns++
	return spawner.Spawned{}, &spawner.Error{Code: spawner.Unavailable, Text: "no spawnd in this test"}
}

func (s *handOutSpawner) Terminate(_ context.Context, t spawner.Termination) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.terminations = append(s.terminations, t.LeaseID)
	return nil
}

var warmSpec = pool.Spec{Name: "default", Entry: "nexus", Config: []byte("engine: {}\n"), MinIdle: 1}

// warmGateway is a gateway over sp holding one warm lease W of warmSpec,
// idle in its pool (its manager not started, so nothing refills).
func warmGateway(t *testing.T, sp spawner.Spawner) (*Gateway, *lease) {
	t.Helper()
	cfg := config.Default()
	cfg.ReleaseGrace = 0
	g := New(Options{Config: cfg, Spawner: sp, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	g.pools.m.Set([]pool.Spec{warmSpec})
	l := g.newLease("W", "", warmSpec.Entry, time.Now())
	l.state, l.sessionID, l.spawned = stateActive, "s-1", true
	l.prove([]byte("verifier")) // as restore does: spawnd holds it until its Terminate
	g.cap.Take()
	g.leases[l.id] = l
	g.adopt(l, warmSpec.Tag())
	g.pools.m.Booted(l.id)
	return g, l
}

// TestAFailedHandOutRefusesAndRetires: a hand-out spawnd cannot record is
// refused with the journal's 503, the warm lease retired (terminated, its
// slot freed) and never offered to the next claim, which is a cold spawn.
func TestAFailedHandOutRefusesAndRetires(t *testing.T) {
	sp := &handOutSpawner{records: map[string][]string{}, fail: &spawner.Error{Code: spawner.Unavailable, Text: "journal: no space left on device"}}
	g, l := warmGateway(t, sp)
	_, cerr := g.spawnLease(context.Background(), "", warmSpec.Entry, warmSpec.Config, "", slotAcquire, nil)
	if cerr == nil || cerr.status != http.StatusServiceUnavailable || cerr.text != errJournalUnavailable || cerr.retryAfter != journalRetryAfter {
		t.Fatalf("a hand-out spawnd could not record = %+v, want the journal's 503", cerr)
	}
	select {
	case <-l.tornDown:
	case <-time.After(10 * time.Second):
		t.Fatal("the warm lease was not retired")
	}
	if _, inUse, _, _ := g.cap.Snapshot(); inUse != 0 {
		t.Fatalf("%d slots in use after the retirement", inUse)
	}
	_, cerr = g.spawnLease(context.Background(), "", warmSpec.Entry, warmSpec.Config, "", slotAcquire, nil)
	sp.mu.Lock()
	defer sp.mu.Unlock()
	if cerr == nil || sp.spawns != 1 || len(sp.records["W"]) != 1 || sp.records["W"][0] != spawner.Anonymous {
		t.Fatalf("second claim %+v after %d spawns, records %q: want a cold spawn, W asked once for the anonymous caller", cerr, sp.spawns, sp.records)
	}
	if len(slices.Compact(sp.terminations)) != 1 || sp.terminations[0] != "W" {
		t.Fatalf("terminated %v, want W", sp.terminations)
	}
}

// TestARefusedHandOutRetiresAndSpawnsCold: a hand-out spawnd refuses
// (FailedPrecondition: the session is another principal's, say) is no
// refusal of the claim: the warm lease is retired and the claim is a cold
// spawn.
func TestARefusedHandOutRetiresAndSpawnsCold(t *testing.T) {
	sp := &handOutSpawner{records: map[string][]string{}, fail: &spawner.Error{Code: spawner.FailedPrecondition, Text: "Record: session of lease W belongs to another principal"}}
	g, l := warmGateway(t, sp)
	_, cerr := g.spawnLease(context.Background(), "bob", warmSpec.Entry, warmSpec.Config, "", slotAcquire, nil)
	select {
	case <-l.tornDown:
	case <-time.After(10 * time.Second):
		t.Fatal("the warm lease was not retired")
	}
	sp.mu.Lock()
	defer sp.mu.Unlock()
	if cerr == nil || cerr.text == errJournalUnavailable || sp.spawns != 1 || len(sp.records["W"]) != 1 {
		t.Fatalf("claim %+v after %d spawns, records %q: want the cold spawn's answer (this spawnd spawns nothing), W asked once", cerr, sp.spawns, sp.records)
	}
}

// TestConcurrentHandOutsShareNoLease: claims racing for one warm lease:
// exactly one is handed it (its owner recorded once), and the lease is
// then that claimant's alone.
func TestConcurrentHandOutsShareNoLease(t *testing.T) {
	sp := &handOutSpawner{records: map[string][]string{}}
	g, l := warmGateway(t, sp)
	var wg sync.WaitGroup
	var mu sync.Mutex
	won := []string{}
	for _, who := range []string{"alice", "bob", "carol", "dave", "erin", "frank"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got, cerr := g.spawnLease(context.Background(), who, warmSpec.Entry, warmSpec.Config, "", slotAcquire, nil)
			if cerr == nil && got == l {
				mu.Lock()
				won = append(won, who)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if len(won) != 1 {
		t.Fatalf("W handed to %v, want one claimant", won)
	}
	if p, warm := l.owner(); warm || p != won[0] || !l.ownedBy(won[0]) || l.ownedBy("") {
		t.Fatalf("after the hand-out: owner %q warm %v", p, warm)
	}
	if n := len(sp.records["W"]); n != 1 {
		t.Fatalf("W's owner recorded %d times", n)
	}
}

// TestAWarmLeaseIsNobodys: before its hand-out a warm lease is owned by no
// principal, the anonymous one included, is exempt from idle_timeout, and
// is in no caller's own listing.
func TestAWarmLeaseIsNobodys(t *testing.T) {
	g, l := warmGateway(t, &handOutSpawner{records: map[string][]string{}})
	for _, p := range []string{"", "alice"} {
		if l.ownedBy(p) {
			t.Errorf("a warm lease is owned by %q", p)
		}
		if ls := g.Leases(p, false); len(ls) != 0 {
			t.Errorf("%q lists %v", p, ls)
		}
		if g.sessionLease(p, "s-1") != nil {
			t.Errorf("%q resumes into the warm lease's session", p)
		}
	}
	cfg := *g.cfg.Load()
	cfg.IdleTimeout = 1
	g.cfg.Store(&cfg)
	l.mu.Lock()
	at, _ := l.deadlineLocked()
	l.mu.Unlock()
	if !at.IsZero() {
		t.Fatalf("a warm lease has an idle deadline %s", at)
	}
	if ls := g.Leases("", true); len(ls) != 1 {
		t.Fatalf("the operator view lists %v", ls)
	}
}

// TestARestoredWarmLeaseWithoutASessionRetires: a warm lease a restarted
// gateway finds without a session id (its boot was cut short) is retired,
// never handed out.
func TestARestoredWarmLeaseWithoutASessionRetires(t *testing.T) {
	sp := &handOutSpawner{records: map[string][]string{}}
	g, _ := warmGateway(t, sp)
	l := g.newLease("U", "", warmSpec.Entry, time.Now())
	l.spawned = true
	l.prove([]byte("verifier"))
	g.cap.Take()
	g.leases[l.id] = l
	g.adopt(l, warmSpec.Tag())
	select {
	case <-l.tornDown:
	case <-time.After(10 * time.Second):
		t.Fatal("not retired")
	}
	if id, _, ok := g.pools.m.Take(warmSpec.Entry, warmSpec.Config); !ok || id != "W" {
		t.Fatalf("took %q %v, want W and never U", id, ok)
	}
}
