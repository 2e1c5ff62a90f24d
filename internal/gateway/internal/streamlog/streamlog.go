// Package streamlog is a lease's client-bound stream in the lease core:
// every frame sequenced and kept, encoded, up to the replay bound, and the
// cursors client connections read it through. It is internal to the lease
// core (internal/gateway): no other layer can import it.
//
// It imports only pkg/brokerframe.
package streamlog

import (
	"encoding/json"
	"sync"

	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// SendWindow is how many undelivered frames are kept for the attached client
// even when client_replay_buffer_bytes would evict them. It is the
// equivalent of upstream's 256-frame per-connection send queue, and it is what
// lets client_replay_buffer_bytes: 0 mean "retain nothing for replay" without
// also meaning "drop every frame a live client has not been written yet".
const SendWindow = 256

// Log is a lease's client-bound stream: every frame gets the next seq
// and is kept, encoded, until the byte bound evicts it. A client connection
// is a cursor into it, so a slow reader is handed the frames it has not seen
// rather than a hole, and a reconnect with ?from_seq= replays from the same
// store. One log per lease, for the lease's lifetime; a restored lease starts
// a new one at seq 1.
type Log struct {
	leaseID string
	bound   int64

	mu      sync.Mutex
	entries []Entry // oldest first; entries[i].Seq == first+i
	first   uint64  // seq of entries[0] (== next when empty)
	next    uint64  // seq the next frame gets
	bytes   int64
	// pin is the attached client's cursor; frames after it are kept up to
	// SendWindow even past the byte bound.
	pin *Cursor
	// wake is closed by the next append; made only when a reader waits
	// (readBatch found nothing), so an append nobody waits on allocates
	// no channel.
	wake chan struct{}
}

// Cursor is one client connection's position: the last seq written to it.
// Guarded by the log's mutex.
type Cursor struct{ seq uint64 }

// Seq is the last seq written through c.
func (c *Cursor) Seq() uint64 { return c.seq }

// Entry is one sequenced frame, encoded.
type Entry struct {
	Seq  uint64
	Data []byte
}

// New is the log of lease leaseID, keeping up to bound bytes for replay.
func New(leaseID string, bound int64) *Log {
	return &Log{leaseID: leaseID, bound: bound, first: 1, next: 1}
}

// Append sequences f, stores it and wakes readers. It returns the number of
// frames evicted before the attached client had been written them (frames
// that client has now lost).
func (s *Log) Append(f brokerframe.Frame) (lostByClient int, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f.Seq = s.next
	f.LeaseID = s.leaseID
	data, err := brokerframe.Encode(f)
	if err != nil {
		return 0, err
	}
	s.next++
	s.entries = append(s.entries, Entry{Seq: f.Seq, Data: data})
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
func (s *Log) trimLocked() (lostByClient int) {
	for s.bytes > s.bound && len(s.entries) > 0 {
		oldest := s.entries[0]
		if s.pin != nil && oldest.Seq > s.pin.seq {
			// Every retained frame is undelivered to the attached client.
			if len(s.entries) <= SendWindow {
				break // pinned: within the client's send window
			}
			lostByClient++
		}
		s.bytes -= int64(len(oldest.Data))
		s.entries[0] = Entry{}
		s.entries = s.entries[1:]
		s.first++
	}
	if len(s.entries) == 0 {
		s.entries = nil // let the backing array go
	}
	return lostByClient
}

// LastSeq is the seq of the newest frame (0 before any).
func (s *Log) LastSeq() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.next - 1
}

// Attach pins a new client's cursor and works out where it starts. fromSeq
// < 0 means live only. When the client asked for frames the log no longer
// holds it also returns the gap notice it must be sent first.
func (s *Log) Attach(fromSeq int64) (*Cursor, *brokerframe.StreamGap) {
	s.mu.Lock()
	defer s.mu.Unlock()
	last := s.next - 1
	c := &Cursor{}
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

// Detach unpins c when its connection goes away; a displaced client never
// unpins its successor's cursor.
func (s *Log) Detach(c *Cursor) {
	s.mu.Lock()
	if s.pin == c {
		s.pin = nil
		s.trimLocked()
	}
	s.mu.Unlock()
}

// ReadBatch appends to buf up to max frames after c. When frames right after
// c were evicted it reports the missing range instead (missFrom > 0) and
// moves c past it. With nothing to read and wait set it returns the
// channel the next append closes.
func (s *Log) ReadBatch(c *Cursor, buf []Entry, max int, wait bool) (out []Entry, missFrom, missThrough uint64, wake <-chan struct{}) {
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

// HasAfter reports whether frames after c are waiting.
func (s *Log) HasAfter(c *Cursor) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return c.seq+1 < s.next
}

// Advance records that c's connection has been written through seq.
func (s *Log) Advance(c *Cursor, seq uint64) {
	s.mu.Lock()
	c.seq = seq
	if s.pin == c {
		s.trimLocked()
	}
	s.mu.Unlock()
}

// RetainedBytes is what the log holds now (for tests and benchmarks).
func (s *Log) RetainedBytes() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.bytes
}

// GapFrame encodes a stream-gap notice for leaseID. It carries no seq: it
// describes one connection, not the lease's stream.
func GapFrame(leaseID string, g *brokerframe.StreamGap) []byte {
	payload, _ := json.Marshal(g) // a struct of strings and integers cannot fail
	data, _ := brokerframe.Encode(brokerframe.Frame{LeaseID: leaseID, Signal: brokerframe.SignalStreamGap, Payload: payload})
	return data
}
