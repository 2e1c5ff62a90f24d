package e2e

import (
	"encoding/json"
	"testing"
)

// TestAuthTicketsBounded: a lease keeps its 32 newest live tickets (the
// 33rd drops the oldest, which then fails to connect), and a principal
// holding 64 gets 429 naming its limit, while a mint that replaces its
// lease's oldest still succeeds.
func TestAuthTicketsBounded(t *testing.T) {
	b := startAuthBroker(t, "", Options{})
	l1, l2, l3 := b.claimAs(tokAlice), b.claimAs(tokAlice), b.claimAs(tokAlice)
	mint := func(lease string) (int, string) {
		t.Helper()
		status, body := b.doAs(tokAlice, "POST", "/ticket/"+lease, "")
		var out struct{ Ticket string }
		_ = json.Unmarshal([]byte(body), &out)
		if status == 200 {
			return status, out.Ticket
		}
		return status, body
	}
	var newest string
	for range 31 {
		if status, tok := mint(l1.LeaseID); status != 200 {
			t.Fatalf("minting for a lease under its cap: %d %s", status, tok)
		} else {
			newest = tok
		}
	}
	for range 30 {
		if status, got := mint(l2.LeaseID); status != 200 {
			t.Fatalf("minting for a principal under its cap: %d %s", status, got)
		}
	}
	// alice holds 3 (the claims') + 31 + 30 = 64 live tickets.
	status, got := mint(l3.LeaseID)
	wantAnswer(t, "alice's 65th ticket", status, got, 429, `{"error":"ticket limit reached for this principal"}`+"\n")
	// l1 holds 32: its 33rd drops the oldest, the claim's, and is allowed.
	if status, got := mint(l1.LeaseID); status != 200 {
		t.Fatalf("a 33rd ticket for a lease (replacing its oldest): %d %s", status, got)
	}
	if status, _ := rawDial(t, l1.WSURL, "?ticket="+l1.Ticket, ""); status != 401 {
		t.Errorf("the lease's oldest ticket, dropped by its 33rd, connected: %d", status)
	}
	if status, body := rawDial(t, l1.WSURL, "?ticket="+newest, ""); status != 101 {
		t.Errorf("a live ticket of the lease: %d %s, want 101", status, body)
	}
}
