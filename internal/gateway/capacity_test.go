package gateway

import (
	"context"
	"errors"
	"testing"
	"time"
)

func TestCapacityRefusals(t *testing.T) {
	ctx := context.Background()
	if err := newCapacity(1, 5, 0).acquireN(ctx, 2); !errors.Is(err, errNoCapacity) {
		t.Fatalf("queue_wait_timeout 0: %v, want no capacity", err)
	}
	c := newCapacity(1, 1, time.Hour)
	_ = c.acquire(ctx, queueQuota{})
	go func() { _ = c.acquire(ctx, queueQuota{}) }() // parks
	waitDepth(t, c, 1)
	if err := c.acquire(ctx, queueQuota{}); !errors.Is(err, errQueueFull) {
		t.Fatalf("full queue: %v, want capacity queue full", err)
	}
	c2 := newCapacity(1, 0, 20*time.Millisecond)
	_ = c2.acquire(ctx, queueQuota{})
	if err := c2.acquire(ctx, queueQuota{}); !errors.Is(err, errQueueTimeout) {
		t.Fatalf("timeout: %v", err)
	}
	if _, inUse, depth, _ := c2.snapshot(); inUse != 1 || depth != 0 {
		t.Fatalf("after a timeout: inUse %d depth %d", inUse, depth)
	}
}

// acquireN takes n slots, returning the first error.
func (c *capacity) acquireN(ctx context.Context, n int) error {
	for i := 0; i < n; i++ {
		if err := c.acquire(ctx, queueQuota{}); err != nil {
			return err
		}
	}
	return nil
}

func waitDepth(t *testing.T, c *capacity, want int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		if _, _, d, _ := c.snapshot(); d == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("queue depth never reached %d", want)
		}
		time.Sleep(time.Millisecond) // polling a counter with a deadline
	}
}

func TestCapacityHandsFreedSlotsToTheOldestWaiter(t *testing.T) {
	ctx := context.Background()
	c := newCapacity(1, 0, time.Hour)
	_ = c.acquire(ctx, queueQuota{})
	order := make(chan int, 3)
	for i := 0; i < 3; i++ {
		go func() {
			if c.acquire(ctx, queueQuota{}) == nil {
				order <- i
			}
		}()
		waitDepth(t, c, i+1)
	}
	for want := 0; want < 3; want++ {
		c.release()
		if got := <-order; got != want {
			t.Fatalf("slot went to waiter %d, want %d (FIFO)", got, want)
		}
	}
	if _, inUse, _, _ := c.snapshot(); inUse != 1 {
		t.Fatalf("inUse = %d", inUse)
	}
}

func TestCapacityCancelledWaiterLeavesAtOnce(t *testing.T) {
	c := newCapacity(1, 0, time.Hour)
	_ = c.acquire(context.Background(), queueQuota{})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- c.acquire(ctx, queueQuota{}) }()
	waitDepth(t, c, 1)
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v", err)
	}
	if _, inUse, depth, _ := c.snapshot(); depth != 0 || inUse != 1 {
		t.Fatalf("after cancel: depth %d inUse %d", depth, inUse)
	}
}

func TestCapacitySetMax(t *testing.T) {
	ctx := context.Background()
	c := newCapacity(1, 0, time.Hour)
	_ = c.acquire(ctx, queueQuota{})
	done := make(chan error)
	go func() { done <- c.acquire(ctx, queueQuota{}) }()
	waitDepth(t, c, 1)
	c.setMax(2) // raising admits the parked claim at once
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	c.setMax(1) // lowering evicts nothing
	if _, inUse, _, _ := c.snapshot(); inUse != 2 {
		t.Fatalf("inUse = %d", inUse)
	}
	c.release()
	c.release()
	if _, inUse, _, _ := c.snapshot(); inUse != 0 {
		t.Fatalf("inUse = %d", inUse)
	}
}

