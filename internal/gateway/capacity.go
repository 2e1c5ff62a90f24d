package gateway

import (
	"container/list"
	"context"
	"errors"
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
)

// queueQuota bounds how many queued claims one principal may hold; a zero
// quota (max <= 0) bounds nothing.
type queueQuota struct {
	principal string
	max       int
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
}

type waiter struct {
	granted chan struct{}
	done    bool      // granted or withdrawn; guarded by capacity.mu
	since   time.Time // when the claim was parked
}

func newCapacity(max, maxDepth int, wait time.Duration) *capacity {
	return &capacity{max: max, maxDepth: maxDepth, wait: wait, queued: map[string]int{}}
}

// acquire takes a slot, waiting in the queue when none is free. It fails with
// errNoCapacity (waiting disabled), errQueueFull, errPrincipalQueue (q's
// principal already holds its quota of the queue), errQueueTimeout, or
// ctx's error when the claimant went away.
func (c *capacity) acquire(ctx context.Context, q queueQuota) error {
	c.mu.Lock()
	if c.max <= 0 || (c.inUse < c.max && c.queue.Len() == 0) {
		c.inUse++
		c.mu.Unlock()
		return nil
	}
	if c.wait <= 0 {
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
	w := &waiter{granted: make(chan struct{}), since: time.Now()}
	el := c.queue.PushBack(w)
	if q.max > 0 {
		c.queued[q.principal]++
		defer c.unqueue(q.principal)
	}
	c.mu.Unlock()

	timer := time.NewTimer(c.wait)
	defer timer.Stop()
	var err error
	select {
	case <-w.granted:
		return nil
	case <-timer.C:
		err = errQueueTimeout
	case <-ctx.Done():
		err = ctx.Err()
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if w.done { // granted while we were giving up: keep the slot's books right
		c.releaseLocked()
		return err
	}
	w.done = true
	c.queue.Remove(el)
	return err
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
	if c.max <= 0 || c.inUse <= c.max {
		if front := c.queue.Front(); front != nil {
			w := c.queue.Remove(front).(*waiter)
			w.done = true
			close(w.granted)
			return
		}
	}
	c.inUse--
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
	for c.queue.Len() > 0 && (c.max <= 0 || c.inUse < c.max) {
		w := c.queue.Remove(c.queue.Front()).(*waiter)
		w.done = true
		close(w.granted)
		c.inUse++
	}
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
