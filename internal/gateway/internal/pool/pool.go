// Package pool is the lease core's warm pools: per operator-declared pool,
// instances booted before anyone claims them, handed to a claim whose
// entry and config are the pool's, refilled at once, recycled after
// max_age, backed off when they fail to boot, and given up to a claim that
// finds no free slot. It is internal to the lease core (internal/gateway):
// no other layer can import it.
//
// The manager holds no lease and spawns nothing itself: it decides, and
// asks its Host (the core) to reserve a slot, boot a warm lease and retire
// one. A warm lease is the core's lease like any other, with no owner.
//
// It imports nothing of the project.
package pool

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
)

// Spec is one pool as the operator declared it (pools:, or warm: on an
// agents: profile), in the manager's own terms.
type Spec struct {
	// Name is the pool's, in logs, metrics and GET /leases.
	Name string
	// Entry is the binaries: entry its instances run.
	Entry string
	// Config is the engine config they boot with; a claim is served from
	// the pool only when its config is byte-identical.
	Config []byte
	// MinIdle is how many warm instances are kept ready.
	MinIdle int
	// MaxAge recycles an instance nobody claimed; zero is DefaultMaxAge.
	MaxAge time.Duration
}

// DefaultMaxAge is max_age when the operator set none.
const DefaultMaxAge = time.Hour

// Backoff bounds: a pool whose instances fail to boot waits firstBackoff
// after the first failure, doubling to maxBackoff.
const (
	firstBackoff = 100 * time.Millisecond
	maxBackoff   = 30 * time.Second
)

// The teardown reasons of a warm lease nobody claimed, as GET /leases, the
// log and the journal name them.
const (
	ReasonMaxAge   = "pool max_age"
	ReasonReloaded = "pool reloaded"
	ReasonYielded  = "yielded to a claim"
)

// ErrNoSlot is Host.Warm's word that no slot was free, and ErrYielded that
// the boot was ended to give its slot to a claim (Yield): neither is a boot
// failure.
var (
	ErrNoSlot  = errors.New("no free slot")
	ErrYielded = errors.New("yielded its slot to a claim")
)

// Tag is what spawnd journals as a warm lease's pool: the pool's name (cut
// to fit spawnd's 64 bytes) and a digest of its name, entry and config, so
// that a restarted gateway re-adopts a warm lease only into the pool it
// booted for, never into one whose config changed meanwhile.
func (s Spec) Tag() string {
	h := sha256.New()
	for _, part := range [][]byte{[]byte(s.Name), []byte(s.Entry), s.Config} {
		h.Write(part)
		h.Write([]byte{0})
	}
	name := s.Name
	if len(name) > maxTagName {
		name = name[:maxTagName]
	}
	return name + ":" + hex.EncodeToString(h.Sum(nil)[:8])
}

// maxTagName is how much of a pool's name its Tag keeps: spawnd carries at
// most 64 bytes, and the digest takes 17.
const maxTagName = 64 - 17

func (s Spec) maxAge() time.Duration {
	if s.MaxAge <= 0 {
		return DefaultMaxAge
	}
	return s.MaxAge
}

// Host is the lease core as the manager uses it.
type Host interface {
	// Warm reserves a capacity slot without queueing (ErrNoSlot when none
	// is free or a claim queues for one) and boots a warm lease of s on it,
	// journaled under tag, answering its id once its instance is ready. It
	// calls started with the lease's id once the lease is in the core's
	// books, before its spawn. On any error the lease is gone and its slot
	// given back.
	Warm(ctx context.Context, s Spec, tag string, started func(id string)) (id string, err error)
	// Retire ends a warm lease nobody claimed, for reason; its slot is
	// free at once.
	Retire(id, reason string)
	// Queued reports whether a claim waits in the capacity queue.
	Queued() bool
}

// Stat is one pool's figures, for /metrics and the console.
type Stat struct {
	Name, Entry            string
	MinIdle, Idle, Booting int
	// Hits and Misses count the claims that named the pool's entry and
	// config, served warm or cold; RefillFailures the instances that failed
	// to boot. A reload that keeps the name keeps them.
	Hits, Misses, RefillFailures uint64
}

// instance is one warm lease of a pool.
type instance struct {
	id      string
	p       *pool
	created time.Time
	// idle: ready and unclaimed; else booting: spawned by this manager
	// (its boot answers), or adopted (waiting for its instance to
	// reattach). yielded: given up to a claim while booting.
	idle, adopted, yielded bool
	age                    *time.Timer
}

