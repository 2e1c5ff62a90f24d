package gateway

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"net/http"
	"sync"
	"time"

	"github.com/gorilla/websocket"

	"github.com/nexus-broker/nexus-broker/internal/auth"
	"github.com/nexus-broker/nexus-broker/internal/cluster"
	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/streamlog"
	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/wire"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// The owner's side of the relay: the client connections other brokers carry
// to leases here, read and written through cluster ops.

type attachCall struct {
	leaseCall
	// Ticket, when set, is the credential: redeemed here, where it was minted.
	Ticket  string `json:"ticket,omitempty"`
	FromSeq int64  `json:"from_seq"`
}

type attachAnswer struct {
	Status int    `json:"status"`
	Error  string `json:"error,omitempty"`
	Conn   string `json:"conn,omitempty"`
	// After is the seq the first read continues from.
	After uint64 `json:"after"`
}

type relayCall struct {
	Lease string `json:"lease"`
	Conn  string `json:"conn"`
	// After (read) is the last seq the client was written.
	After uint64 `json:"after,omitempty"`
	// Msgs (send) are whole client messages, in order.
	Msgs [][]byte `json:"msgs,omitempty"`
}

type relayAnswer struct {
	Frames []json.RawMessage `json:"frames,omitempty"`
	// Last is the seq of the last frame in Frames.
	Last  uint64    `json:"last,omitempty"`
	Close *closeReq `json:"close,omitempty"`
}

// relayConn is a client connection another broker carries: its cursor in
// the lease's stream lives here, with the owner, and the entry broker reads
// through it.
type relayConn struct {
	id      string
	l       *lease
	resumed bool

	mu       sync.Mutex
	cur      *streamlog.Cursor
	gap      *brokerframe.StreamGap
	closing  *closeReq
	flushBy  time.Time
	closed   chan struct{} // closed once closing is set
	idle     *time.Timer
	detached bool
}

func (c *relayConn) place(cur *streamlog.Cursor, gap *brokerframe.StreamGap) { c.cur, c.gap = cur, gap }

// notify and flushHeld need nothing: a pending read waits on the stream
// log itself, and the answer carries what it read.
func (c *relayConn) notify(bool) {}
func (c *relayConn) flushHeld()  {}

func (c *relayConn) finish(code int, reason string) { c.close(code, reason, finishFlush) }
func (c *relayConn) displace()                      { c.close(wire.CodeSuperseded, wire.CloseSuperseded, 0) }
func (c *relayConn) goAway()                        { c.close(websocket.CloseGoingAway, wire.CloseRestarting, 0) }

func (c *relayConn) close(code int, reason string, flush time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closing == nil {
		c.closing = &closeReq{Code: code, Reason: reason}
		c.flushBy = time.Now().Add(flush)
		close(c.closed)
	}
}

func (g *Gateway) relayAttach(_ context.Context, from string, body json.RawMessage) (any, error) {
	var a attachCall
	if err := json.Unmarshal(body, &a); err != nil {
		return nil, err
	}
	path := "/lease/" + a.Lease
	p, credential := a.Principal, credentialBearer
	switch {
	case !g.auth.Enabled():
		credential = credentialAnonymous
	case a.Ticket != "":
		var ok bool
		if p, ok = g.tickets.Redeem(a.Ticket, a.Lease); !ok {
			g.denied(forwarded(http.MethodGet, path, from), p.ID, http.StatusUnauthorized, auth.TextRejected, ticketDenial)
			return attachAnswer{Status: http.StatusUnauthorized, Error: auth.TextRejected}, nil
		}
		credential = credentialTicket
	}
	l := g.owned(forwarded(http.MethodGet, path, from), a.Lease, p)
	if l == nil {
		return attachAnswer{Status: http.StatusNotFound, Error: errUnknownLease}, nil
	}
	var b [16]byte
	_, _ = rand.Read(b[:])
	c := &relayConn{id: hex.EncodeToString(b[:]), l: l, resumed: a.FromSeq >= 0, closed: make(chan struct{})}
	if !g.attachClient(l, c, 0, a.FromSeq, p.ID, credential+" via broker "+from) {
		return attachAnswer{Status: http.StatusNotFound, Error: errUnknownLease}, nil
	}
	c.idle = time.AfterFunc(relayIdle, func() { g.endRelay(c) })
	g.mu.Lock()
	g.rt.relays[c.id] = c
	g.mu.Unlock()
	return attachAnswer{Status: http.StatusOK, Conn: c.id, After: c.cur.Seq()}, nil
}

