package gateway

import (
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/a2a"
	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/wire"
)

// A task's SSE stream. Events are queued by whoever publishes them (under
// the ingress lock) and written to the response by whichever goroutine
// holds the stream's writing turn: the handler serving the request, or,
// for a change the instance reported, the instance's read pump itself once
// the ingress lock is released. The read pump writes only what the socket
// takes without blocking and leaves the rest to the handler, so a slow
// client never stalls its instance; it saves the event the hop to the
// handler goroutine, which on a busy host is a scheduling delay between the
// instance's answer and the client.

// sseStream is one subscriber of a task.
type sseStream struct {
	mu     sync.Mutex
	events []a2a.Event // published, not yet written
	// ended: nothing more will be queued (a final event, a stream too far
	// behind, or the subscriber left).
	ended bool
	// wake tells the handler there is work: events it must write, or the
	// end. Buffered by one: a signal is never lost, never blocks.
	wake chan struct{}

	// turn is held while writing to the response. A publisher only tries
	// it; the handler waits for it, and detaches the response under it
	// when it leaves, so nothing writes after the handler returned.
	turn sync.Mutex
	out  *sseOut // under turn; nil until the handler attaches, and after
}

// sseOut is the response a stream is written to, touched only under turn.
type sseOut struct {
	w     http.ResponseWriter
	fl    http.Flusher
	conn  net.Conn // nil when the request did not come over a socket
	frame func(a2a.Event) []byte
	buf   []byte
	spare []a2a.Event
	// room is what the socket takes without blocking, as last measured
	// (wire.SendRoom) less what was written since: the queue only drains
	// meanwhile, so it never overstates.
	room int
	// pending is rendered bytes a direct writer found no room for; the
	// handler writes them first.
	pending bool
	// parked: the last state written is INPUT_REQUIRED, so the stream is
	// silent until the client answers (see keepaliveEvery).
	parked bool
}

// keepaliveEvery is how often a parked stream gets keepaliveComment, as
// upstream writes it: a proxy in front of the broker reads a silent
// response as a dead one (many close after 60 s), and a question may wait
// on a human for minutes. A stream that is working is not pinged; its own
// events keep it alive.
const keepaliveEvery = 20 * time.Second

// keepaliveComment is an SSE comment line, which clients ignore.
const keepaliveComment = ": ping\n\n"

// newStream is a stream whose first event is first.
func newStream(first a2a.Event) *sseStream {
	s := &sseStream{wake: make(chan struct{}, 1)}
	s.events = append(make([]a2a.Event, 0, 4), first)
	return s
}

// push queues evs; it reports false when the stream has ended or too many
// events wait, which ends it (a stream too far behind is closed rather than
// allowed to grow without bound). A final event ends it too.
func (s *sseStream) push(evs []a2a.Event) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, ev := range evs {
		if s.ended {
			return false
		}
		if len(s.events) >= subscriberBuffer {
			s.ended = true
			return false
		}
		s.events = append(s.events, ev)
		s.ended = ev.Final()
	}
	return !s.ended
}

// end closes the stream after what is queued.
func (s *sseStream) end() {
	s.mu.Lock()
	s.ended = true
	s.mu.Unlock()
}

func (s *sseStream) signal() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// take swaps out the queued events (into spare's backing array) and
// reports whether the stream has ended.
func (s *sseStream) take(spare []a2a.Event) ([]a2a.Event, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	evs := s.events
	s.events = spare[:0]
	return evs, s.ended
}

