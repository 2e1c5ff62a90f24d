// Package capacity is the lease core's admission: max_concurrent slots and
// the FIFO queue of claims waiting for one, with the books a cluster needs
// to offer a queued claim to a peer. It is internal to the lease core
// (internal/gateway): no other layer can import it.
//
// It imports nothing of the project.
package capacity

import (
	"container/list"
	"context"
	"errors"
	"math"
	"sync"
	"time"
)

// The three capacity refusals: each names a different key to raise.
var (
	ErrNoCapacity   = errors.New("no capacity")
	ErrQueueFull    = errors.New("capacity queue full")
	ErrQueueTimeout = errors.New("capacity wait timed out")
	// ErrPrincipalQueue is a quota answer about the caller, not the broker.
	ErrPrincipalQueue = errors.New("queued claim limit reached for this principal")
	// ErrDeclined is an offered claim that found no free slot here.
	ErrDeclined = errors.New("no free slot for an offered claim")
	// ErrServedAway is a queued claim a peer with a free slot served.
	ErrServedAway = errors.New("served by a peer")
)

// Quota bounds how many queued claims one principal may hold; a zero
// quota (Max <= 0) bounds nothing. Offer, when set, lets a peer with a
// Free slot serve the claim while it waits here (cluster mode).
type Quota[O any] struct {
	Principal string
	Max       int
	Offer     *O
}

// Slots is max_concurrent slots plus the FIFO queue of claims waiting for
// one. A freed slot is handed straight to the oldest waiter (it never becomes
// Free in between, so no newcomer can overtake the queue).
type Slots[O any] struct {
	mu       sync.Mutex
	max      int // <= 0: unlimited
	inUse    int
	queue    list.List // of *Waiter[O], oldest at the front
	maxDepth int
	wait     time.Duration
	// queued counts parked claims per principal under a quota.
	queued map[string]int
	// offerEnd is signalled when a claim out on offer to a peer comes back.
	offerEnd *sync.Cond
	// onFree, when set, is told (under mu, so it must not block) that a
	// slot became free with nobody waiting for it.
	onFree func()
}

// Waiter is one parked claim. Its fields are guarded by Slots.mu.
type Waiter[O any] struct {
	granted chan struct{}
	el      *list.Element
	done    bool      // granted, served by a peer, or withdrawn
	since   time.Time // when the claim was parked
	offer   *O
	// offering: out on offer to a peer now, keeping its place. reserved: a
	// slot here freed for it meanwhile, held until the peer answers, so
	// exactly one broker spawns it. away: the peer served it.
	offering, reserved, away bool
}

// New is max slots (<= 0: unlimited), a queue of at most maxDepth (<= 0:
// unbounded) whose claims wait up to wait (<= 0: they are refused).
func New[O any](max, maxDepth int, wait time.Duration) *Slots[O] {
	c := &Slots[O]{max: max, maxDepth: maxDepth, wait: wait, queued: map[string]int{}}
	c.offerEnd = sync.NewCond(&c.mu)
	return c
}

// Acquire takes a slot, waiting in the queue when none is free. It fails with
// ErrNoCapacity (waiting disabled), ErrQueueFull, ErrPrincipalQueue (q's
// principal already holds its quota of the queue), ErrQueueTimeout, or
// ctx's error when the claimant went away; ErrServedAway means a peer
// served q.offer meanwhile, and no slot was taken here.
func (c *Slots[O]) Acquire(ctx context.Context, q Quota[O]) error {
	c.mu.Lock()
	if c.max <= 0 || (c.inUse < c.max && c.queue.Len() == 0) {
		c.inUse++
		c.mu.Unlock()
		return nil
	}
	wait := c.wait // read under mu: a reload may change it
	if wait <= 0 {
		c.mu.Unlock()
		return ErrNoCapacity
	}
	if q.Max > 0 && c.queued[q.Principal] >= q.Max {
		c.mu.Unlock()
		return ErrPrincipalQueue
	}
	if c.maxDepth > 0 && c.queue.Len() >= c.maxDepth {
		c.mu.Unlock()
		return ErrQueueFull
	}
	w := &Waiter[O]{granted: make(chan struct{}), since: time.Now(), offer: q.Offer}
	w.el = c.queue.PushBack(w)
	if q.Max > 0 {
		c.queued[q.Principal]++
		defer c.unqueue(q.Principal)
	}
	c.mu.Unlock()

	timer := time.NewTimer(wait)
	defer timer.Stop()
	var err error
	select {
	case <-w.granted:
		if w.away { // written before granted was closed
			return ErrServedAway
		}
		return nil
	case <-timer.C:
		err = ErrQueueTimeout
	case <-ctx.Done():
		err = ctx.Err()
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for w.offering { // a peer may be spawning it: its answer decides
		c.offerEnd.Wait()
	}
	switch {
	case w.away:
		return ErrServedAway
	case w.done: // granted while we were giving up: keep the slot's books right
		c.releaseLocked()
		return err
	}
	w.done = true
	c.queue.Remove(w.el)
	return err
}

// NextOffer marks the oldest parked claim a peer may serve as out on offer
// and returns it; nil when there is none.
func (c *Slots[O]) NextOffer() *Waiter[O] {
	c.mu.Lock()
	defer c.mu.Unlock()
	for e := c.queue.Front(); e != nil; e = e.Next() {
		if w := e.Value.(*Waiter[O]); w.offer != nil && !w.offering {
			w.offering = true
			return w
		}
	}
	return nil
}

// Offer is what the claim offers a peer.
func (w *Waiter[O]) Offer() *O { return w.offer }

// OfferEnded takes back a claim that was out on offer: served by the peer,
// it leaves the queue (and a slot held for it here goes to the next
// waiter); declined, it waits on in its place, or takes the slot held for
// it.
func (c *Slots[O]) OfferEnded(w *Waiter[O], served bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	w.offering = false
	switch {
	case served:
		c.queue.Remove(w.el)
		w.done, w.away = true, true
		close(w.granted)
		if w.reserved {
			c.releaseLocked()
		}
	case w.reserved:
		c.queue.Remove(w.el)
		w.done = true
		close(w.granted)
	}
	c.offerEnd.Broadcast()
}

// TryAcquire takes a slot only if one is free now and nobody queues for
// it: a claim another broker offers never overtakes this broker's queue.
func (c *Slots[O]) TryAcquire(context.Context, Quota[O]) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.max <= 0 || (c.inUse < c.max && c.queue.Len() == 0) {
		c.inUse++
		return nil
	}
	return ErrDeclined
}

