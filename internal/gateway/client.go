package gateway

import (
	"encoding/json"
	"net/http"
	"strconv"
	"time"

	"github.com/gorilla/websocket"

	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// finishFlush bounds how long a closing client connection may take to be
// written what its lease produced before the close.
const finishFlush = 2 * time.Second

// clientConn is one client socket of a lease: a cursor into the lease's
// stream plus a reader feeding the instance.
type clientConn struct {
	l         *lease
	ws        *wsConn
	principal string
	cur       *cursor
	// resumed: the client connected with ?from_seq=, so it is told about
	// evicted ranges in-band with stream-gap rather than by a seq jump alone.
	resumed bool
	closeCh chan closeReq
}

type closeReq struct {
	code   int
	reason string
}

// finish closes the connection after writing it everything the lease
// produced, bounded by finishFlush.
func (c *clientConn) finish(code int, reason string) {
	select {
	case c.closeCh <- closeReq{code, reason}:
	default:
	}
}

// handleClient is WS /lease/{lease_id}. Ownership is checked before the
// upgrade, and a lease that is not yours is the same 404 as none at all.
func (g *Gateway) handleClient(w http.ResponseWriter, r *http.Request) {
	principal := anonymous
	l := g.lookupOwned(r.PathValue("lease_id"), principal)
	if l == nil || l.currentState() == stateDraining {
		writeError(w, http.StatusNotFound, errUnknownLease)
		return
	}
	fromSeq := int64(-1) // absent or unparsable: live only
	if v := r.URL.Query().Get("from_seq"); v != "" {
		if n, err := strconv.ParseUint(v, 10, 63); err == nil {
			fromSeq = int64(n)
		}
	}
	conn, err := upgrader.Upgrade(w, r, nil)
	if err != nil {
		return
	}
	// As for instances: return, so net/http can drop its per-connection
	// state, and serve the socket on its own goroutine.
	go g.serveClient(l, conn, principal, fromSeq)
}

// serveClient runs one client socket of l until it ends.
func (g *Gateway) serveClient(l *lease, conn *websocket.Conn, principal string, fromSeq int64) {
	c := &clientConn{l: l, ws: newWSConn(conn, g.log, "client", l.id), principal: principal, resumed: fromSeq >= 0, closeCh: make(chan closeReq, 1)}

	l.mu.Lock()
	if l.state == stateDraining {
		l.mu.Unlock()
		c.ws.closeGraceful(websocket.CloseGoingAway, closeLeaseClosed)
		return
	}
	var gap *brokerframe.StreamGap
	c.cur, gap = l.log.attach(fromSeq)
	startSeq, lastSeq := c.cur.seq, l.log.lastSeq()
	old := l.client
	l.client = c
	l.mu.Unlock()
	g.log.Info("client connected", "lease_id", l.id, "principal_id", principal, "credential", "anonymous", "evicted_previous_client", old != nil)
	if old != nil {
		// The newest connection wins: a half-open socket must not lock its
		// owner out of the reconnect the ticket flow exists for.
		old.ws.closeNow(codeSuperseded, closeSuperseded)
		g.m.clientEvictions.Add(1)
		g.log.Warn("this connection displaced the lease's previous client, which has been "+
			"closed. A client must not keep two connections open to one lease — they will "+
			"evict each other",
			"lease_id", l.id, "principal_id", principal, "credential", "anonymous",
			"reason", closeSuperseded, "close_status", codeSuperseded)
	}
	switch {
	case gap != nil:
		g.log.Warn("a resuming client could not be fully replayed; it has been told which "+
			"frames are gone. Raise client_replay_buffer_bytes if this is routine rather than "+
			"the tail of a long disconnection",
			"lease_id", l.id, "reason", gap.Reason, "requested_from_seq", gap.RequestedFromSeq,
			"missing_from_seq", gap.MissingFromSeq, "missing_through_seq", gap.MissingThroughSeq,
			"replayed_frames", lastSeq-startSeq, "last_seq", lastSeq)
	case fromSeq >= 0 && lastSeq > startSeq:
		g.log.Info("replaying buffered frames to a resuming client", "lease_id", l.id, "frames", lastSeq-startSeq, "last_seq", lastSeq)
	}

	go c.writePump(gap)
	c.readPump()

	l.log.detach(c.cur)
	l.mu.Lock()
	if l.client == c {
		l.client = nil
	}
	l.mu.Unlock()
	c.ws.finish()
	g.log.Info("client disconnected", "lease_id", l.id)
}

// writePump writes the lease's stream from the cursor on: replayed frames
// first, then live ones, in seq order, never skipping a frame the log still
// holds.
func (c *clientConn) writePump(gap *brokerframe.StreamGap) {
	l, g := c.l, c.l.g
	if gap != nil {
		g.m.replayGaps.inc(gap.Reason)
		if c.ws.write(gapFrame(l.id, gap)) != nil {
			return
		}
	}
	buf := make([]logEntry, 0, 64)
	var flushBy <-chan time.Time
	var closing *closeReq
	for {
		batch, missFrom, missThrough, wake := l.log.readBatch(c.cur, buf[:0], cap(buf))
		if missFrom > 0 {
			// This reader fell more than client_replay_buffer_bytes behind.
			if c.resumed {
				g.m.replayGaps.inc(brokerframe.GapEvicted)
				if c.ws.write(gapFrame(l.id, &brokerframe.StreamGap{Reason: brokerframe.GapEvicted,
					RequestedFromSeq: missFrom - 1, MissingFromSeq: missFrom, MissingThroughSeq: missThrough})) != nil {
					return
				}
			}
			continue
		}
		for _, e := range batch {
			if c.ws.write(e.data) != nil {
				return
			}
		}
		if len(batch) > 0 {
			l.log.advance(c.cur, batch[len(batch)-1].seq)
			continue
		}
		if closing != nil {
			c.ws.closeGraceful(closing.code, closing.reason)
			return
		}
		select {
		case <-wake:
		case req := <-c.closeCh:
			closing = &req
			flushBy = time.After(finishFlush)
		case <-flushBy:
			c.ws.closeNow(closing.code, closing.reason)
			return
		case <-c.ws.done:
			return
		}
	}
}

// readPump forwards the client's io frames to the instance.
func (c *clientConn) readPump() {
	l, g := c.l, c.l.g
	for {
		data, err := c.ws.read()
		if err != nil {
			return
		}
		f, ok := c.decode(data)
		if !ok {
			continue
		}
		out, err := brokerframe.Encode(f)
		if err != nil {
			g.m.framesDropped.inc("undecodable")
			continue
		}
		l.clientInput()
		l.sendToInstance(out)
	}
}

// decode turns one client message into an io frame for the instance, or
// drops it and counts why. Only io travels client → instance: a client's
// shutdown or register is not the client's to send.
func (c *clientConn) decode(data []byte) (brokerframe.Frame, bool) {
	g := c.l.g
	f, err := brokerframe.Decode(data)
	if err != nil {
		// A bare IO payload ({"type":"input",…}) is what the spec's own
		// browser sketch sends; wrap it rather than drop it.
		var bare struct {
			Type string `json:"type"`
		}
		if json.Unmarshal(data, &bare) != nil || bare.Type == "" {
			g.m.framesDropped.inc("undecodable")
			return f, false
		}
		return brokerframe.Frame{LeaseID: c.l.id, Signal: brokerframe.SignalIO, Payload: data}, true
	}
	switch {
	case f.LeaseID != "" && f.LeaseID != c.l.id:
		g.m.framesDropped.inc("lease_mismatch")
		return f, false
	case f.Signal != brokerframe.SignalIO:
		g.m.framesDropped.inc("client_control")
		return f, false
	}
	return brokerframe.Frame{LeaseID: c.l.id, Signal: brokerframe.SignalIO, Payload: f.Payload}, true
}
