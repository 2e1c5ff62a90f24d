package gateway

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
	errNoCapacity   = errors.New("no capacity")
	errQueueFull    = errors.New("capacity queue full")
	errQueueTimeout = errors.New("capacity wait timed out")
	// errPrincipalQueue is a quota answer about the caller, not the broker.
	errPrincipalQueue = errors.New("queued claim limit reached for this principal")
	// errDeclined is an offered claim that found no free slot here.
	errDeclined = errors.New("no free slot for an offered claim")
	// errServedAway is a queued claim a peer with a free slot served.
	errServedAway = errors.New("served by a peer")
)

// queueQuota bounds how many queued claims one principal may hold; a zero
// quota (max <= 0) bounds nothing. offer, when set, lets a peer with a
// free slot serve the claim while it waits here (cluster mode).
type queueQuota struct {
	principal string
	max       int
	offer     *queuedOffer
}

// capacity is max_concurrent slots plus the FIFO queue of claims waiting for
// one. A freed slot is handed straight to the oldest waiter (it never becomes
// free in between, so no newcomer can overtake the queue).
type capacity struct {
	mu       sync.Mutex
	max      int // <= 0: unlimited
	inUse    int
	queue    list.List // of *waiter, oldest at the front
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

// waiter is one parked claim. Its fields are guarded by capacity.mu.
type waiter struct {
	granted chan struct{}
	el      *list.Element
	done    bool      // granted, served by a peer, or withdrawn
	since   time.Time // when the claim was parked
	offer   *queuedOffer
	// offering: out on offer to a peer now, keeping its place. reserved: a
	// slot here freed for it meanwhile, held until the peer answers, so
	// exactly one broker spawns it. away: the peer served it.
	offering, reserved, away bool
}

func newCapacity(max, maxDepth int, wait time.Duration) *capacity {
	c := &capacity{max: max, maxDepth: maxDepth, wait: wait, queued: map[string]int{}}
	c.offerEnd = sync.NewCond(&c.mu)
	return c
}

// acquire takes a slot, waiting in the queue when none is free. It fails with
// errNoCapacity (waiting disabled), errQueueFull, errPrincipalQueue (q's
// principal already holds its quota of the queue), errQueueTimeout, or
// ctx's error when the claimant went away; errServedAway means a peer
// served q.offer meanwhile, and no slot was taken here.
func (c *capacity) acquire(ctx context.Context, q queueQuota) error {
	c.mu.Lock()
	if c.max <= 0 || (c.inUse < c.max && c.queue.Len() == 0) {
		c.inUse++
		c.mu.Unlock()
		return nil
	}
	wait := c.wait // read under mu: a reload may change it
	if wait <= 0 {
		c.mu.Unlock()
		return errNoCapacity
	}
	if q.max > 0 && c.queued[q.principal] >= q.max {
		c.mu.Unlock()
		return errPrincipalQueue
	}
	if c.maxDepth > 0 && c.queue.Len() >= c.maxDepth {
		c.mu.Unlock()
		return errQueueFull
	}
	w := &waiter{granted: make(chan struct{}), since: time.Now(), offer: q.offer}
	w.el = c.queue.PushBack(w)
	if q.max > 0 {
		c.queued[q.principal]++
		defer c.unqueue(q.principal)
	}
	c.mu.Unlock()

	timer := time.NewTimer(wait)
	defer timer.Stop()
	var err error
	select {
	case <-w.granted:
		if w.away { // written before granted was closed
			return errServedAway
		}
		return nil
	case <-timer.C:
		err = errQueueTimeout
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
		return errServedAway
	case w.done: // granted while we were giving up: keep the slot's books right
		c.releaseLocked()
		return err
	}
	w.done = true
	c.queue.Remove(w.el)
	return err
}

// nextOffer marks the oldest parked claim a peer may serve as out on offer
// and returns it; nil when there is none.
func (c *capacity) nextOffer() *waiter {
	c.mu.Lock()
	defer c.mu.Unlock()
	for e := c.queue.Front(); e != nil; e = e.Next() {
		if w := e.Value.(*waiter); w.offer != nil && !w.offering {
			w.offering = true
			return w
		}
	}
	return nil
}

// offerEnded takes back a claim that was out on offer: served by the peer,
// it leaves the queue (and a slot held for it here goes to the next
// waiter); declined, it waits on in its place, or takes the slot held for
// it.
func (c *capacity) offerEnded(w *waiter, served bool) {
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

// tryAcquire takes a slot only if one is free now and nobody queues for
// it: a claim another broker offers never overtakes this broker's queue.
func (c *capacity) tryAcquire(context.Context, queueQuota) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.max <= 0 || (c.inUse < c.max && c.queue.Len() == 0) {
		c.inUse++
		return nil
	}
	return errDeclined
}

// full reports whether a claim arriving now would queue.
func (c *capacity) full() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.max > 0 && (c.inUse >= c.max || c.queue.Len() > 0)
}