// TestCapacityPrincipalQueueQuota: a principal at its queue quota is refused
// at once, while another principal still parks, and the quota frees when a
// parked claim leaves.
func TestCapacityPrincipalQueueQuota(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	c := newCapacity(1, 0, time.Hour)
	alice, bob := queueQuota{principal: "alice", max: 1}, queueQuota{principal: "bob", max: 1}
	_ = c.acquire(ctx, alice) // takes the slot: not queued
	aliceParked, aliceCancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.acquire(aliceParked, alice) }()
	waitDepth(t, c, 1)
	if err := c.acquire(ctx, alice); !errors.Is(err, errPrincipalQueue) {
		t.Fatalf("alice's second queued claim: %v, want the principal queue limit", err)
	}
	go func() { _ = c.acquire(ctx, bob) }()
	waitDepth(t, c, 2)
	aliceCancel()
	<-done
	waitDepth(t, c, 1)
	go func() { _ = c.acquire(ctx, alice) }()
	waitDepth(t, c, 2)
}

// TestCapacityQueuedClaimOutOnOffer: a parked claim out on offer to a peer
// keeps its place; a slot freed here meanwhile is held for it, and goes to
// the next waiter when the peer serves it, or to it when the peer declines.
// Exactly one of the two places serves each claim.
func TestCapacityQueuedClaimOutOnOffer(t *testing.T) {
	ctx := context.Background()
	c := newCapacity(1, 0, time.Hour)
	freed := 0
	c.setOnFree(func() { freed++ })
	_ = c.acquire(ctx, queueQuota{})
	first, second := make(chan error, 1), make(chan error, 1)
	go func() { first <- c.acquire(ctx, queueQuota{offer: &queuedOffer{}}) }()
	waitDepth(t, c, 1)
	go func() { second <- c.acquire(ctx, queueQuota{offer: &queuedOffer{}}) }()
	waitDepth(t, c, 2)
	if c.free() != 0 {
		t.Fatalf("free with claims queued = %d", c.free())
	}

	w := c.nextOffer()
	if w == nil || c.nextOffer() == w {
		t.Fatal("nextOffer did not pick the oldest claim once")
	}
	c.offerEnded(c.queue.Back().Value.(*waiter), false) // the second goes back to waiting
	c.release()                                         // held for the first, out on offer
	if _, inUse, depth, _ := c.snapshot(); inUse != 1 || depth != 2 {
		t.Fatalf("a slot freed while the oldest is out on offer: inUse %d depth %d, want it held (1, 2)", inUse, depth)
	}
	c.offerEnded(w, true) // the peer served it: the held slot goes to the second
	if err := <-first; !errors.Is(err, errServedAway) {
		t.Fatalf("the claim a peer served: %v, want served away", err)
	}
	if err := <-second; err != nil {
		t.Fatalf("the next claim: %v, want the held slot", err)
	}

	go func() { first <- c.acquire(ctx, queueQuota{offer: &queuedOffer{}}) }()
	waitDepth(t, c, 1)
	w = c.nextOffer()
	c.release() // held for it
	c.offerEnded(w, false)
	if err := <-first; err != nil {
		t.Fatalf("a declined claim with a slot held for it: %v, want the slot", err)
	}
	if _, inUse, depth, _ := c.snapshot(); inUse != 1 || depth != 0 || freed != 0 {
		t.Fatalf("after: inUse %d depth %d, %d free announcements; want 1 0 0", inUse, depth, freed)
	}
	c.release()
	if freed != 1 || c.free() != 1 {
		t.Fatalf("a slot freed with nobody queued: %d announcements, free %d; want 1 and 1", freed, c.free())
	}
}

// TestCapacityTimeoutWaitsForTheOffer: a claim whose wait ends while it is
// out on offer takes the peer's answer, so its lease there is not lost.
func TestCapacityTimeoutWaitsForTheOffer(t *testing.T) {
	c := newCapacity(1, 0, 20*time.Millisecond)
	_ = c.acquire(context.Background(), queueQuota{})
	done := make(chan error, 1)
	go func() { done <- c.acquire(context.Background(), queueQuota{offer: &queuedOffer{}}) }()
	waitDepth(t, c, 1)
	w := c.nextOffer()
	select {
	case err := <-done:
		t.Fatalf("gave up while out on offer: %v", err)
	case <-time.After(100 * time.Millisecond): // well past its 20 ms queue_wait_timeout
	}
	c.offerEnded(w, true)
	if err := <-done; !errors.Is(err, errServedAway) {
		t.Fatalf("%v, want served away", err)
	}
}