// Full reports whether a claim arriving now would queue.
func (c *Slots[O]) Full() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.max > 0 && (c.inUse >= c.max || c.queue.Len() > 0)
}

func (c *Slots[O]) unqueue(principal string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.queued[principal]--; c.queued[principal] <= 0 {
		delete(c.queued, principal)
	}
}

// Pass hands a slot its holder gives up (a warm instance ending) to a claim
// about to queue for one: with nobody queued the claim keeps it (true);
// else the oldest waiter gets it, and the claim queues as any other (false).
func (c *Slots[O]) Pass() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.queue.Len() == 0 {
		return true
	}
	c.releaseLocked()
	return false
}

// Release frees one slot, handing it to the oldest waiter if there is one.
func (c *Slots[O]) Release() {
	c.mu.Lock()
	c.releaseLocked()
	c.mu.Unlock()
}

func (c *Slots[O]) releaseLocked() {
	if (c.max <= 0 || c.inUse <= c.max) && c.grantLocked() {
		return
	}
	c.inUse--
	c.freedLocked()
}

// grantLocked hands a slot to the oldest waiter that can take it (one out
// on offer has it held until its peer answers), and reports whether one
// did.
func (c *Slots[O]) grantLocked() bool {
	for e := c.queue.Front(); e != nil; e = e.Next() {
		w := e.Value.(*Waiter[O])
		switch {
		case w.offering && w.reserved:
			continue
		case w.offering:
			w.reserved = true
		default:
			c.queue.Remove(e)
			w.done = true
			close(w.granted)
		}
		return true
	}
	return false
}

// freedLocked tells onFree that a claim arriving now would not queue.
func (c *Slots[O]) freedLocked() {
	if c.onFree != nil && c.freeLocked() > 0 {
		c.onFree()
	}
}

// SetOnFree installs the free-slot hook (cluster mode).
func (c *Slots[O]) SetOnFree(f func()) {
	c.mu.Lock()
	c.onFree = f
	c.mu.Unlock()
}

// unlimitedFree is what free reports without a max_concurrent.
const unlimitedFree = math.MaxInt32

// Free is how many claims this broker would take now without queueing.
func (c *Slots[O]) Free() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.freeLocked()
}

func (c *Slots[O]) freeLocked() int {
	switch {
	case c.max <= 0:
		return unlimitedFree
	case c.queue.Len() > 0:
		return 0
	}
	return max(0, c.max-c.inUse)
}

// Take books a slot unconditionally: a restored lease's process is already
// running, and refusing it would hide it rather than stop it.
func (c *Slots[O]) Take() {
	c.mu.Lock()
	c.inUse++
	c.mu.Unlock()
}

// SetMax applies a reloaded max_concurrent. Raising it admits parked claims
// at once; lowering it evicts nothing.
func (c *Slots[O]) SetMax(max int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.max = max
	for (c.max <= 0 || c.inUse < c.max) && c.grantLocked() {
		c.inUse++
	}
	c.freedLocked()
}

// SetWait applies a reloaded queue_wait_timeout to the claims parked from
// now on; one already parked keeps the wait it was given.
func (c *Slots[O]) SetWait(wait time.Duration) {
	c.mu.Lock()
	c.wait = wait
	c.mu.Unlock()
}

// Snapshot returns the gauges GET /leases and /metrics report.
func (c *Slots[O]) Snapshot() (max, inUse, depth, maxDepth int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.max, c.inUse, c.queue.Len(), c.maxDepth
}

// OldestWait is how long the claim at the head of the queue has waited;
// zero when none waits.
func (c *Slots[O]) OldestWait() time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	if front := c.queue.Front(); front != nil {
		return time.Since(front.Value.(*Waiter[O]).since)
	}
	return 0
}
