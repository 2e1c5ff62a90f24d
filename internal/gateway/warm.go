package gateway

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/config"
	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/capacity"
	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/pool"
	"github.com/nexus-broker/nexus-broker/internal/gateway/spawner"
)

// The lease core's side of the warm pools (internal/pool decides, this file
// acts): a warm lease is a lease like any other, booted on a slot of
// max_concurrent, with no owner until a claim is handed it.

// warmPools is the pool manager and where it reads its pools from.
type warmPools struct {
	m *pool.Manager
	// specs is the pools a config declares (pools:, and warm: on agents:
	// profiles); a test may set its own.
	specs func(*config.Config) []pool.Spec
}

// poolSpecs is the pools cfg declares (config.AllPools), as the manager's
// specs.
func poolSpecs(cfg *config.Config) []pool.Spec {
	ps := cfg.AllPools()
	specs := make([]pool.Spec, len(ps))
	for i, p := range ps {
		specs[i] = pool.Spec{Name: p.Name, Entry: p.Binary, Config: p.Config, MinIdle: p.MinIdle, MaxAge: p.MaxAge.D()}
	}
	return specs
}

// The teardown reasons of a warm lease whose hand-out spawnd could not
// record, and of one whose hand-out it refused.
const (
	reasonHandOut        = "hand-out not recorded"
	reasonHandOutRefused = "hand-out refused"
)