// pool is one Spec's books, under Manager.mu.
type pool struct {
	spec Spec
	tag  string
	// idle is oldest first; booting counts spawns in flight and adopted
	// leases whose instance has not reattached yet.
	idle    []*instance
	booting int
	// gone: removed or replaced by a reload; what it still boots retires.
	gone bool
	// slotless: its last spawn found no free slot; it waits for one to
	// free (Freed) rather than try again at once.
	slotless bool
	// failures in a row; backoff is armed while it waits to retry.
	failures int
	backoff  *time.Timer
	stat     Stat
}

// Manager keeps the pools filled and hands their instances out.
type Manager struct {
	host Host
	log  *slog.Logger
	mu   sync.Mutex
	ctx  context.Context // nil until Start
	// order is the pools as declared; leases every warm lease not yet
	// claimed, by id.
	order  []*pool
	leases map[string]*instance
	// freed counts the slots freed (SlotFreed), so that a spawn that found
	// none can tell whether one freed while it looked; kick wakes the
	// pools waiting for one.
	freed atomic.Uint64
	kick  chan struct{}
}

// New is a manager with no pool; nothing is spawned before Start.
func New(h Host, log *slog.Logger) *Manager {
	return &Manager{host: h, log: log, leases: map[string]*instance{}, kick: make(chan struct{}, 1)}
}

// Set puts specs in force, at boot and on each reload. A pool whose entry
// and config are unchanged keeps its instances (min_idle and max_age apply
// to them at once); one removed, or whose entry or config changed, retires
// its instances nobody claimed, and the new config's are spawned.
func (m *Manager) Set(specs []Spec) {
	m.mu.Lock()
	defer m.mu.Unlock()
	old := map[string]*pool{}
	for _, p := range m.order {
		old[p.spec.Name] = p
	}
	next := make([]*pool, 0, len(specs))
	for _, s := range specs {
		p := old[s.Name]
		delete(old, s.Name)
		switch {
		case p != nil && p.tag == s.Tag():
			p.spec = s
			p.stat.MinIdle = s.MinIdle
			m.trimLocked(p)
		default:
			q := &pool{spec: s, tag: s.Tag(), stat: Stat{Name: s.Name, Entry: s.Entry, MinIdle: s.MinIdle}}
			if p != nil {
				q.stat.Hits, q.stat.Misses, q.stat.RefillFailures = p.stat.Hits, p.stat.Misses, p.stat.RefillFailures
				m.dropLocked(p)
			}
			p = q
		}
		next = append(next, p)
	}
	for _, p := range old {
		m.dropLocked(p)
	}
	m.order = next
	for _, p := range m.order {
		m.fillLocked(p)
	}
}

// trimLocked applies a kept pool's new min_idle and max_age to its idle
// instances: the oldest past the count, and any past the age, retire.
func (m *Manager) trimLocked(p *pool) {
	for len(p.idle) > p.spec.MinIdle {
		m.retireLocked(p.idle[0], ReasonReloaded)
	}
	for _, in := range append([]*instance(nil), p.idle...) {
		m.armAgeLocked(in)
	}
}

// dropLocked retires a pool removed or replaced by a reload.
func (m *Manager) dropLocked(p *pool) {
	p.gone = true
	if p.backoff != nil {
		p.backoff.Stop()
	}
	for len(p.idle) > 0 {
		m.retireLocked(p.idle[0], ReasonReloaded)
	}
	for id, in := range m.leases {
		if in.p == p && in.adopted { // not reattached yet; a spawn's boot retires its own
			delete(m.leases, id)
			p.booting--
			m.host.Retire(id, ReasonReloaded)
		}
	}
}

// Start begins keeping the pools filled, for ctx's lifetime.
func (m *Manager) Start(ctx context.Context) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.ctx = ctx
	for _, p := range m.order {
		m.fillLocked(p)
	}
	go m.refill(ctx)
}

// refill has the pools waiting for a slot try again each time one frees.
func (m *Manager) refill(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-m.kick:
		}
		m.mu.Lock()
		for _, p := range m.order {
			p.slotless = false
			m.fillLocked(p)
		}
		m.mu.Unlock()
	}
}

// SlotFreed is the core's word that a capacity slot may be free: pools
// waiting for one try again. It takes no lock, so it may be said anywhere.
func (m *Manager) SlotFreed() {
	m.freed.Add(1)
	select {
	case m.kick <- struct{}{}:
	default: // a wake-up is already pending
	}
}

