package auth

import (
	"crypto/rand"
	"encoding/base64"
	"errors"
	"sync"
	"time"
)

// TicketTTL is a ticket's life. It is a constant, not a key: a ticket
// travels in a URL, and the tight window plus single use are the whole
// mitigation for that.
const TicketTTL = 30 * time.Second

// The bounds on live tickets: per lease (the oldest goes to make room),
// per principal and in all (a mint past either is refused).
const (
	MaxTicketsPerLease     = 32
	MaxTicketsPerPrincipal = 64
	MaxTickets             = 100_000
)

// The refusals of Mint.
var (
	ErrPrincipalTickets = errors.New("ticket limit reached for this principal")
	ErrTicketsFull      = errors.New("ticket store full")
)

// Tickets are the single-use WebSocket credentials the broker mints, bound
// to one lease and one principal, in memory only. Each is purged at its own
// deadline (a timer on the oldest), indexed by its lease, and counted per
// principal.
type Tickets struct {
	mu          sync.Mutex
	m           map[string]*ticket
	byLease     map[string][]*ticket // oldest first
	byPrincipal map[string]int
	// order is every ticket in minting order, so in deadline order (one
	// TTL for all); spent ones stay until they reach its front, and it is
	// compacted when they outnumber the live.
	order []*ticket
	timer *time.Timer
	now   func() time.Time
}

type ticket struct {
	tok   string
	lease string
	p     Principal
	until time.Time
	gone  bool
}

// NewTickets returns an empty ticket store.
func NewTickets() *Tickets {
	return &Tickets{m: map[string]*ticket{}, byLease: map[string][]*ticket{}, byPrincipal: map[string]int{}, now: time.Now}
}

// Mint issues a ticket for lease, owned by p. A lease's 33rd live ticket
// drops its oldest; a principal's 65th, or the store's 100 001st, is
// refused (ErrPrincipalTickets, ErrTicketsFull).
func (t *Tickets) Mint(lease string, p Principal) (string, error) {
	var b [32]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails
	tok := base64.RawURLEncoding.EncodeToString(b[:])
	t.mu.Lock()
	defer t.mu.Unlock()
	now := t.now()
	t.purgeLocked(now)
	if ts := t.byLease[lease]; len(ts) >= MaxTicketsPerLease {
		t.removeLocked(ts[0])
	}
	switch {
	case t.byPrincipal[p.ID] >= MaxTicketsPerPrincipal:
		return "", ErrPrincipalTickets
	case len(t.m) >= MaxTickets:
		return "", ErrTicketsFull
	}
	tk := &ticket{tok: tok, lease: lease, p: p, until: now.Add(TicketTTL)}
	t.m[tok] = tk
	t.byLease[lease] = append(t.byLease[lease], tk)
	t.byPrincipal[p.ID]++
	t.order = append(t.order, tk)
	if t.timer == nil {
		t.timer = time.AfterFunc(TicketTTL, t.expire)
	}
	return tok, nil
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
	t.removeLocked(tk)
	if tk.lease != lease || !t.now().Before(tk.until) {
		return Principal{}, false
	}
	return tk.p, true
}

// DropLease destroys every ticket of a lease that is gone.
func (t *Tickets) DropLease(lease string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, tk := range t.byLease[lease] {
		t.forgetLocked(tk)
	}
	delete(t.byLease, lease)
}

// Outstanding counts live tickets, dropping expired ones first so the
// gauge never counts a ticket nobody can use.
func (t *Tickets) Outstanding() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.purgeLocked(t.now())
	return len(t.m)
}

// expire is the deadline timer: purge, then wait for the next oldest.
func (t *Tickets) expire() {
	t.mu.Lock()
	defer t.mu.Unlock()
	now := t.now()
	t.purgeLocked(now)
	if len(t.order) == 0 {
		t.timer = nil
		return
	}
	t.timer.Reset(t.order[0].until.Sub(now))
}

// purgeLocked drops the tickets whose deadline passed, and the spent ones
// ahead of them.
func (t *Tickets) purgeLocked(now time.Time) {
	i := 0
	for ; i < len(t.order); i++ {
		tk := t.order[i]
		if !tk.gone && now.Before(tk.until) {
			break
		}
		if !tk.gone {
			t.removeLocked(tk)
		}
		t.order[i] = nil
	}
	t.order = t.order[i:]
	if len(t.order) > 2*len(t.m)+64 {
		live := make([]*ticket, 0, len(t.m))
		for _, tk := range t.order {
			if !tk.gone {
				live = append(live, tk)
			}
		}
		t.order = live
	}
}

// removeLocked drops one live ticket from every index.
func (t *Tickets) removeLocked(tk *ticket) {
	if tk.gone {
		return
	}
	ts := t.byLease[tk.lease]
	for i, x := range ts {
		if x == tk {
			ts = append(ts[:i:i], ts[i+1:]...)
			break
		}
	}
	if len(ts) == 0 {
		delete(t.byLease, tk.lease)
	} else {
		t.byLease[tk.lease] = ts
	}
	t.forgetLocked(tk)
}

// forgetLocked drops tk from the token and principal indexes.
func (t *Tickets) forgetLocked(tk *ticket) {
	if tk.gone {
		return
	}
	tk.gone = true
	delete(t.m, tk.tok)
	if t.byPrincipal[tk.p.ID]--; t.byPrincipal[tk.p.ID] <= 0 {
		delete(t.byPrincipal, tk.p.ID)
	}
}
