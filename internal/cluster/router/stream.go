package router

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"net/http"
	"sync"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/cluster"
)

// An A2A stream (SendStreamingMessage, SubscribeToTask and their HTTP+JSON
// routes) about a conversation another broker holds is answered there and
// carried back event by event: the owner runs the request into a buffer,
// and the entry broker reads it as it fills. A read waits at most
// cluster.ReadWait for bytes (woken by the handler's writes, never
// polled), then answers "pending"; each read takes what it answers. An
// owner that hears no read for relayIdle ends the stream (the entry
// broker, or its client, is gone).

const (
	opStreamOpen  = "sopen"
	opStreamRead  = "sread"
	opStreamClose = "sclose"
)

type streamCall struct {
	Stream string `json:"stream"`
}

type streamAnswer struct {
	// Status and Header come with the first answer after the handler
	// wrote its header.
	Status int         `json:"status,omitempty"`
	Header http.Header `json:"header,omitempty"`
	Data   []byte      `json:"data,omitempty"`
	// Done: the handler returned and everything it wrote has been read.
	Done bool `json:"done,omitempty"`
}

// carriedStream is the owner's side of one carried stream: an
// http.ResponseWriter whose bytes wait for the entry broker's reads.
type carriedStream struct {
	id     string
	header http.Header // the handler's, until it writes its header
	cancel context.CancelFunc
	idle   *time.Timer

	mu         sync.Mutex
	status     int
	sent       http.Header // the header as written
	headerRead bool
	data       []byte
	done       bool
	wake       chan struct{} // closed (and replaced) on every write and at the end
}

func (s *carriedStream) Header() http.Header { return s.header }

func (s *carriedStream) WriteHeader(status int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.status == 0 {
		s.status, s.sent = status, s.header.Clone()
		s.wakeLocked()
	}
}

func (s *carriedStream) Write(p []byte) (int, error) {
	s.WriteHeader(http.StatusOK)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.data = append(s.data, p...)
	s.wakeLocked()
	return len(p), nil
}

// Flush is a no-op: every write is readable at once.
func (s *carriedStream) Flush() {}

func (s *carriedStream) finish() {
	s.WriteHeader(http.StatusOK)
	s.mu.Lock()
	s.done = true
	s.wakeLocked()
	s.mu.Unlock()
}

func (s *carriedStream) wakeLocked() {
	close(s.wake)
	s.wake = make(chan struct{})
}

// openStream starts a carried stream request through this broker's own
// routes, as its principal, and names it for the reads.
func (rt *Router) openStream(_ context.Context, from string, body json.RawMessage) (any, error) {
	req, err := carriedRequest(rt.core.Context(), from, body)
	if err != nil {
		return nil, err
	}
	mux := rt.core.CarriedHandler()
	if mux == nil {
		return nil, errors.New("not serving yet")
	}
	var b [16]byte
	_, _ = rand.Read(b[:])
	ctx, cancel := context.WithCancel(req.Context())
	s := &carriedStream{id: hex.EncodeToString(b[:]), header: http.Header{}, cancel: cancel, wake: make(chan struct{})}
	s.idle = time.AfterFunc(relayIdle, func() { rt.endStream(s) })
	rt.mu.Lock()
	rt.streams[s.id] = s
	rt.mu.Unlock()
	go func() {
		mux.ServeHTTP(s, req.WithContext(ctx))
		s.finish()
	}()
	return streamCall{Stream: s.id}, nil
}

// endStream stops a carried stream's handler and forgets it.
func (rt *Router) endStream(s *carriedStream) {
	s.idle.Stop()
	s.cancel()
	rt.mu.Lock()
	delete(rt.streams, s.id)
	rt.mu.Unlock()
}

func (rt *Router) streamFor(body json.RawMessage) (*carriedStream, error) {
	var c streamCall
	if err := json.Unmarshal(body, &c); err != nil {
		return nil, err
	}
	rt.mu.Lock()
	s := rt.streams[c.Stream]
	rt.mu.Unlock()
	if s == nil {
		return nil, errors.New("no such stream")
	}
	return s, nil
}

// readStream answers what the handler wrote since the last read, waiting
// at most cluster.ReadWait for something.
func (rt *Router) readStream(ctx context.Context, _ string, body json.RawMessage) (any, error) {
	s, err := rt.streamFor(body)
	if err != nil {
		return nil, err
	}
	s.idle.Reset(relayIdle)
	budget := rt.relayBudget() * 3 / 4 // base64 in the JSON
	wait := time.NewTimer(cluster.ReadWait)
	defer wait.Stop()
	for {
		s.mu.Lock()
		var a streamAnswer
		if s.status != 0 && !s.headerRead {
			a.Status, a.Header, s.headerRead = s.status, s.sent, true
		}
		n := min(len(s.data), budget)
		a.Data = s.data[:n:n]
		s.data = s.data[n:]
		a.Done = s.done && len(s.data) == 0
		wake := s.wake
		s.mu.Unlock()
		if a.Done {
			rt.endStream(s)
		}
		if a.Status != 0 || len(a.Data) > 0 || a.Done || !woken(ctx, wait, wake, nil) {
			return a, nil
		}
	}
}

// woken waits for a relayed read's wake (or other) until the read's wait
// or ctx ends; false when that ended it, and the read answers what it has.
func woken(ctx context.Context, wait *time.Timer, wake, other <-chan struct{}) bool {
	select {
	case <-wake:
	case <-other:
	case <-wait.C:
		return false
	case <-ctx.Done():
		return false
	}
	return true
}

func (rt *Router) closeStream(_ context.Context, _ string, body json.RawMessage) (any, error) {
	if s, err := rt.streamFor(body); err == nil {
		rt.endStream(s)
	}
	return struct{}{}, nil
}

// carryStream is the entry broker's side: the owner's stream copied to
// the client as it comes, until it ends, the client leaves, or the owner
// stops answering (then the client's stream just ends: a client that
// reads no final event knows it was cut).
func (rt *Router) carryStream(w http.ResponseWriter, r *http.Request, owner string, call httpCall, refuse func(http.ResponseWriter)) {
	var open streamCall
	if err := rt.node.Call(r.Context(), owner, opStreamOpen, call, &open); err != nil {
		rt.log.Warn("cluster: the conversation's broker did not answer", "owner", owner, "error", err)
		refuse(w)
		return
	}
	fl, _ := w.(http.Flusher)
	wrote, done := false, false
	defer func() {
		if !done { // tell the owner at once rather than after relayIdle
			ctx, cancel := context.WithTimeout(rt.core.Context(), cluster.CallTimeout)
			_ = rt.node.Call(ctx, owner, opStreamClose, open, nil)
			cancel()
		}
	}()
	for {
		var a streamAnswer
		if err := rt.node.Call(r.Context(), owner, opStreamRead, open, &a); err != nil {
			if r.Context().Err() == nil {
				rt.log.Warn("cluster: a carried A2A stream broke off", "owner", owner, "error", err)
			}
			if !wrote {
				refuse(w)
			}
			return
		}
		if a.Status != 0 {
			for k, v := range a.Header {
				w.Header()[k] = v
			}
			w.WriteHeader(a.Status)
			wrote = true
		}
		if len(a.Data) > 0 {
			if _, err := w.Write(a.Data); err != nil {
				return
			}
			if fl != nil {
				fl.Flush()
			}
		}
		if done = a.Done; done {
			return
		}
	}
}