// Adopt takes back a warm lease spawnd still holds after a gateway
// restart, journaled under tag: it counts toward its pool's min_idle, and
// is handed out once its instance reattached (Booted). false: no pool in
// force has that tag (removed, or its config changed while no gateway
// ran), and the caller retires the lease.
func (m *Manager) Adopt(tag, id string, created time.Time) (name string, ok bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, p := range m.order {
		if p.tag == tag {
			m.leases[id] = &instance{id: id, p: p, created: created, adopted: true}
			p.booting++
			p.stat.Booting = p.booting
			return p.spec.Name, true
		}
	}
	return "", false
}

// Booted is an adopted lease's instance reattached: it is idle from now.
func (m *Manager) Booted(id string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	in := m.leases[id]
	if in == nil || !in.adopted || in.idle {
		return
	}
	in.p.booting--
	m.readyLocked(in)
	m.fillLocked(in.p) // in case it retired on arrival
}

// readyLocked makes a booted instance idle, unless the pool is already
// full, or a claim queues for a slot: a warm instance never holds a slot a
// queued claim waits for.
func (m *Manager) readyLocked(in *instance) {
	p := in.p
	reason := ""
	switch {
	case len(p.idle) >= p.spec.MinIdle: // adopted past a lowered min_idle
		reason = ReasonReloaded
	case m.host.Queued():
		reason = ReasonYielded
	}
	if reason != "" {
		delete(m.leases, in.id)
		m.host.Retire(in.id, reason)
		m.countLocked(p)
		return
	}
	in.idle = true
	i := len(p.idle)
	for i > 0 && p.idle[i-1].created.After(in.created) {
		i--
	}
	p.idle = append(p.idle, nil)
	copy(p.idle[i+1:], p.idle[i:])
	p.idle[i] = in
	m.armAgeLocked(in)
	m.countLocked(p)
}

// armAgeLocked (re)arms the retirement of an idle instance at max_age.
func (m *Manager) armAgeLocked(in *instance) {
	if in.age != nil {
		in.age.Stop()
	}
	d := time.Until(in.created.Add(in.p.spec.maxAge()))
	if d <= 0 {
		m.retireLocked(in, ReasonMaxAge)
		return
	}
	in.age = time.AfterFunc(d, func() {
		m.mu.Lock()
		defer m.mu.Unlock()
		if m.leases[in.id] == in && in.idle && m.live() {
			m.retireLocked(in, ReasonMaxAge)
			m.fillLocked(in.p)
		}
	})
}

// retireLocked takes an idle instance out of its pool and retires it.
func (m *Manager) retireLocked(in *instance, reason string) {
	m.unidleLocked(in)
	m.host.Retire(in.id, reason)
}

// unidleLocked takes an idle instance out of its pool's books.
func (m *Manager) unidleLocked(in *instance) {
	p := in.p
	for i, x := range p.idle {
		if x == in {
			p.idle = append(p.idle[:i], p.idle[i+1:]...)
			break
		}
	}
	in.idle = false
	if in.age != nil {
		in.age.Stop()
	}
	delete(m.leases, in.id)
	m.countLocked(p)
}

func (m *Manager) countLocked(p *pool) {
	p.stat.Idle, p.stat.Booting = len(p.idle), p.booting
}

func (m *Manager) live() bool { return m.ctx != nil && m.ctx.Err() == nil }

// fillLocked starts the spawns p lacks: one per missing instance, so at
// most min_idle in flight, none while it backs off or waits for a slot.
func (m *Manager) fillLocked(p *pool) {
	if !m.live() || p.gone || p.slotless || p.backoff != nil {
		return
	}
	for len(p.idle)+p.booting < p.spec.MinIdle {
		p.booting++
		go m.boot(p, m.freed.Load())
	}
	m.countLocked(p)
}

