package echo

import (
	"context"
	"encoding/json"
	"sync"
)

// echoLimit bounds the payloads waiting to be echoed. Past it the read loop
// waits too, so the broker's own writes back up (TCP backpressure): that
// takes a broker sending more than this ahead of what it reads back, and
// waiting is the one answer that loses nothing.
const echoLimit = outboxLimit

// echoes sends payloads back verbatim, in arrival order, each waiting for
// room in the outbox as a turn's deltas do. It runs on its own goroutine so
// that the read loop, which queues them, goes on reading: a shutdown, a
// cancel or a ping behind an echo is never held up by a broker slow to read.
type echoes struct {
	send *sender
	done <-chan struct{} // the instance is stopping: add waits no more

	mu    sync.Mutex
	queue []json.RawMessage
	size  int           // sum of len over queue
	more  chan struct{} // capacity 1: queue grew
	less  chan struct{} // capacity 1: queue shrank
}

func newEchoes(send *sender, done <-chan struct{}) *echoes {
	return &echoes{send: send, done: done, more: make(chan struct{}, 1), less: make(chan struct{}, 1)}
}

// add queues p for echoing. It waits only while echoLimit bytes already
// wait (a payload alone over the limit is taken when nothing else waits).
func (e *echoes) add(p json.RawMessage) {
	for {
		e.mu.Lock()
		if e.size == 0 || e.size+len(p) <= echoLimit {
			e.queue = append(e.queue, p)
			e.size += len(p)
			e.mu.Unlock()
			wake(e.more)
			return
		}
		e.mu.Unlock()
		select {
		case <-e.done:
			return
		case <-e.less:
		}
	}
}

// run echoes what add queues until ctx ends.
func (e *echoes) run(ctx context.Context) {
	for {
		e.mu.Lock()
		if len(e.queue) == 0 {
			e.mu.Unlock()
			select {
			case <-ctx.Done():
				return
			case <-e.more:
				continue
			}
		}
		p := e.queue[0]
		e.queue[0] = nil // the backing array outlives this payload
		e.queue = e.queue[1:]
		e.mu.Unlock()
		if e.send.out.waitRoom(ctx) != nil {
			return
		}
		e.send.raw(p)
		e.mu.Lock()
		e.size -= len(p)
		e.mu.Unlock()
		wake(e.less)
	}
}

// wake signals a capacity-1 channel without ever blocking.
func wake(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}
