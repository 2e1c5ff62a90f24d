package auth

import (
	"crypto/rand"
	"encoding/base64"
	"sync"
	"time"
)

// TicketTTL is a ticket's life. It is a constant, not a key: a ticket
// travels in a URL, and the tight window plus single use are the whole
// mitigation for that.
const TicketTTL = 30 * time.Second

// Tickets are the single-use WebSocket credentials the broker mints, bound
// to one lease and one principal, in memory only.
type Tickets struct {
	mu  sync.Mutex
	m   map[string]ticket
	now func() time.Time
}

type ticket struct {
	lease string
	p     Principal
	until time.Time
}

// NewTickets returns an empty ticket store.
func NewTickets() *Tickets {
	return &Tickets{m: map[string]ticket{}, now: time.Now}
}

// Mint issues a ticket for lease, owned by p.
func (t *Tickets) Mint(lease string, p Principal) string {
	var b [32]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails
	tok := base64.RawURLEncoding.EncodeToString(b[:])
	t.mu.Lock()
	t.m[tok] = ticket{lease: lease, p: p, until: t.now().Add(TicketTTL)}
	t.mu.Unlock()
	return tok
}

// Redeem spends tok for lease. Unknown, expired, already spent and minted
// for another lease all fail the same way, and a presented ticket is spent
// whatever the outcome.
func (t *Tickets) Redeem(tok, lease string) (Principal, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	tk, ok := t.m[tok]
	if !ok {
		return Principal{}, false
	}
	delete(t.m, tok)
	if tk.lease != lease || !t.now().Before(tk.until) {
		return Principal{}, false
	}
	return tk.p, true
}

// DropLease destroys every ticket of a lease that is gone.
func (t *Tickets) DropLease(lease string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for tok, tk := range t.m {
		if tk.lease == lease {
			delete(t.m, tok)
		}
	}
}

// Outstanding counts live tickets, dropping expired ones first so the
// gauge never counts a ticket nobody can use.
func (t *Tickets) Outstanding() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	now := t.now()
	for tok, tk := range t.m {
		if !now.Before(tk.until) {
			delete(t.m, tok)
		}
	}
	return len(t.m)
}