func (c *capacity) unqueue(principal string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.queued[principal]--; c.queued[principal] <= 0 {
		delete(c.queued, principal)
	}
}

// release frees one slot, handing it to the oldest waiter if there is one.
func (c *capacity) release() {
	c.mu.Lock()
	c.releaseLocked()
	c.mu.Unlock()
}

func (c *capacity) releaseLocked() {
	if (c.max <= 0 || c.inUse <= c.max) && c.grantLocked() {
		return
	}
	c.inUse--
	c.freedLocked()
}

// grantLocked hands a slot to the oldest waiter that can take it (one out
// on offer has it held until its peer answers), and reports whether one
// did.
func (c *capacity) grantLocked() bool {
	for e := c.queue.Front(); e != nil; e = e.Next() {
		w := e.Value.(*waiter)
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
func (c *capacity) freedLocked() {
	if c.onFree != nil && c.freeLocked() > 0 {
		c.onFree()
	}
}

// setOnFree installs the free-slot hook (cluster mode).
func (c *capacity) setOnFree(f func()) {
	c.mu.Lock()
	c.onFree = f
	c.mu.Unlock()
}

// unlimitedFree is what free reports without a max_concurrent.
const unlimitedFree = math.MaxInt32

// free is how many claims this broker would take now without queueing.
func (c *capacity) free() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.freeLocked()
}

func (c *capacity) freeLocked() int {
	switch {
	case c.max <= 0:
		return unlimitedFree
	case c.queue.Len() > 0:
		return 0
	}
	return max(0, c.max-c.inUse)
}

// take books a slot unconditionally: a restored lease's process is already
// running, and refusing it would hide it rather than stop it.
func (c *capacity) take() {
	c.mu.Lock()
	c.inUse++
	c.mu.Unlock()
}

// setMax applies a reloaded max_concurrent. Raising it admits parked claims
// at once; lowering it evicts nothing.
func (c *capacity) setMax(max int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.max = max
	for (c.max <= 0 || c.inUse < c.max) && c.grantLocked() {
		c.inUse++
	}
	c.freedLocked()
}

// setWait applies a reloaded queue_wait_timeout to the claims parked from
// now on; one already parked keeps the wait it was given.
func (c *capacity) setWait(wait time.Duration) {
	c.mu.Lock()
	c.wait = wait
	c.mu.Unlock()
}

// snapshot returns the gauges GET /leases and /metrics report.
func (c *capacity) snapshot() (max, inUse, depth, maxDepth int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.max, c.inUse, c.queue.Len(), c.maxDepth
}

// oldestWait is how long the claim at the head of the queue has waited;
// zero when none waits.
func (c *capacity) oldestWait() time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	if front := c.queue.Front(); front != nil {
		return time.Since(front.Value.(*waiter).since)
	}
	return 0
}
