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

	"github.com/gorilla/websocket"

	"github.com/nexus-broker/nexus-broker/internal/auth"
	"github.com/nexus-broker/nexus-broker/internal/cluster"
	"github.com/nexus-broker/nexus-broker/internal/gateway"
)

// The owner's side of the relay: the client connections other brokers carry
// to leases here, attached to the lease's stream through the core's Attach
// and read and written through cluster ops.

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
	Last  uint64            `json:"last,omitempty"`
	Close *gateway.CloseReq `json:"close,omitempty"`
}

// relayConn is a client connection another broker carries: its cursor in
// the lease's stream lives here, with the owner (att), and the entry
// broker reads through it. It is the core's Client: told when to close,
// it answers the close to the entry broker's next read.
type relayConn struct {
	id  string
	att *gateway.Attachment
	// idle drops the connection when its entry broker stops reading.
	idle *time.Timer

	mu       sync.Mutex
	closing  *gateway.CloseReq
	flushBy  time.Time
	closed   chan struct{} // closed once closing is set
	detached bool
}

func (c *relayConn) Finish(code int, reason string) { c.close(code, reason, gateway.FinishFlush) }
func (c *relayConn) Displace()                      { c.close(gateway.CodeSuperseded, gateway.CloseSuperseded, 0) }
func (c *relayConn) GoAway()                        { c.close(websocket.CloseGoingAway, gateway.CloseRestarting, 0) }

func (c *relayConn) close(code int, reason string, flush time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closing == nil {
		c.closing = &gateway.CloseReq{Code: code, Reason: reason}
		c.flushBy = time.Now().Add(flush)
		close(c.closed)
	}
}

func (rt *Router) relayAttach(_ context.Context, from string, body json.RawMessage) (any, error) {
	var a attachCall
	if err := json.Unmarshal(body, &a); err != nil {
		return nil, err
	}
	r := gateway.Forwarded(http.MethodGet, "/lease/"+a.Lease, from)
	p, credential := a.Principal, gateway.CredentialBearer
	switch {
	case !rt.core.AuthEnabled():
		credential = gateway.CredentialAnonymous
	case a.Ticket != "":
		var ok bool
		if p, ok = rt.core.RedeemTicket(r, a.Ticket, a.Lease); !ok {
			return attachAnswer{Status: http.StatusUnauthorized, Error: auth.TextRejected}, nil
		}
		credential = gateway.CredentialTicket
	}
	var b [16]byte
	_, _ = rand.Read(b[:])
	c := &relayConn{id: hex.EncodeToString(b[:]), closed: make(chan struct{})}
	c.att = rt.core.Attach(r, a.Lease, p, a.FromSeq, c, credential+" via broker "+from)
	if c.att == nil {
		return attachAnswer{Status: http.StatusNotFound, Error: gateway.TextUnknownLease}, nil
	}
	c.idle = time.AfterFunc(relayIdle, func() { rt.endRelay(c) })
	rt.mu.Lock()
	rt.relays[c.id] = c
	rt.mu.Unlock()
	return attachAnswer{Status: http.StatusOK, Conn: c.id, After: c.att.Seq()}, nil
}

// endRelay detaches a relayed connection once.
func (rt *Router) endRelay(c *relayConn) {
	c.mu.Lock()
	done := c.detached
	c.detached = true
	c.idle.Stop()
	c.mu.Unlock()
	if done {
		return
	}
	rt.mu.Lock()
	delete(rt.relays, c.id)
	rt.mu.Unlock()
	c.att.Detach()
}

func (rt *Router) relayFor(body json.RawMessage) (*relayConn, relayCall, error) {
	var rc relayCall
	if err := json.Unmarshal(body, &rc); err != nil {
		return nil, rc, err
	}
	rt.mu.Lock()
	c := rt.relays[rc.Conn]
	rt.mu.Unlock()
	if c == nil || c.att.Lease().ID() != rc.Lease {
		return nil, rc, errors.New("no such relayed connection")
	}
	c.idle.Reset(relayIdle)
	return c, rc, nil
}

// relayRead answers the frames after the client's cursor, waiting at most
// cluster.ReadWait for one (event-driven: the stream log wakes it), then
// "pending" (an empty answer). A close is answered once the stream is
// flushed, or at once when the connection was displaced.
func (rt *Router) relayRead(ctx context.Context, _ string, body json.RawMessage) (any, error) {
	c, rc, err := rt.relayFor(body)
	if err != nil {
		return relayAnswer{Close: leaseGone()}, nil
	}
	att := c.att
	budget := rt.relayBudget()
	wait := time.NewTimer(cluster.ReadWait)
	defer wait.Stop()
	att.Advance(rc.After)
	var out relayAnswer
	size := 0
	if f := att.Gap(); f != nil {
		out.Frames, size = append(out.Frames, f), len(f)
	}
	buf := make([]gateway.Frame, 0, 64)
	for {
		batch, evicted, through, wake := att.Read(buf[:0], cap(buf))
		if through > 0 {
			if evicted != nil {
				out.Frames, size = append(out.Frames, evicted), size+len(evicted)
			}
			out.Last = through
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
		if closing != nil && (!att.Pending() || time.Now().After(flushBy)) {
			out.Close = closing
			rt.endRelay(c)
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
func (rt *Router) relaySend(_ context.Context, _ string, body json.RawMessage) (any, error) {
	c, rc, err := rt.relayFor(body)
	if err != nil {
		return relayAnswer{Close: leaseGone()}, nil
	}
	c.mu.Lock()
	closing := c.closing
	c.mu.Unlock()
	if closing != nil {
		return relayAnswer{Close: closing}, nil
	}
	if !c.att.Send(rc.Msgs) {
		// A frame the instance may not be written: the client is closed
		// at once with the refusal (Send had the lease Finish it).
		c.mu.Lock()
		c.flushBy = time.Now()
		closing = c.closing
		c.mu.Unlock()
		return relayAnswer{Close: closing}, nil
	}
	return relayAnswer{}, nil
}

func (rt *Router) relayDetach(_ context.Context, _ string, body json.RawMessage) (any, error) {
	if c, _, err := rt.relayFor(body); err == nil {
		rt.endRelay(c)
	}
	return relayAnswer{}, nil
}

// leaseGone is the close of a connection this broker no longer carries.
func leaseGone() *gateway.CloseReq {
	c := gateway.LeaseGone
	return &c
}
