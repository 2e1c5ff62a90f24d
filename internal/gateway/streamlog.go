package gateway

import (
	"encoding/json"
	"sync"

	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// sendWindow is how many undelivered frames are kept for the attached client
// even when client_replay_buffer_bytes would evict them. It is the
// equivalent of upstream's 256-frame per-connection send queue, and it is what
// lets client_replay_buffer_bytes: 0 mean "retain nothing for replay" without
// also meaning "drop every frame a live client has not been written yet".
const sendWindow = 256

// streamLog is a lease's client-bound stream: every frame gets the next seq
// and is kept, encoded, until the byte bound evicts it. A client connection
// is a cursor into it, so a slow reader is handed the frames it has not seen
// rather than a hole, and a reconnect with ?from_seq= replays from the same
// store. One log per lease, for the lease's lifetime; a restored lease starts
// a new one at seq 1.
type streamLog struct {
	leaseID string
	bound   int64

	mu      sync.Mutex
	entries []logEntry // oldest first; entries[i].seq == first+i
	first   uint64     // seq of entries[0] (== next when empty)
	next    uint64     // seq the next frame gets
	bytes   int64
	// pin is the attached client's cursor; frames after it are kept up to
	// sendWindow even past the byte bound.
	pin *cursor
	// wake is closed by the next append; made only when a reader waits
	// (readBatch found nothing), so an append nobody waits on allocates
	// no channel.
	wake chan struct{}
}

// cursor is one client connection's position: the last seq written to it.
// Guarded by the log's mutex.
type cursor struct{ seq uint64 }

type logEntry struct {
	seq  uint64
	data []byte
}

func newStreamLog(leaseID string, bound int64) *streamLog {
	return &streamLog{leaseID: leaseID, bound: bound, first: 1, next: 1}
}

// append sequences f, stores it and wakes readers. It returns the number of
// frames evicted before the attached client had been written them (frames
// that client has now lost).
func (s *streamLog) append(f brokerframe.Frame) (lostByClient int, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f.Seq = s.next
	f.LeaseID = s.leaseID
	data, err := brokerframe.Encode(f)
	if err != nil {
		return 0, err
	}
	s.next++
	s.entries = append(s.entries, logEntry{seq: f.Seq, data: data})
	s.bytes += int64(len(data))
	lostByClient = s.trimLocked()
	if s.wake != nil {
		close(s.wake)
		s.wake = nil
	}
	return lostByClient, nil
}

// trimLocked evicts the oldest frames while the log is over its bound,
// except those pinned for the attached client. It runs whenever that can
// change: an append, the cursor advancing, the client detaching.
func (s *streamLog) trimLocked() (lostByClient int) {
	for s.bytes > s.bound && len(s.entries) > 0 {
		oldest := s.entries[0]
		if s.pin != nil && oldest.seq > s.pin.seq {
			// Every retained frame is undelivered to the attached client.
			if len(s.entries) <= sendWindow {
				break // pinned: within the client's send window
			}
			lostByClient++
		}
		s.bytes -= int64(len(oldest.data))
		s.entries[0] = logEntry{}
		s.entries = s.entries[1:]
		s.first++
	}
	if len(s.entries) == 0 {
		s.entries = nil // let the backing array go
	}
	return lostByClient
}

// lastSeq is the seq of the newest frame (0 before any).
func (s *streamLog) lastSeq() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.next - 1
}

// attach pins a new client's cursor and works out where it starts. fromSeq
// < 0 means live only. When the client asked for frames the log no longer
// holds it also returns the gap notice it must be sent first.
func (s *streamLog) attach(fromSeq int64) (*cursor, *brokerframe.StreamGap) {
	s.mu.Lock()
	defer s.mu.Unlock()
	last := s.next - 1
	c := &cursor{}
	var gap *brokerframe.StreamGap
	switch {
	case fromSeq < 0:
		c.seq = last
	case uint64(fromSeq) > last:
		// The client's position belongs to a stream this lease no longer has
		// (a restored lease renumbers from 1): replay all that is held.
		gap = &brokerframe.StreamGap{Reason: brokerframe.GapRestarted, RequestedFromSeq: uint64(fromSeq)}
		c.seq = s.first - 1
	case uint64(fromSeq)+1 < s.first:
		gap = &brokerframe.StreamGap{Reason: brokerframe.GapEvicted, RequestedFromSeq: uint64(fromSeq),
			MissingFromSeq: uint64(fromSeq) + 1, MissingThroughSeq: s.first - 1}
		c.seq = s.first - 1
	default:
		c.seq = uint64(fromSeq)
	}
	s.pin = c
	return c, gap
}

// detach unpins c when its connection goes away; a displaced client never
// unpins its successor's cursor.
func (s *streamLog) detach(c *cursor) {
	s.mu.Lock()
	if s.pin == c {
		s.pin = nil
		s.trimLocked()
	}
	s.mu.Unlock()
}

// readBatch appends to buf up to max frames after c. When frames right after
// c were evicted it reports the missing range instead (missFrom > 0) and
// moves c past it. With nothing to read and wait set it returns the
// channel the next append closes.
func (s *streamLog) readBatch(c *cursor, buf []logEntry, max int, wait bool) (out []logEntry, missFrom, missThrough uint64, wake <-chan struct{}) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if c.seq+1 < s.first {
		missFrom, missThrough = c.seq+1, s.first-1
		c.seq = missThrough
		return buf, missFrom, missThrough, nil
	}
	for i := int(c.seq + 1 - s.first); i < len(s.entries) && len(buf) < max; i++ {
		buf = append(buf, s.entries[i])
	}
	if len(buf) == 0 && wait {
		if s.wake == nil {
			s.wake = make(chan struct{})
		}
		return buf, 0, 0, s.wake
	}
	return buf, 0, 0, nil
}

// hasAfter reports whether frames after c are waiting.
func (s *streamLog) hasAfter(c *cursor) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return c.seq+1 < s.next
}

// advance records that c's connection has been written through seq.
func (s *streamLog) advance(c *cursor, seq uint64) {
	s.mu.Lock()
	c.seq = seq
	if s.pin == c {
		s.trimLocked()
	}
	s.mu.Unlock()
}

// retainedBytes is what the log holds now (for tests and benchmarks).
func (s *streamLog) retainedBytes() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.bytes
}

// gapFrame encodes a stream-gap notice for leaseID. It carries no seq: it
// describes one connection, not the lease's stream.
func gapFrame(leaseID string, g *brokerframe.StreamGap) []byte {
	payload, _ := json.Marshal(g) // a struct of strings and integers cannot fail
	data, _ := brokerframe.Encode(brokerframe.Frame{LeaseID: leaseID, Signal: brokerframe.SignalStreamGap, Payload: payload})
	return data
}

// evictedGap is the notice, counted, that frames missFrom..missThrough were
// evicted before a resuming client was written them.
func (g *Gateway) evictedGap(leaseID string, missFrom, missThrough uint64) []byte {
	g.m.replayGaps.inc(brokerframe.GapEvicted)
	return gapFrame(leaseID, &brokerframe.StreamGap{Reason: brokerframe.GapEvicted,
		RequestedFromSeq: missFrom - 1, MissingFromSeq: missFrom, MissingThroughSeq: missThrough})
}