// handOut serves a new session's claim from the pool whose entry and config
// are the claim's, if one has an instance idle: its lease, its session id,
// now principal's. ok false is a cold claim (no pool matches, none is idle,
// or the one taken ended meanwhile, or spawnd refused its hand-out:
// FailedPrecondition, such as a session another principal owns, and the
// instance is retired). spawnd records the owner durably before the claim
// is answered; if it cannot, the claim is refused as a spawn its journal
// refused, and the instance retired, never handed to another claim.
func (g *Gateway) handOut(ctx context.Context, principal, entry string, cfgData []byte, admitted *bool) (l *lease, cerr *claimError, ok bool) {
	id, name, ok := g.pools.m.Take(entry, cfgData)
	if !ok {
		return nil, nil, false
	}
	defer g.pools.m.Refill(name) // once the owner is recorded, or refused
	if l = g.lookup(id); l == nil {
		return nil, nil, false
	}
	l.mu.Lock()
	session, live := l.sessionID, l.state == stateActive && l.warm.pool != ""
	l.mu.Unlock()
	if !live {
		return nil, nil, false
	}
	owner := principal
	if owner == "" {
		owner = spawner.Anonymous // the caller of a broker without auth:
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	err := g.sp.Record(rctx, id, session, owner)
	cancel()
	if err != nil && l.currentState() == stateDraining {
		return nil, nil, false // it ended meanwhile: a cold claim
	}
	if spawner.CodeOf(err) == spawner.FailedPrecondition {
		g.log.Warn("nexus-spawnd refused to hand a warm instance out; the instance is retired and the claim spawns cold",
			"lease_id", id, "pool", name, "error", spawner.MessageOf(err))
		select { // the claim spawns cold on that slot, or waits as any other
		case <-g.retire(l, reasonHandOutRefused):
		case <-ctx.Done():
		}
		return nil, nil, false
	}
	if err != nil {
		g.log.Error("handing a warm instance out failed: nexus-spawnd could not record its owner; the claim is refused and the instance retired",
			"lease_id", id, "pool", name, "error", spawner.MessageOf(err), "code", spawner.CodeOf(err))
		g.retire(l, reasonHandOut)
		cerr = refuse(http.StatusServiceUnavailable, "journal_unavailable", errJournalUnavailable)
		cerr.retryAfter = journalRetryAfter
		return nil, cerr, true
	}
	g.mu.Lock()
	l.mu.Lock()
	l.principal, l.warm.pool = principal, ""
	l.lastActivity = time.Now()
	l.rearmLocked()
	l.mu.Unlock()
	g.unadmitLocked(principal) // the lease itself counts from here
	*admitted = false
	g.mu.Unlock()
	g.log.Info("claim served by a warm instance", "lease_id", id, "pool", name, "session_id", session)
	g.publish(EventClaimed, l, "")
	return l, nil, true
}

// takeSlot is acquire, except that a claim finding no free slot first ends
// the oldest warm instance nobody claimed (idle, else booting) and takes
// its slot: a claim never queues behind a warm instance. With claims
// already queued, the slot goes to the oldest of them, and this one queues
// as any other. Either way the slot is passed on once spawnd no longer
// counts the instance (uncounted), so that its spawnd.max_leases never
// refuses the spawn the slot was freed for.
func (g *Gateway) takeSlot(ctx context.Context, acquire func(context.Context, capacity.Quota[queuedOffer]) error, q capacity.Quota[queuedOffer]) error {
	for g.cap.Full() {
		id, ok := g.pools.m.Yield()
		if !ok {
			break
		}
		l := g.lookup(id)
		if l == nil || !l.warm.freed.CompareAndSwap(false, true) {
			continue // it ended meanwhile, and its slot is free again
		}
		g.log.Info("a warm instance gives its slot up to a claim", "lease_id", id)
		g.end(l, pool.ReasonYielded)
		if err := l.uncounted(ctx); err != nil {
			g.freeSlot()
			return err
		}
		if g.cap.Pass() {
			return nil
		}
		break
	}
	return acquire(ctx, q)
}

// uncounted waits until spawnd no longer counts l toward spawnd.max_leases:
// its Spawn failed, its Terminate was answered, or it exited; or until ctx
// ends.
func (l *lease) uncounted(ctx context.Context) error {
	select {
	case <-l.proven:
	case <-ctx.Done():
		return ctx.Err()
	}
	if l.verifier == nil {
		return nil // its Spawn failed: spawnd holds nothing
	}
	select {
	case <-l.terminating:
	case <-l.exited:
	case <-ctx.Done():
		return ctx.Err()
	}
	return nil
}

// retire ends a warm lease nobody claimed and frees its slot (a queued claim
// first) once spawnd no longer counts it (uncounted), so that its max_leases
// never refuses the spawn the slot goes to; the channel is closed then.
func (g *Gateway) retire(l *lease, reason string) <-chan struct{} {
	g.end(l, reason)
	freed := make(chan struct{})
	go func() {
		_ = l.uncounted(context.Background()) // every retired lease is proven, then terminated or exited
		l.releaseSlot()
		close(freed)
	}()
	return freed
}

// warmEnded is why a warm lease's boot was ended (end): its teardown
// reason.
type warmEnded string

func (e warmEnded) Error() string { return string(e) }

// end tears a warm lease down for reason, its slot already given up. One
// still booting has its boot ended, which tears it down once spawnd has
// answered its Spawn (Warm); any other has its instance asked over its
// socket if it has one, else sent SIGTERM at once.
func (g *Gateway) end(l *lease, reason string) {
	mode := teardownGraceful
	l.mu.Lock()
	if l.inst == nil {
		mode = teardownSkipGrace
	}
	abandon := l.warm.abandon
	l.warm.abandon = nil
	l.mu.Unlock()
	if abandon != nil {
		abandon(warmEnded(reason))
		return
	}
	go l.teardown(reason, mode)
}

// warmHost is the core as the pool manager's pool.Host.
type warmHost struct{ g *Gateway }

// errNoSession fails a warm boot whose instance reported no session id: a
// claim is handed a session, and spawnd hands out only a lease with one.
var errNoSession = errors.New("the instance reported no session id within session_report_grace")

// Warm boots a warm lease of s on a slot free now, never a queued claim's.
func (h warmHost) Warm(ctx context.Context, s pool.Spec, tag string, started func(string)) (string, error) {
	g := h.g
	if cerr := g.spawnerUnavailable(); cerr != nil {
		return "", cerr
	}
	if g.cap.TryAcquire(ctx, capacity.Quota[queuedOffer]{}) != nil {
		return "", pool.ErrNoSlot
	}
	l, cerr := g.mintLease("", s.Entry, "", s.Name, nil)
	if cerr != nil {
		return "", cerr
	}
	// Not bounded by the gateway's shutdown (a warm instance booting then
	// redials the next gateway, which adopts it); ended by a claim that
	// needs its slot (end).
	bctx, abandon := context.WithCancelCause(context.WithoutCancel(ctx))
	defer abandon(nil)
	l.mu.Lock()
	l.warm.abandon = abandon
	l.mu.Unlock()
	started(l.id)
	cerr = g.bootLease(bctx, l, spawner.SpawnRequest{Entry: s.Entry, Config: s.Config, Pool: tag})
	l.mu.Lock()
	ended := l.warm.abandon == nil // end took it: a claim has the slot
	l.warm.abandon = nil
	l.mu.Unlock()
	switch {
	case ended:
		if cerr == nil { // booted before its boot was ended: end it now
			g.end(l, pool.ReasonYielded)
		}
		return "", pool.ErrYielded
	case cerr != nil && cerr.cause != "":
		return "", fmt.Errorf("%s: %s", cerr.text, cerr.cause)
	case cerr != nil:
		return "", cerr
	}
	l.mu.Lock()
	session := l.sessionID
	l.mu.Unlock()
	if session == "" {
		g.retire(l, reasonReadyTimeout)
		return "", errNoSession
	}
	g.log.Info("warm instance ready", "lease_id", l.id, "pool", s.Name, "session_id", session)
	return l.id, nil
}

// Retire ends the warm lease id, if it is still there.
func (h warmHost) Retire(id, reason string) {
	if l := h.g.lookup(id); l != nil {
		h.g.retire(l, reason)
	}
}

// Queued reports whether a claim waits for a slot.
func (h warmHost) Queued() bool {
	_, _, depth, _ := h.g.cap.Snapshot()
	return depth > 0
}

// adopt takes back, at restore, a warm lease spawnd journaled under tag;
// one no pool in force has (removed, or its config changed while no
// gateway ran) is retired, and so is one that had reported no session id
// (its boot was cut short: a claim is handed a session).
func (g *Gateway) adopt(l *lease, tag string) {
	l.mu.Lock()
	l.warm.pool = tag
	booted := l.sessionID != ""
	l.mu.Unlock()
	if !booted {
		g.log.Info("retiring a warm instance that had reported no session id", "lease_id", l.id, "pool", tag)
		g.retire(l, reasonReadyTimeout)
		return
	}
	name, ok := g.pools.m.Adopt(tag, l.id, l.createdAt)
	if !ok {
		g.log.Info("retiring a warm instance of a pool no longer in force", "lease_id", l.id, "pool", tag)
		g.retire(l, pool.ReasonReloaded)
		return
	}
	l.mu.Lock()
	l.warm.pool = name
	l.mu.Unlock()
}
