package echo

import (
	"context"
	"encoding/json"
	"log/slog"
	"sync"

	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// outboxLimit bounds the encoded bytes waiting for the socket while the link
// is down, as upstream's plugin does: enough to ride out a broker restart at
// the 5 s backoff cap without letting a dead link pin unbounded memory.
const outboxLimit = 1 << 20

// outbox holds encoded frames for the broker, oldest first. Every frame the
// instance produces goes through it, connected or not, so frames produced
// while the link is down are written in order right after the next handshake
// and no frame can overtake another.
//
// While the link is up nothing is ever evicted: a broker slow to read makes
// the producers that can wait (turns, echoes) wait in waitRoom, and the few
// frames that cannot wait (a status, a cancel's answer) queue past the limit.
// Only while the link is down does the limit evict the oldest frames, and the
// next handshake logs how many it cost.
type outbox struct {
	mu        sync.Mutex
	frames    [][]byte
	size      int // sum of len over frames
	limit     int
	connected bool            // a link is up: push never evicts
	dropped   int             // frames evicted while disconnected, since the last connect
	writing   bool            // a batch is out with the writer
	waiters   []chan struct{} // closed once nothing is queued or being written

	// ready wakes the writer. Capacity 1 and a non-blocking send: a producer
	// never waits and a wakeup is never lost.
	ready chan struct{}
}

func newOutbox(limit int) *outbox {
	return &outbox{limit: limit, ready: make(chan struct{}, 1)}
}

// push queues b. While disconnected it then evicts the oldest frames while
// the total exceeds the limit; the newest frame always stays, even alone
// over the limit, so a large frame still goes out once the link is back.
func (o *outbox) push(b []byte) {
	o.mu.Lock()
	o.frames = append(o.frames, b)
	o.size += len(b)
	if !o.connected {
		o.evictLocked()
	}
	o.mu.Unlock()
	wake(o.ready)
}

func (o *outbox) evictLocked() {
	for o.size > o.limit && len(o.frames) > 1 {
		o.size -= len(o.frames[0])
		o.frames[0] = nil
		o.frames = o.frames[1:]
		o.dropped++
	}
}

// connect marks the link up and returns how many frames were evicted while
// it was down.
func (o *outbox) connect() (dropped int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.connected = true
	dropped, o.dropped = o.dropped, 0
	return dropped
}

// disconnect marks the link down: from now on the limit evicts, starting
// with whatever a slow broker left queued past it.
func (o *outbox) disconnect() {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.connected = false
	o.evictLocked()
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
