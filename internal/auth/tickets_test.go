package auth

import (
	"errors"
	"fmt"
	"runtime"
	"testing"
	"time"
)

// mint is Mint that must succeed.
func mint(t *testing.T, ts *Tickets, lease string, p Principal) string {
	t.Helper()
	tok, err := ts.Mint(lease, p)
	if err != nil {
		t.Fatalf("Mint(%s, %s): %v", lease, p.ID, err)
	}
	return tok
}

func TestTickets(t *testing.T) {
	ts := NewTickets()
	now := time.Now()
	ts.now = func() time.Time { return now }
	alice := Principal{ID: "alice"}

	tk := mint(t, ts, "L1", alice)
	if ts.Outstanding() != 1 {
		t.Fatalf("outstanding %d", ts.Outstanding())
	}
	if _, ok := ts.Redeem(tk, "L1"); !ok {
		t.Fatal("a fresh ticket was refused")
	}
	if _, ok := ts.Redeem(tk, "L1"); ok {
		t.Error("a ticket worked twice")
	}

	other := mint(t, ts, "L2", alice)
	if _, ok := ts.Redeem(other, "L1"); ok {
		t.Error("another lease's ticket worked")
	}
	if _, ok := ts.Redeem(other, "L2"); ok {
		t.Error("a ticket presented for the wrong lease is spent, and stays spent")
	}

	old := mint(t, ts, "L1", alice)
	now = now.Add(TicketTTL)
	if _, ok := ts.Redeem(old, "L1"); ok {
		t.Error("an expired ticket worked")
	}
	if _, ok := ts.Redeem("never-minted", "L1"); ok {
		t.Error("an unknown ticket worked")
	}

	mint(t, ts, "L1", alice)
	mint(t, ts, "L1", alice)
	mint(t, ts, "L2", alice)
	expiring := mint(t, ts, "L3", alice)
	_ = expiring
	if n := ts.Outstanding(); n != 4 {
		t.Errorf("outstanding %d, want 4", n)
	}
	ts.DropLease("L1")
	if n := ts.Outstanding(); n != 2 {
		t.Errorf("after the lease went: %d, want 2", n)
	}
	now = now.Add(TicketTTL)
	if n := ts.Outstanding(); n != 0 {
		t.Errorf("after expiry: %d, want 0", n)
	}
}

// TestTicketBounds: a lease keeps its 32 newest tickets, a principal may
// hold 64, the store 100 000; every ticket leaves every index when it goes.
func TestTicketBounds(t *testing.T) {
	ts := NewTickets()
	now := time.Now()
	ts.now = func() time.Time { return now }
	alice, bob := Principal{ID: "alice"}, Principal{ID: "bob"}
	first := mint(t, ts, "L1", alice)
	for range MaxTicketsPerLease {
		mint(t, ts, "L1", alice)
	}
	if n := ts.Outstanding(); n != MaxTicketsPerLease {
		t.Fatalf("one lease holds %d tickets, want %d", n, MaxTicketsPerLease)
	}
	if _, ok := ts.Redeem(first, "L1"); ok {
		t.Error("the 33rd ticket did not drop the lease's oldest")
	}
	for range MaxTicketsPerPrincipal - MaxTicketsPerLease {
		mint(t, ts, "L2", alice)
	}
	if _, err := ts.Mint("L3", alice); !errors.Is(err, ErrPrincipalTickets) {
		t.Errorf("alice's 65th ticket: %v, want %v", err, ErrPrincipalTickets)
	}
	if _, err := ts.Mint("L1", alice); err != nil {
		t.Errorf("a ticket replacing its lease's oldest is refused: %v", err)
	}
	mint(t, ts, "B1", bob)
	ts.DropLease("L1")
	if n, want := ts.Outstanding(), MaxTicketsPerPrincipal-MaxTicketsPerLease+1; n != want || ts.byPrincipal["alice"] != want-1 || len(ts.byLease["L1"]) != 0 {
		t.Errorf("after L1 went: %d outstanding (alice %d), L1 indexed %d; want %d", n, ts.byPrincipal["alice"], len(ts.byLease["L1"]), want)
	}
	now = now.Add(TicketTTL)
	if n := ts.Outstanding(); n != 0 || len(ts.byLease) != 0 || len(ts.byPrincipal) != 0 || len(ts.order) != 0 {
		t.Errorf("after expiry: %d outstanding, %d leases, %d principals, %d ordered", n, len(ts.byLease), len(ts.byPrincipal), len(ts.order))
	}

	for i := range MaxTickets {
		mint(t, ts, fmt.Sprint("F", i), Principal{ID: fmt.Sprint("p", i)})
	}
	if _, err := ts.Mint("F", Principal{ID: "late"}); !errors.Is(err, ErrTicketsFull) {
		t.Errorf("the 100 001st ticket: %v, want %v", err, ErrTicketsFull)
	}
}

// TestTicketsExpireOnTheirOwn: with nobody asking, the deadline timer
// purges expired tickets.
func TestTicketsExpireOnTheirOwn(t *testing.T) {
	ts := NewTickets()
	now := time.Now()
	ts.mu.Lock()
	ts.now = func() time.Time { return now }
	ts.mu.Unlock()
	mint(t, ts, "L1", Principal{ID: "alice"})
	ts.mu.Lock()
	now = now.Add(TicketTTL)
	timer := ts.timer
	ts.mu.Unlock()
	timer.Reset(0)
	deadline := time.Now().Add(10 * time.Second)
	for {
		ts.mu.Lock()
		n := len(ts.m)
		ts.mu.Unlock()
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the expired ticket was not purged by its deadline timer")
		}
		time.Sleep(time.Millisecond)
	}
}

// BenchmarkTicketsFlood: 200 000 mints for one lease, as 200 000 POST
// /ticket calls make, never redeemed. retained-B is the heap the store
// still holds after them (the bounded store keeps the lease's 32 newest);
// baseline-B is an empty store's, measured in the same run.
func BenchmarkTicketsFlood(b *testing.B) {
	const calls = 200_000
	heap := func() uint64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return m.HeapAlloc
	}
	alice := Principal{ID: "alice"}
	for b.Loop() {
		before := heap()
		empty := NewTickets()
		base := heap()
		ts := NewTickets()
		for range calls {
			if _, err := ts.Mint("L1", alice); err != nil {
				b.Fatal(err)
			}
		}
		after := heap()
		b.ReportMetric(float64(base-before), "baseline-B")
		b.ReportMetric(float64(after-base), "retained-B")
		b.ReportMetric(float64(ts.Outstanding()), "live-tickets")
		runtime.KeepAlive(empty)
		runtime.KeepAlive(ts)
	}
}