// endRelay detaches a relayed connection once.
func (g *Gateway) endRelay(c *relayConn) {
	c.mu.Lock()
	done := c.detached
	c.detached = true
	c.idle.Stop()
	c.mu.Unlock()
	if done {
		return
	}
	g.mu.Lock()
	delete(g.rt.relays, c.id)
	g.mu.Unlock()
	g.detachClient(c.l, c, c.cur)
}

func (g *Gateway) relayFor(body json.RawMessage) (*relayConn, relayCall, error) {
	var rc relayCall
	if err := json.Unmarshal(body, &rc); err != nil {
		return nil, rc, err
	}
	g.mu.Lock()
	c := g.rt.relays[rc.Conn]
	g.mu.Unlock()
	if c == nil || c.l.id != rc.Lease {
		return nil, rc, errors.New("no such relayed connection")
	}
	c.idle.Reset(relayIdle)
	return c, rc, nil
}

// relayRead answers the frames after the client's cursor, waiting at most
// cluster.ReadWait for one (event-driven: the stream log wakes it), then
// "pending" (an empty answer). A close is answered once the stream is
// flushed, or at once when the connection was displaced.
func (g *Gateway) relayRead(ctx context.Context, _ string, body json.RawMessage) (any, error) {
	c, rc, err := g.relayFor(body)
	if err != nil {
		return relayAnswer{Close: &closeReq{Code: websocket.CloseGoingAway, Reason: wire.CloseLeaseClosed}}, nil
	}
	l := c.l
	budget := g.relayBudget()
	wait := time.NewTimer(cluster.ReadWait)
	defer wait.Stop()
	l.log.Advance(c.cur, rc.After)
	var out relayAnswer
	size := 0
	c.mu.Lock()
	if gap := c.gap; gap != nil {
		c.gap = nil
		g.m.replayGaps.inc(gap.Reason)
		f := streamlog.GapFrame(l.id, gap)
		out.Frames, size = append(out.Frames, f), len(f)
	}
	c.mu.Unlock()
	buf := make([]streamlog.Entry, 0, 64)
	for {
		batch, missFrom, missThrough, wake := l.log.ReadBatch(c.cur, buf[:0], cap(buf), true)
		if missFrom > 0 {
			if c.resumed {
				f := g.evictedGap(l.id, missFrom, missThrough)
				out.Frames, size = append(out.Frames, f), size+len(f)
			}
			out.Last = missThrough
			continue
		}
		for _, e := range batch {
			if size+len(e.Data) > budget && len(out.Frames) > 0 {
				return out, nil
			}
			out.Frames, size, out.Last = append(out.Frames, e.Data), size+len(e.Data), e.Seq
		}
		if len(out.Frames) > 0 {
			return out, nil
		}
		c.mu.Lock()
		closing, flushBy := c.closing, c.flushBy
		c.mu.Unlock()
		if closing != nil && (!l.log.HasAfter(c.cur) || time.Now().After(flushBy)) {
			out.Close = closing
			g.endRelay(c)
			return out, nil
		}
		closed := c.closed
		if closing != nil {
			closed = nil // flushing: wait for frames, not the close again
		}
		if !woken(ctx, wait, wake, closed) {
			return out, nil
		}
	}
}

// relaySend delivers client messages to the instance, in order. The entry
// broker sends the next request only after this answer, which keeps the
// client's frames in order and its socket under backpressure.
func (g *Gateway) relaySend(_ context.Context, _ string, body json.RawMessage) (any, error) {
	c, rc, err := g.relayFor(body)
	if err != nil {
		return relayAnswer{Close: &closeReq{Code: websocket.CloseGoingAway, Reason: wire.CloseLeaseClosed}}, nil
	}
	c.mu.Lock()
	closing := c.closing
	c.mu.Unlock()
	if closing != nil {
		return relayAnswer{Close: closing}, nil
	}
	var held *instanceConn
	var refused *closeReq
	for _, m := range rc.Msgs {
		var ic *instanceConn
		if ic, refused = c.l.fromClient(m, true); ic != nil {
			held = ic
		}
		if refused != nil {
			c.close(refused.Code, refused.Reason, 0)
			break
		}
	}
	if held != nil {
		c.l.flushInstance(held)
	}
	return relayAnswer{Close: refused}, nil
}

func (g *Gateway) relayDetach(_ context.Context, _ string, body json.RawMessage) (any, error) {
	if c, _, err := g.relayFor(body); err == nil {
		g.endRelay(c)
	}
	return relayAnswer{}, nil
}

// --- the entry broker's side ----------------------------------------------------

// relayClient serves WS /lease/{id} for a lease another broker owns: the
// credential is checked there (a ticket is redeemed where it was minted),
// and the socket is relayed through NATS.
