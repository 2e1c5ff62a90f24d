package spawnd

import (
	"sync"

	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// watchBuffer is how many exits one Watch stream may fall behind before it
// is dropped: far more than a slow gateway lags, and a bound, since a
// supervisor must never block on a stream nobody reads.
const watchBuffer = 4096

// watchers fans every exit out to the Watch streams open at the time.
type watchers struct {
	mu   sync.Mutex
	subs map[*subscriber]struct{}
}

type subscriber struct {
	events chan *spawnpb.ExitEvent
	// dropped is closed when the subscriber overflowed and was removed.
	dropped chan struct{}
}

func (w *watchers) subscribe() *subscriber {
	s := &subscriber{events: make(chan *spawnpb.ExitEvent, watchBuffer), dropped: make(chan struct{})}
	w.mu.Lock()
	w.subs[s] = struct{}{}
	w.mu.Unlock()
	return s
}

func (w *watchers) unsubscribe(s *subscriber) {
	w.mu.Lock()
	delete(w.subs, s)
	w.mu.Unlock()
}

// publish hands ev to every subscriber without ever blocking; a subscriber
// whose buffer is full is dropped instead.
func (w *watchers) publish(ev *spawnpb.ExitEvent) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for s := range w.subs {
		select {
		case s.events <- ev:
		default:
			delete(w.subs, s)
			close(s.dropped)
		}
	}
}

// count is how many Watch streams are open: one per attached gateway.
func (w *watchers) count() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.subs)
}