// writeDirect writes what is queued from a publisher's goroutine, if the
// writing turn is free and the socket takes it without blocking; otherwise
// the handler is told to.
func (s *sseStream) writeDirect() {
	if !s.turn.TryLock() {
		s.signal() // the holder may be past its last look at the queue
		return
	}
	defer s.turn.Unlock()
	o := s.out
	if o == nil || o.conn == nil || o.pending {
		s.signal()
		return
	}
	evs, ended := s.take(o.spare)
	o.render(evs)
	if ended {
		// The handler writes the last event with the response's end, in
		// one write.
		o.pending = true
		s.signal()
		return
	}
	if len(o.buf) == 0 {
		return
	}
	if len(o.buf)+chunkOverhead > o.room {
		o.room, _ = wire.SendRoom(o.conn)
		if len(o.buf)+chunkOverhead > o.room {
			o.pending = true
			s.signal()
			return
		}
	}
	o.flush(true)
}

// chunkOverhead is what chunked encoding adds to one write: the size line
// and the trailing CRLF.
const chunkOverhead = 16

// render appends evs' data lines to buf, notes whether the last state
// left the stream parked, and recycles the slice.
func (o *sseOut) render(evs []a2a.Event) {
	for i, ev := range evs {
		o.buf = append(o.buf, "data: "...)
		o.buf = append(o.buf, o.frame(ev)...)
		o.buf = append(o.buf, '\n', '\n')
		switch {
		case ev.StatusUpdate != nil:
			o.parked = ev.StatusUpdate.Status.State == a2a.StateInputRequired
		case ev.Task != nil:
			o.parked = ev.Task.Status.State == a2a.StateInputRequired
		}
		evs[i] = a2a.Event{}
	}
	o.spare = evs[:0]
}

// flush writes buf, spending room; with push the response is flushed to
// the socket. It reports false when the client is gone.
func (o *sseOut) flush(push bool) bool {
	o.room -= len(o.buf) + chunkOverhead
	_, err := o.w.Write(o.buf)
	o.buf, o.pending = o.buf[:0], false
	if err != nil {
		return false
	}
	if push && o.fl != nil {
		o.fl.Flush()
	}
	return true
}

// serve is the handler's side: it writes the stream until it ends or the
// client goes away. The last event is left unflushed so that it leaves with
// the response's end in one write.
func (s *sseStream) serve(w http.ResponseWriter, r *http.Request, frame func(a2a.Event) []byte) {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no")
	// Not flushed on its own: every stream opens on the task's snapshot,
	// already queued, so the headers go out with it in one write.
	w.WriteHeader(http.StatusOK)
	fl, _ := w.(http.Flusher)
	conn, _ := wire.ConnOf(r.Context())
	o := &sseOut{w: w, fl: fl, conn: conn, frame: frame}
	s.turn.Lock()
	s.out = o
	defer func() {
		s.turn.Lock()
		s.out = nil
		s.turn.Unlock()
	}()
	ended, ok := s.writeQueued(o, false)
	if conn != nil {
		// Measured here, after the snapshot left and while the instance
		// works, so that a direct write usually spends budget rather
		// than asking the kernel.
		o.room, _ = wire.SendRoom(conn)
	}
	s.turn.Unlock()
	if ended || !ok {
		return
	}
	// One ticker per open stream, running whether or not it is parked
	// (as upstream's does): a tick only looks at the state the last
	// event left, so events pay nothing for it.
	keepalive := time.NewTicker(keepaliveEvery)
	defer keepalive.Stop()
	for !ended && ok {
		ping := false
		select {
		case <-s.wake:
		case <-keepalive.C:
			ping = true
		case <-r.Context().Done():
			return
		}
		s.turn.Lock()
		ended, ok = s.writeQueued(o, ping)
		s.turn.Unlock()
	}
}

// writeQueued writes what is queued, under turn, and with ping the
// keepalive comment if that leaves the stream parked. The last event of an
// ended stream is not flushed. ok is false when the client is gone.
func (s *sseStream) writeQueued(o *sseOut, ping bool) (ended, ok bool) {
	evs, ended := s.take(o.spare)
	o.render(evs)
	if ping && o.parked && !ended {
		o.buf = append(o.buf, keepaliveComment...)
	}
	return ended, len(o.buf) == 0 || o.flush(!ended)
}
