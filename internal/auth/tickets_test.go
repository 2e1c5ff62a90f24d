package auth

import (
	"testing"
	"time"
)

func TestTickets(t *testing.T) {
	ts := NewTickets()
	now := time.Now()
	ts.now = func() time.Time { return now }
	alice := Principal{ID: "alice"}

	tk := ts.Mint("L1", alice)
	if ts.Outstanding() != 1 {
		t.Fatalf("outstanding %d", ts.Outstanding())
	}
	if _, ok := ts.Redeem(tk, "L1"); !ok {
		t.Fatal("a fresh ticket was refused")
	}
	if _, ok := ts.Redeem(tk, "L1"); ok {
		t.Error("a ticket worked twice")
	}

	other := ts.Mint("L2", alice)
	if _, ok := ts.Redeem(other, "L1"); ok {
		t.Error("another lease's ticket worked")
	}
	if _, ok := ts.Redeem(other, "L2"); ok {
		t.Error("a ticket presented for the wrong lease is spent, and stays spent")
	}

	old := ts.Mint("L1", alice)
	now = now.Add(TicketTTL)
	if _, ok := ts.Redeem(old, "L1"); ok {
		t.Error("an expired ticket worked")
	}
	if _, ok := ts.Redeem("never-minted", "L1"); ok {
		t.Error("an unknown ticket worked")
	}

	ts.Mint("L1", alice)
	ts.Mint("L1", alice)
	ts.Mint("L2", alice)
	expiring := ts.Mint("L3", alice)
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
