package e2e

import (
	"context"
	"log/slog"
	"syscall"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/config/core"
	"github.com/nexus-broker/nexus-broker/internal/gateway/spawner"
	"github.com/nexus-broker/nexus-broker/internal/spawnclient"
)

// dialSpawnd attaches to b's nexus-spawnd as its gateway would, with no
// gateway running: the test speaks the gateway's half of the RPC itself.
func dialSpawnd(t *testing.T, b *Broker) *spawnclient.Client {
	t.Helper()
	cfgPath, err := core.Canonical(b.ConfigPath)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := spawnclient.Dial(ctx, spawnclient.DialOptions{RunDir: b.RunDir, ConfigPath: cfgPath, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatalf("attaching to nexus-spawnd: %v", err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// restartSpawnd kills nexus-spawnd with sig, starts another and waits for
// c to attach to it.
func restartSpawnd(t *testing.T, b *Broker, c *spawnclient.Client, sig syscall.Signal) {
	t.Helper()
	b.KillSpawnd(sig)
	b.StartSpawnd()
	select {
	case <-c.Reconnected():
	case <-time.After(30 * time.Second):
		t.Fatal("not re-attached to the restarted nexus-spawnd within 30s")
	}
}

// heldAs is the lease id of spawnd's List, failing the test if it is not
// there.
func heldAs(t *testing.T, c *spawnclient.Client, id string) spawner.Held {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	list, err := c.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range list {
		if h.LeaseID == id {
			return h
		}
	}
	t.Fatalf("nexus-spawnd does not hold lease %s: %+v", id, list)
	return spawner.Held{}
}

// TestAWarmLeaseSurvivesKill9OfSpawnd: a warm lease of the real
// nexus-spawnd, journaled with its pool and no owner, comes back after a
// kill -9 with both (the same instance), is handed out once (a second
// hand-out is refused), and after another kill -9 is its owner's, no
// pool's, with its session the owner's for Binding.
func TestAWarmLeaseSurvivesKill9OfSpawnd(t *testing.T) {
	b := newBroker(t, Options{StateDir: true}) // spawnd alone: the test is its gateway
	c := dialSpawnd(t, b)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	spawned, err := c.Spawn(ctx, spawner.SpawnRequest{LeaseID: "warm-1", Entry: "nexus", Config: []byte("engine:\n  name: example\n"), Pool: "default"})
	if err != nil {
		t.Fatal(err)
	}
	pid := spawned.Pid
	if err := c.Record(ctx, "warm-1", "sess-warm-1", ""); err != nil {
		t.Fatal(err)
	}

	restartSpawnd(t, b, c, syscall.SIGKILL)
	if h := heldAs(t, c, "warm-1"); h.Pool != "default" || h.Principal != "" || h.SessionID != "sess-warm-1" || h.Pid != pid {
		t.Fatalf("after kill -9 of spawnd, warm-1 = %+v, want pool default, no principal, sess-warm-1, pid %d", h, pid)
	}
	if err := c.Record(ctx, "warm-1", "", "alice"); err != nil {
		t.Fatalf("hand-out: %v", err)
	}
	if err := c.Record(ctx, "warm-1", "", "bob"); spawner.CodeOf(err) != spawner.FailedPrecondition {
		t.Fatalf("second hand-out = %v, want FailedPrecondition", err)
	}

	restartSpawnd(t, b, c, syscall.SIGKILL)
	if h := heldAs(t, c, "warm-1"); h.Pool != "" || h.Principal != "alice" || h.Pid != pid {
		t.Fatalf("after the hand-out and kill -9 of spawnd, warm-1 = %+v, want alice's, no pool, pid %d", h, pid)
	}
	if err := c.Record(ctx, "warm-1", "", spawner.Anonymous); spawner.CodeOf(err) != spawner.FailedPrecondition {
		t.Fatalf("hand-out after the restart = %v, want FailedPrecondition", err)
	}
	for principal, want := range map[string]spawner.Ownership{"alice": spawner.OwnerSelf, "bob": spawner.OwnerOther} {
		if got, err := c.Binding(ctx, "sess-warm-1", principal); err != nil || got.Owner != want {
			t.Errorf("Binding of the handed-out session for %s = %+v (%v), want %v", principal, got, err, want)
		}
	}
	if err := c.Terminate(ctx, spawner.Termination{LeaseID: "warm-1", Reason: "manual release", SkipGrace: true}); err != nil {
		t.Fatal(err)
	}
}
