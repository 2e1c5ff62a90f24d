package capacity

import (
	"context"
	"errors"
	"testing"
	"time"
)

func TestCapacityRefusals(t *testing.T) {
	ctx := context.Background()
	if err := New[offer](1, 5, 0).acquireN(ctx, 2); !errors.Is(err, ErrNoCapacity) {
		t.Fatalf("queue_wait_timeout 0: %v, want no capacity", err)
	}
	c := New[offer](1, 1, time.Hour)
	_ = c.Acquire(ctx, Quota[offer]{})
	go func() { _ = c.Acquire(ctx, Quota[offer]{}) }() // parks
	waitDepth(t, c, 1)
	if err := c.Acquire(ctx, Quota[offer]{}); !errors.Is(err, ErrQueueFull) {
		t.Fatalf("full queue: %v, want capacity queue full", err)
	}
	c2 := New[offer](1, 0, 20*time.Millisecond)
	_ = c2.Acquire(ctx, Quota[offer]{})
	if err := c2.Acquire(ctx, Quota[offer]{}); !errors.Is(err, ErrQueueTimeout) {
		t.Fatalf("timeout: %v", err)
	}
	if _, inUse, depth, _ := c2.Snapshot(); inUse != 1 || depth != 0 {
		t.Fatalf("after a timeout: inUse %d depth %d", inUse, depth)
	}
}

// acquireN takes n slots, returning the first error.
// offer stands for the gateway's queued offer, which this package never reads.
type offer struct{}

func (c *Slots[O]) acquireN(ctx context.Context, n int) error {
	for i := 0; i < n; i++ {
		if err := c.Acquire(ctx, Quota[O]{}); err != nil {
			return err
		}
	}
	return nil
}

func waitDepth(t *testing.T, c *Slots[offer], want int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		if _, _, d, _ := c.Snapshot(); d == want {
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
	c := New[offer](1, 0, time.Hour)
	_ = c.Acquire(ctx, Quota[offer]{})
	order := make(chan int, 3)
	for i := 0; i < 3; i++ {
		go func() {
			if c.Acquire(ctx, Quota[offer]{}) == nil {
				order <- i
			}
		}()
		waitDepth(t, c, i+1)
	}
	for want := 0; want < 3; want++ {
		c.Release()
		if got := <-order; got != want {
			t.Fatalf("slot went to waiter %d, want %d (FIFO)", got, want)
		}
	}
	if _, inUse, _, _ := c.Snapshot(); inUse != 1 {
		t.Fatalf("inUse = %d", inUse)
	}
}

func TestCapacityCancelledWaiterLeavesAtOnce(t *testing.T) {
	c := New[offer](1, 0, time.Hour)
	_ = c.Acquire(context.Background(), Quota[offer]{})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- c.Acquire(ctx, Quota[offer]{}) }()
	waitDepth(t, c, 1)
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v", err)
	}
	if _, inUse, depth, _ := c.Snapshot(); depth != 0 || inUse != 1 {
		t.Fatalf("after cancel: depth %d inUse %d", depth, inUse)
	}
}

func TestCapacitySetMax(t *testing.T) {
	ctx := context.Background()
	c := New[offer](1, 0, time.Hour)
	_ = c.Acquire(ctx, Quota[offer]{})
	done := make(chan error)
	go func() { done <- c.Acquire(ctx, Quota[offer]{}) }()
	waitDepth(t, c, 1)
	c.SetMax(2) // raising admits the parked claim at once
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	c.SetMax(1) // lowering evicts nothing
	if _, inUse, _, _ := c.Snapshot(); inUse != 2 {
		t.Fatalf("inUse = %d", inUse)
	}
	c.Release()
	c.Release()
	if _, inUse, _, _ := c.Snapshot(); inUse != 0 {
		t.Fatalf("inUse = %d", inUse)
	}
}

// TestCapacityPrincipalQueueQuota: a principal at its queue quota is refused
// at once, while another principal still parks, and the quota frees when a
// parked claim leaves.
func TestCapacityPrincipalQueueQuota(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	c := New[offer](1, 0, time.Hour)
	alice, bob := Quota[offer]{Principal: "alice", Max: 1}, Quota[offer]{Principal: "bob", Max: 1}
	_ = c.Acquire(ctx, alice) // takes the slot: not queued
	aliceParked, aliceCancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Acquire(aliceParked, alice) }()
	waitDepth(t, c, 1)
	if err := c.Acquire(ctx, alice); !errors.Is(err, ErrPrincipalQueue) {
		t.Fatalf("alice's second queued claim: %v, want the principal queue limit", err)
	}
	go func() { _ = c.Acquire(ctx, bob) }()
	waitDepth(t, c, 2)
	aliceCancel()
	<-done
	waitDepth(t, c, 1)
	go func() { _ = c.Acquire(ctx, alice) }()
	waitDepth(t, c, 2)
}

