package pool

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// call is one Warm the fake host is asked for, answered by the test.
type call struct {
	id    string
	spec  Spec
	tag   string
	reply chan error
}

type retirement struct{ id, reason string }

// fakeHost hands every Warm to the test and records every Retire.
type fakeHost struct {
	n       atomic.Int64
	calls   chan call
	retired chan retirement
	queued  atomic.Bool
}

func newHost() *fakeHost {
	return &fakeHost{calls: make(chan call, 64), retired: make(chan retirement, 64)}
}

func (h *fakeHost) Warm(ctx context.Context, s Spec, tag string, started func(string)) (string, error) {
	c := call{id: fmt.Sprintf("%s-%d", s.Name, h.n.Add(1)), spec: s, tag: tag, reply: make(chan error, 1)}
	started(c.id)
	h.calls <- c
	select {
	case err := <-c.reply:
		return c.id, err
	case <-ctx.Done():
		return "", ctx.Err()
	}
}

func (h *fakeHost) Retire(id, reason string) { h.retired <- retirement{id, reason} }
func (h *fakeHost) Queued() bool             { return h.queued.Load() }

const within = 10 * time.Second

func (h *fakeHost) next(t *testing.T) call {
	t.Helper()
	select {
	case c := <-h.calls:
		return c
	case <-time.After(within):
		t.Fatal("no Warm was asked for")
	}
	return call{}
}

func (h *fakeHost) noCall(t *testing.T) {
	t.Helper()
	select {
	case c := <-h.calls:
		t.Fatalf("an unexpected Warm of %s", c.id)
	default:
	}
}

func (h *fakeHost) retirement(t *testing.T) retirement {
	t.Helper()
	select {
	case r := <-h.retired:
		return r
	case <-time.After(within):
		t.Fatal("nothing was retired")
	}
	return retirement{}
}

// syncBuffer is a log the manager writes from its goroutines.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func start(t *testing.T, h *fakeHost, specs ...Spec) (*Manager, *syncBuffer) {
	t.Helper()
	var log syncBuffer
	m := New(h, slog.New(slog.NewTextHandler(&log, nil)))
	m.Set(specs)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	m.Start(ctx)
	return m, &log
}

// waitStat waits until pool name's figures satisfy ok.
func waitStat(t *testing.T, m *Manager, name string, ok func(Stat) bool) Stat {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		for _, s := range m.Stats() {
			if s.Name == name && ok(s) {
				return s
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("pool %s never got there: %+v", name, m.Stats())
		}
		time.Sleep(time.Millisecond) // polling the manager's books, with a deadline
	}
}

var spec = Spec{Name: "default", Entry: "nexus", Config: []byte("model: x\n"), MinIdle: 2}

// fill answers n Warms and waits for them to be idle.
func fill(t *testing.T, h *fakeHost, m *Manager, name string, n int) []string {
	t.Helper()
	ids := make([]string, n)
	for i := range ids {
		c := h.next(t)
		ids[i] = c.id
		c.reply <- nil
	}
	waitStat(t, m, name, func(s Stat) bool { return s.Idle == n })
	return ids
}

