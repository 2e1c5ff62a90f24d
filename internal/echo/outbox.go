package echo

import (
	"context"
	"encoding/json"
	"log/slog"
	"sync"

	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// outboxLimit bounds the encoded bytes waiting for the socket, as upstream's
// plugin does: enough to ride out a broker restart at the 5 s backoff cap
// without letting a dead link pin unbounded memory.
const outboxLimit = 1 << 20

// outbox holds encoded frames for the broker, oldest first. Every frame the
// instance produces goes through it, connected or not, so frames produced
// while the link is down are written in order right after the next handshake
// and no frame can overtake another.
type outbox struct {
	mu      sync.Mutex
	frames  [][]byte
	size    int // sum of len over frames
	limit   int
	dropped int             // frames evicted since the last takeDropped
	writing bool            // a batch is out with the writer
	waiters []chan struct{} // closed once nothing is queued or being written

	// ready wakes the writer. Capacity 1 and a non-blocking send: a producer
	// never waits and a wakeup is never lost.
	ready chan struct{}
}

func newOutbox(limit int) *outbox {
	return &outbox{limit: limit, ready: make(chan struct{}, 1)}
}

// push queues b, evicting the oldest frames while the total exceeds the limit.
// The newest frame always stays, even alone over the limit: a large frame on a
// live link must still go out.
func (o *outbox) push(b []byte) {
	o.mu.Lock()
	o.frames = append(o.frames, b)
	o.size += len(b)
	for o.size > o.limit && len(o.frames) > 1 {
		o.size -= len(o.frames[0])
		o.frames[0] = nil
		o.frames = o.frames[1:]
		o.dropped++
	}
	o.mu.Unlock()
	select {
	case o.ready <- struct{}{}:
	default:
	}
}

// take moves every queued frame to dst (reused across calls, so a busy link
// allocates no batch slices) and marks the batch as being written. The caller
// must call finish.
func (o *outbox) take(dst [][]byte) [][]byte {
	o.mu.Lock()
	defer o.mu.Unlock()
	dst = append(dst, o.frames...)
	clear(o.frames)
	o.frames = o.frames[:0]
	o.size = 0
	o.writing = true
	return dst
}

// finish ends the batch from take. unsent are the frames the socket did not
// accept; they go back to the front, in order, for the next connection.
func (o *outbox) finish(unsent [][]byte) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.writing = false
	if len(unsent) > 0 {
		o.frames = append(append([][]byte(nil), unsent...), o.frames...)
		for _, b := range unsent {
			o.size += len(b)
		}
	}
	if len(o.frames) == 0 {
		for _, w := range o.waiters {
			close(w)
		}
		o.waiters = nil
	}
}

// flushed returns a channel closed once every frame queued so far has been
// handed to the socket.
func (o *outbox) flushed() <-chan struct{} {
	o.mu.Lock()
	defer o.mu.Unlock()
	ch := make(chan struct{})
	if len(o.frames) == 0 && !o.writing {
		close(ch)
		return ch
	}
	o.waiters = append(o.waiters, ch)
	return ch
}

// waitRoom is for a producer that can wait: while more than half the limit
// is queued it waits for the queue to drain (or ctx), rather than make the
// outbox evict the producer's own earlier frames.
func (o *outbox) waitRoom(ctx context.Context) error {
	o.mu.Lock()
	congested := o.size > o.limit/2
	o.mu.Unlock()
	if !congested {
		return nil
	}
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-o.flushed():
		return nil
	}
}

// takeDropped returns how many frames were evicted since the last call.
func (o *outbox) takeDropped() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	n := o.dropped
	o.dropped = 0
	return n
}

// sender turns IO payloads into io frames on the outbox.
type sender struct {
	leaseID string
	out     *outbox
	log     *slog.Logger
}

// raw sends payload as it is. Encode re-validates and compacts it, which is
// the identity on a payload the broker itself encoded.
func (s *sender) raw(payload json.RawMessage) {
	b, err := brokerframe.Encode(brokerframe.Frame{LeaseID: s.leaseID, Signal: brokerframe.SignalIO, Payload: payload})
	if err != nil {
		s.log.Error("encoding an io frame", "error", err)
		return
	}
	s.out.push(b)
}

// io sends one structured payload.
func (s *sender) io(m brokerframe.IO) {
	p, err := json.Marshal(m)
	if err != nil {
		s.log.Error("encoding an io payload", "type", m.Type, "error", err)
		return
	}
	s.raw(p)
}