// boot spawns one warm instance of p. freed is the count of freed slots
// when it started: a spawn that found no slot waits for the next one to
// free, unless one freed meanwhile.
func (m *Manager) boot(p *pool, freed uint64) {
	var in *instance
	id, err := m.host.Warm(m.ctx, p.spec, p.tag, func(id string) {
		m.mu.Lock()
		defer m.mu.Unlock()
		in = &instance{id: id, p: p, created: time.Now()}
		m.leases[id] = in
	})
	m.mu.Lock()
	defer m.mu.Unlock()
	p.booting--
	if in != nil && m.leases[in.id] == in {
		delete(m.leases, in.id)
	}
	switch {
	case in != nil && in.yielded, errors.Is(err, ErrYielded):
		// Its slot is a claim's now; the pool refills once one frees.
	case errors.Is(err, ErrNoSlot):
		p.slotless = m.freed.Load() == freed
	case !m.live():
		// Shut down: a warm instance booted now is left to the next
		// gateway, which adopts it; a failure is nobody's business.
	case err != nil:
		if p.gone {
			break
		}
		p.failures++
		p.stat.RefillFailures++
		delay := min(firstBackoff<<min(p.failures-1, 20), maxBackoff)
		m.log.Warn("a warm instance of the pool failed to boot; backing off before the next spawn, claims get cold spawns meanwhile",
			"pool", p.spec.Name, "binary", p.spec.Entry, "error", err.Error(), "failures", p.failures, "retry_in", delay)
		p.backoff = time.AfterFunc(delay, func() {
			m.mu.Lock()
			defer m.mu.Unlock()
			p.backoff = nil
			m.fillLocked(p)
		})
	case p.gone:
		m.host.Retire(id, ReasonReloaded)
	default:
		p.failures = 0
		if in == nil || in.id != id {
			in = &instance{id: id, p: p, created: time.Now()}
		}
		m.leases[id] = in
		m.readyLocked(in)
	}
	m.countLocked(p)
	m.fillLocked(p)
}

// Take hands out an idle instance of the pool whose entry and config a
// claim names (byte-identical config), taking it off the books at once so
// no other claim can have it: its lease id and pool, and true; the caller
// has the pool refill (Refill) once its hand-out is done, so that the
// replacement's spawn does not compete with the claim it replaces (on a
// busy host it tripled a pooled claim's time). A claim matching a pool
// with none idle is a miss, and false; one matching no pool is false,
// uncounted.
func (m *Manager) Take(entry string, config []byte) (id, name string, ok bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, p := range m.order {
		if p.spec.Entry != entry || !bytes.Equal(p.spec.Config, config) {
			continue
		}
		if len(p.idle) == 0 {
			p.stat.Misses++
			return "", p.spec.Name, false
		}
		in := p.idle[0]
		m.unidleLocked(in)
		p.stat.Hits++
		return in.id, p.spec.Name, true
	}
	return "", "", false
}

// Refill starts the spawns the pool name lacks: after a Take's hand-out,
// recorded or refused.
func (m *Manager) Refill(name string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, p := range m.order {
		if p.spec.Name == name {
			m.fillLocked(p)
		}
	}
}

// Yield gives up a warm instance to a claim that found no free slot: the
// oldest idle one of any pool, else the oldest still booting; off the
// books, its id for the caller to end, its slot passed on. false: there is
// none. Its pool refills once a slot frees.
func (m *Manager) Yield() (id string, ok bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	var oldest *instance
	for _, p := range m.order {
		if len(p.idle) > 0 && (oldest == nil || p.idle[0].created.Before(oldest.created)) {
			oldest = p.idle[0]
		}
	}
	if oldest != nil {
		m.unidleLocked(oldest)
		return oldest.id, true
	}
	for _, in := range m.leases {
		if !in.idle && (oldest == nil || in.created.Before(oldest.created)) {
			oldest = in
		}
	}
	if oldest == nil {
		return "", false
	}
	delete(m.leases, oldest.id)
	oldest.yielded = true
	if oldest.adopted {
		oldest.p.booting--
		m.countLocked(oldest.p)
	}
	return oldest.id, true
}

// Gone is the core's word that lease id ended: a warm one leaves its
// pool's books, and the pool refills.
func (m *Manager) Gone(id string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	in := m.leases[id]
	switch {
	case in == nil:
		return
	case in.idle:
		m.unidleLocked(in)
	case in.adopted: // a spawn's boot answers for itself
		delete(m.leases, id)
		in.p.booting--
		m.countLocked(in.p)
	}
	m.fillLocked(in.p)
}

// Holding reports whether any warm instance nobody claimed holds a slot
// (idle or booting): one a claim may be handed, or take the slot of.
func (m *Manager) Holding() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.leases) > 0
}

// Stats is every pool's figures, as declared.
func (m *Manager) Stats() []Stat {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]Stat, len(m.order))
	for i, p := range m.order {
		out[i] = p.stat
	}
	return out
}