// TestTakeHandsEachInstanceOnceAndRefills: concurrent claims matching a
// pool of two get two distinct instances and the rest are misses; each
// one taken is replaced at once, and a claim with another config or entry
// is no business of the pool's.
func TestTakeHandsEachInstanceOnceAndRefills(t *testing.T) {
	h := newHost()
	m, _ := start(t, h, spec)
	ids := fill(t, h, m, "default", 2)

	var mu sync.Mutex
	got := map[string]int{}
	var wg sync.WaitGroup
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if id, name, ok := m.Take("nexus", []byte("model: x\n")); ok {
				if name != "default" {
					t.Errorf("handed out from pool %q", name)
				}
				mu.Lock()
				got[id]++
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if len(got) != 2 || got[ids[0]] != 1 || got[ids[1]] != 1 {
		t.Fatalf("handed out %v, want each of %v once", got, ids)
	}
	// No replacement boots beside the hand-outs: only once they are done.
	if s := m.Stats()[0]; s.Booting != 0 || s.Idle != 0 {
		t.Fatalf("before Refill the pool is %+v, want nothing booting", s)
	}
	h.noCall(t)
	m.Refill("default")
	s := waitStat(t, m, "default", func(s Stat) bool { return s.Booting == 2 })
	if s.Hits != 2 || s.Misses != 14 {
		t.Fatalf("hits %d misses %d, want 2 and 14", s.Hits, s.Misses)
	}
	// Refilled: two spawns, never more than min_idle in flight.
	fill(t, h, m, "default", 2)
	h.noCall(t)

	for _, c := range []struct{ entry, config string }{{"nexus", "model: x"}, {"other", "model: x\n"}} {
		if _, name, ok := m.Take(c.entry, []byte(c.config)); ok || name != "" {
			t.Errorf("a claim of %q with config %q matched pool %q", c.entry, c.config, name)
		}
	}
}

// TestBootFailuresBackOff: a pool whose instances fail to boot waits
// 100ms, then 200ms, ... before the next spawn, says why with its name,
// counts each failure, and starts over once one boots.
func TestBootFailuresBackOff(t *testing.T) {
	h := newHost()
	s := spec
	s.MinIdle = 1
	m, log := start(t, h, s)
	for i, want := range []string{"100ms", "200ms", "400ms"} {
		h.next(t).reply <- errors.New("instance exited before signalling ready")
		st := waitStat(t, m, "default", func(st Stat) bool { return st.RefillFailures == uint64(i+1) })
		if st.Idle != 0 {
			t.Fatalf("a failed boot left %d idle", st.Idle)
		}
		re := regexp.MustCompile(`failed to boot.*pool=default .*error="instance exited before signalling ready".*retry_in=` + want)
		deadline := time.Now().Add(within)
		for !re.MatchString(log.String()) {
			if time.Now().After(deadline) {
				t.Fatalf("no backoff of %s logged:\n%s", want, log)
			}
			time.Sleep(time.Millisecond) // polling the log, with a deadline
		}
	}
	h.next(t).reply <- nil
	waitStat(t, m, "default", func(st Stat) bool { return st.Idle == 1 })
	m.mu.Lock()
	failures := m.order[0].failures
	m.mu.Unlock()
	if failures != 0 {
		t.Fatalf("%d failures in a row kept after a boot", failures)
	}
}

// TestMaxAgeRecycles: an instance nobody claimed within max_age is
// retired and replaced.
func TestMaxAgeRecycles(t *testing.T) {
	h := newHost()
	s := spec
	s.MinIdle, s.MaxAge = 1, 50*time.Millisecond
	m, _ := start(t, h, s)
	ids := fill(t, h, m, "default", 1)
	if r := h.retirement(t); r.id != ids[0] || r.reason != ReasonMaxAge {
		t.Fatalf("retired %+v, want %s for max_age", r, ids[0])
	}
	if c := h.next(t); c.id == ids[0] {
		t.Fatal("no replacement")
	}
}

// TestReloadRetiresAChangedPool: a reload that changes a pool's config
// retires its idle instances and spawns the new config's under a new tag;
// one that changes only min_idle keeps them; one that removes it retires
// them.
func TestReloadRetiresAChangedPool(t *testing.T) {
	h := newHost()
	m, _ := start(t, h, spec)
	old := fill(t, h, m, "default", 2)

	kept := spec
	kept.MinIdle = 1
	m.Set([]Spec{kept})
	first := h.retirement(t)
	if (first.id != old[0] && first.id != old[1]) || first.reason != ReasonReloaded {
		t.Fatalf("lowering min_idle retired %+v, want one of %v", first, old)
	}
	left := old[0]
	if first.id == old[0] {
		left = old[1]
	}
	h.noCall(t)

	changed := kept
	changed.Config = []byte("model: y\n")
	m.Set([]Spec{changed})
	if r := h.retirement(t); r.id != left || r.reason != ReasonReloaded {
		t.Fatalf("changing the config retired %+v, want %s", r, left)
	}
	c := h.next(t)
	if string(c.spec.Config) != "model: y\n" || c.tag == spec.Tag() || c.tag != changed.Tag() {
		t.Fatalf("spawned %q under tag %s after the change", c.spec.Config, c.tag)
	}
	c.reply <- nil
	s := waitStat(t, m, "default", func(s Stat) bool { return s.Idle == 1 })
	if s.Hits != 0 {
		t.Fatal("figures lost")
	}
	if _, _, ok := m.Take("nexus", []byte("model: x\n")); ok {
		t.Fatal("the old config was served after the reload")
	}
	if _, name, ok := m.Take("nexus", []byte("model: y\n")); !ok {
		t.Fatal("the new config was not served")
	} else {
		m.Refill(name)
	}
	h.next(t) // its refill
	m.Set(nil)
	if len(m.Stats()) != 0 {
		t.Fatal("a removed pool is still listed")
	}
}

// TestAdoptedLeasesCountAndServe: warm leases a restarted gateway found
// are the pool's once their instances reattach (no spawn for them), a tag
// no pool has is refused, and one that reattaches while a claim queues
// gives its slot up.
func TestAdoptedLeasesCountAndServe(t *testing.T) {
	h := newHost()
	var log syncBuffer
	m := New(h, slog.New(slog.NewTextHandler(&log, nil)))
	m.Set([]Spec{spec})
	if _, ok := m.Adopt(spec.Name+":0000", "stale", time.Now()); ok {
		t.Fatal("a lease of another config was adopted")
	}
	for _, id := range []string{"a", "b"} {
		if name, ok := m.Adopt(spec.Tag(), id, time.Now()); !ok || name != "default" {
			t.Fatalf("adopting %s: %q %v", id, name, ok)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	m.Start(ctx)
	h.noCall(t)
	if _, _, ok := m.Take("nexus", spec.Config); ok {
		t.Fatal("handed out before its instance reattached")
	}
	m.Booted("a")
	h.queued.Store(true)
	m.Booted("b")
	if r := h.retirement(t); r.id != "b" || r.reason != ReasonYielded {
		t.Fatalf("retired %+v, want b yielded to the queue", r)
	}
	h.queued.Store(false)
	if id, _, ok := m.Take("nexus", spec.Config); !ok || id != "a" {
		t.Fatalf("took %q %v, want a", id, ok)
	}
}

// TestYieldAndSlots: a claim with no free slot gets the oldest idle
// instance of any pool; a spawn that found no slot waits for one to free.
func TestYieldAndSlots(t *testing.T) {
	h := newHost()
	other := Spec{Name: "other", Entry: "nexus", Config: []byte("model: z\n"), MinIdle: 1}
	m, _ := start(t, h, spec, other)
	for range 3 {
		if c := h.next(t); c.spec.Name == "other" {
			c.reply <- nil
		} else {
			c.reply <- ErrNoSlot
		}
	}
	waitStat(t, m, "other", func(s Stat) bool { return s.Idle == 1 })
	waitStat(t, m, "default", func(s Stat) bool { return s.Booting == 0 })
	h.noCall(t)
	if !m.Holding() {
		t.Fatal("an idle instance is not holding a slot")
	}
	id, ok := m.Yield()
	if !ok || id != "other-"+id[len("other-"):] {
		t.Fatalf("yielded %q %v, want other's instance", id, ok)
	}
	if _, ok := m.Yield(); ok || m.Holding() {
		t.Fatal("yielded twice, or holding with nothing left")
	}
	m.Gone(id)
	m.SlotFreed()
	for range 3 {
		h.next(t).reply <- nil
	}
	waitStat(t, m, "default", func(s Stat) bool { return s.Idle == 2 })
	waitStat(t, m, "other", func(s Stat) bool { return s.Idle == 1 })
}

// TestTagFitsAndTellsConfigsApart: a tag is at most the 64 bytes spawnd
// carries, whatever the name's length, and differs with the config.
func TestTagFitsAndTellsConfigsApart(t *testing.T) {
	long := spec
	long.Name = string(bytes.Repeat([]byte("p"), 64))
	if n := len(long.Tag()); n > 64 {
		t.Fatalf("a tag of %d bytes", n)
	}
	other := spec
	other.Config = []byte("model: y\n")
	again := spec
	again.Config = append([]byte(nil), spec.Config...)
	if spec.Tag() == other.Tag() || spec.Tag() != again.Tag() {
		t.Fatal("tags do not follow the config")
	}
}

// TestYieldEndsABootingInstance: with none idle, a claim with no free slot
// gets the oldest instance still booting; its boot then ends, and that is
// no failure of the pool's.
func TestYieldEndsABootingInstance(t *testing.T) {
	h := newHost()
	s := spec
	s.MinIdle = 1
	m, _ := start(t, h, s)
	c := h.next(t)
	id, ok := m.Yield()
	if !ok || id != c.id {
		t.Fatalf("yielded %q %v, want the booting %s", id, ok, c.id)
	}
	if _, ok := m.Yield(); ok {
		t.Fatal("yielded twice")
	}
	c.reply <- ErrYielded
	st := waitStat(t, m, "default", func(st Stat) bool { return st.Booting == 1 })
	if st.RefillFailures != 0 || st.Idle != 0 {
		t.Fatalf("after a yielded boot: %+v", st)
	}
	m.mu.Lock()
	backoff := m.order[0].backoff
	m.mu.Unlock()
	if backoff != nil {
		t.Fatal("a yielded boot backed the pool off")
	}
	h.next(t).reply <- nil // its replacement
	waitStat(t, m, "default", func(st Stat) bool { return st.Idle == 1 })
}