// TestCapacityQueuedClaimOutOnOffer: a parked claim out on offer to a peer
// keeps its place; a slot freed here meanwhile is held for it, and goes to
// the next waiter when the peer serves it, or to it when the peer declines.
// Exactly one of the two places serves each claim.
func TestCapacityQueuedClaimOutOnOffer(t *testing.T) {
	ctx := context.Background()
	c := New[offer](1, 0, time.Hour)
	freed := 0
	c.SetOnFree(func() { freed++ })
	_ = c.Acquire(ctx, Quota[offer]{})
	first, second := make(chan error, 1), make(chan error, 1)
	go func() { first <- c.Acquire(ctx, Quota[offer]{Offer: &offer{}}) }()
	waitDepth(t, c, 1)
	go func() { second <- c.Acquire(ctx, Quota[offer]{Offer: &offer{}}) }()
	waitDepth(t, c, 2)
	if c.Free() != 0 {
		t.Fatalf("free with claims queued = %d", c.Free())
	}

	w := c.NextOffer()
	if w == nil || c.NextOffer() == w {
		t.Fatal("nextOffer did not pick the oldest claim once")
	}
	c.OfferEnded(c.queue.Back().Value.(*Waiter[offer]), false) // the second goes back to waiting
	c.Release()                                                // held for the first, out on offer
	if _, inUse, depth, _ := c.Snapshot(); inUse != 1 || depth != 2 {
		t.Fatalf("a slot freed while the oldest is out on offer: inUse %d depth %d, want it held (1, 2)", inUse, depth)
	}
	c.OfferEnded(w, true) // the peer served it: the held slot goes to the second
	if err := <-first; !errors.Is(err, ErrServedAway) {
		t.Fatalf("the claim a peer served: %v, want served away", err)
	}
	if err := <-second; err != nil {
		t.Fatalf("the next claim: %v, want the held slot", err)
	}

	go func() { first <- c.Acquire(ctx, Quota[offer]{Offer: &offer{}}) }()
	waitDepth(t, c, 1)
	w = c.NextOffer()
	c.Release() // held for it
	c.OfferEnded(w, false)
	if err := <-first; err != nil {
		t.Fatalf("a declined claim with a slot held for it: %v, want the slot", err)
	}
	if _, inUse, depth, _ := c.Snapshot(); inUse != 1 || depth != 0 || freed != 0 {
		t.Fatalf("after: inUse %d depth %d, %d free announcements; want 1 0 0", inUse, depth, freed)
	}
	c.Release()
	if freed != 1 || c.Free() != 1 {
		t.Fatalf("a slot freed with nobody queued: %d announcements, free %d; want 1 and 1", freed, c.Free())
	}
}

// TestCapacityTimeoutWaitsForTheOffer: a claim whose wait ends while it is
// out on offer takes the peer's answer, so its lease there is not lost.
func TestCapacityTimeoutWaitsForTheOffer(t *testing.T) {
	c := New[offer](1, 0, 20*time.Millisecond)
	_ = c.Acquire(context.Background(), Quota[offer]{})
	done := make(chan error, 1)
	go func() { done <- c.Acquire(context.Background(), Quota[offer]{Offer: &offer{}}) }()
	waitDepth(t, c, 1)
	w := c.NextOffer()
	select {
	case err := <-done:
		t.Fatalf("gave up while out on offer: %v", err)
	case <-time.After(100 * time.Millisecond): // well past its 20 ms queue_wait_timeout
	}
	c.OfferEnded(w, true)
	if err := <-done; !errors.Is(err, ErrServedAway) {
		t.Fatalf("%v, want served away", err)
	}
}

// TestCapacityPassGoesToTheQueueFirst: a slot given up to a claim about to
// queue is the claim's only when nobody queues; else the oldest waiter
// gets it.
func TestCapacityPassGoesToTheQueueFirst(t *testing.T) {
	ctx := context.Background()
	c := New[offer](1, 0, time.Hour)
	_ = c.Acquire(ctx, Quota[offer]{})
	if !c.Pass() {
		t.Fatal("with nobody queued the slot was not the claim's")
	}
	if _, inUse, _, _ := c.Snapshot(); inUse != 1 {
		t.Fatalf("inUse = %d after a pass, want the one slot, now the claim's", inUse)
	}
	got := make(chan error, 1)
	go func() { got <- c.Acquire(ctx, Quota[offer]{}) }()
	waitDepth(t, c, 1)
	if c.Pass() {
		t.Fatal("a slot passed over the head of the queue")
	}
	if err := <-got; err != nil {
		t.Fatalf("the waiter got %v, want the slot", err)
	}
}
