package a2a

import (
	"net"
	"net/http"
	"sync"
	"time"
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

// Stream is one subscriber of a task.
type Stream struct {
	mu     sync.Mutex
	events []Event // published, not yet written
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
	w    http.ResponseWriter
	fl   http.Flusher
	conn net.Conn // nil when the request did not come over a socket
	// roomOf measures conn's send room (Serve's room).
	roomOf func(net.Conn) (int, bool)
	frame  func(Event) []byte
	buf    []byte
	spare  []Event
	// room is what the socket takes without blocking, as last measured
	// (roomOf) less what was written since: the queue only drains
	// meanwhile, so it never overstates.
	room int
	// pending is rendered bytes a direct writer found no room for; the
	// handler writes them first.
	pending bool
	// parked: the last state written is INPUT_REQUIRED, so the stream is
	// silent until the client answers (see keepaliveEvery).
	parked bool
}

// SubscriberBuffer is how many events a slow stream may fall behind
// before it is closed; a task has only a handful.
const SubscriberBuffer = 64

// keepaliveEvery is how often a parked stream gets keepaliveComment, as
// upstream writes it: a proxy in front of the broker reads a silent
// response as a dead one (many close after 60 s), and a question may wait
// on a human for minutes. A stream that is working is not pinged; its own
// events keep it alive.
const keepaliveEvery = 20 * time.Second

// keepaliveComment is an SSE comment line, which clients ignore.
const keepaliveComment = ": ping\n\n"

// newStream is a stream whose first event is first.
func NewStream(first Event) *Stream {
	s := &Stream{wake: make(chan struct{}, 1)}
	s.events = append(make([]Event, 0, 4), first)
	return s
}

// Push queues evs; it reports false when the stream has ended or too many
// events wait, which ends it (a stream too far behind is closed rather than
// allowed to grow without bound). A final event ends it too.
func (s *Stream) Push(evs []Event) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, ev := range evs {
		if s.ended {
			return false
		}
		if len(s.events) >= SubscriberBuffer {
			s.ended = true
			return false
		}
		s.events = append(s.events, ev)
		s.ended = ev.Final()
	}
	return !s.ended
}

// End closes the stream after what is queued.
func (s *Stream) End() {
	s.mu.Lock()
	s.ended = true
	s.mu.Unlock()
}

func (s *Stream) Signal() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// take swaps out the queued events (into spare's backing array) and
// reports whether the stream has ended.
func (s *Stream) take(spare []Event) ([]Event, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	evs := s.events
	s.events = spare[:0]
	return evs, s.ended
}

// WriteDirect writes what is queued from a publisher's goroutine, if the
// writing turn is free and the socket takes it without blocking; otherwise
// the handler is told to.
func (s *Stream) WriteDirect() {
	if !s.turn.TryLock() {
		s.Signal() // the holder may be past its last look at the queue
		return
	}
	defer s.turn.Unlock()
	o := s.out
	if o == nil || o.conn == nil || o.pending {
		s.Signal()
		return
	}
	evs, ended := s.take(o.spare)
	o.render(evs)
	if ended {
		// The handler writes the last event with the response's end, in
		// one write.
		o.pending = true
		s.Signal()
		return
	}
	if len(o.buf) == 0 {
		return
	}
	if len(o.buf)+chunkOverhead > o.room {
		o.room, _ = o.roomOf(o.conn)
		if len(o.buf)+chunkOverhead > o.room {
			o.pending = true
			s.Signal()
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
func (o *sseOut) render(evs []Event) {
	for i, ev := range evs {
		o.buf = append(o.buf, "data: "...)
		o.buf = append(o.buf, o.frame(ev)...)
		o.buf = append(o.buf, '\n', '\n')
		switch {
		case ev.StatusUpdate != nil:
			o.parked = ev.StatusUpdate.Status.State == StateInputRequired
		case ev.Task != nil:
			o.parked = ev.Task.Status.State == StateInputRequired
		}
		evs[i] = Event{}
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

// Serve is the handler's side: it writes the stream until it ends or the
// client goes away. The last event is left unflushed so that it leaves with
// the response's end in one write.
// conn is the connection the request came over (nil: none), and room says
// what its send buffer takes now without blocking.
func (s *Stream) Serve(w http.ResponseWriter, r *http.Request, frame func(Event) []byte, conn net.Conn, room func(net.Conn) (int, bool)) {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no")
	// Not flushed on its own: every stream opens on the task's snapshot,
	// already queued, so the headers go out with it in one write.
	w.WriteHeader(http.StatusOK)
	fl, _ := w.(http.Flusher)
	o := &sseOut{w: w, fl: fl, conn: conn, roomOf: room, frame: frame}
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
		o.room, _ = o.roomOf(conn)
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
func (s *Stream) writeQueued(o *sseOut, ping bool) (ended, ok bool) {
	evs, ended := s.take(o.spare)
	o.render(evs)
	if ping && o.parked && !ended {
		o.buf = append(o.buf, keepaliveComment...)
	}
	return ended, len(o.buf) == 0 || o.flush(!ended)
}
