package gateway

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/gorilla/websocket"

	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/streamlog"
	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/wire"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// finishFlush bounds how long a closing client connection may take to be
// written what its lease produced before the close.
const finishFlush = 2 * time.Second

// clientConn is one client socket of a lease: a cursor into the lease's
// stream plus a reader feeding the instance.
type clientConn struct {
	l         *lease
	ws        *wire.Conn
	principal string
	cur       *streamlog.Cursor
	// resumed: the client connected with ?from_seq=, so it is told about
	// evicted ranges in-band with stream-gap rather than by a seq jump alone.
	resumed bool

	// One writer at a time holds the turn: the instance's read pump writing
	// a frame itself when the client is caught up and its socket has room
	// (no goroutine handoff, no thread wakeup, on the hot path), or a
	// transient drain goroutine for everything else: a replay, a lagging
	// client, a close. A slow client therefore never stalls its instance.
	wmu     sync.Mutex
	writing bool
	dead    bool                   // a write failed or the socket closed: write nothing more
	gap     *brokerframe.StreamGap // the notice to send before anything else
	closing *CloseReq
	flushBy time.Time
	// heldFor is the instance socket holding frames this client's read
	// pump sent and has not flushed yet; only the read pump touches it.
	heldFor *instanceConn
}

// CloseReq is how a client connection is closed: code and reason.
type CloseReq struct {
	Code   int    `json:"code"`
	Reason string `json:"reason"`
}

// finish closes the connection after writing it everything the lease
// produced, bounded by finishFlush.
func (c *clientConn) finish(code int, reason string) {
	c.wmu.Lock()
	if c.closing == nil {
		c.closing = &CloseReq{code, reason}
		c.flushBy = time.Now().Add(finishFlush)
	}
	c.wmu.Unlock()
	c.notify(false)
}

// notify says the lease's stream grew or the connection must close. With
// direct set the caller (the instance read pump) may write a caught-up
// frame itself.
func (c *clientConn) notify(direct bool) {
	c.wmu.Lock()
	if c.writing || c.dead {
		c.wmu.Unlock()
		return // the writer holding the turn sees the new work when it releases
	}
	c.writing = true
	direct = direct && c.gap == nil && c.closing == nil
	c.wmu.Unlock()
	if direct && c.writeDirect() && c.release() {
		return
	}
	go c.drain()
}

// release gives up the writing turn, unless work arrived meanwhile: then it
// keeps it and reports false. Checking under wmu is what makes a
// concurrent notify either see the turn taken or find nothing left.
func (c *clientConn) release() bool {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if !c.dead && (c.closing != nil || c.l.log.HasAfter(c.cur)) {
		return false
	}
	c.writing = false
	return true
}

func (c *clientConn) markDead() {
	c.wmu.Lock()
	c.dead = true
	c.wmu.Unlock()
}

// directMax bounds what the read pump writes itself; more goes to a drain
// goroutine.
const directMax = 8

// frameHeaderMax is the most a WebSocket frame header takes.
const frameHeaderMax = 14

// writeDirect writes the few frames after the cursor on the caller's
// goroutine, if the socket can take them without blocking. It reports false
// when it left them for a drain goroutine.
func (c *clientConn) writeDirect() bool {
	var arr [directMax]streamlog.Entry
	batch, missFrom, _, _ := c.l.log.ReadBatch(c.cur, arr[:0], directMax, false)
	if missFrom > 0 || len(batch) == directMax {
		return false
	}
	size := 0
	for _, e := range batch {
		size += len(e.Data) + frameHeaderMax
	}
	if len(batch) == 0 {
		return true
	}
	if !c.ws.RoomFor(size) {
		return false
	}
	// Held: the read pump flushes them once it has handled everything the
	// instance sent so far (flushHeld), so a burst leaves in one write.
	for _, e := range batch {
		if _, err := c.ws.Send(e.Data, true); err != nil {
			c.markDead()
			return true
		}
	}
	c.l.log.Advance(c.cur, batch[len(batch)-1].Seq)
	return true
}

// flushHeld writes what writeDirect left in the socket's buffer.
func (c *clientConn) flushHeld() {
	if _, err := c.ws.Flush(); err != nil {
		c.markDead()
	}
}

// drain writes until the client has everything, then releases the turn; a
// close requested meanwhile is carried out once the stream is flushed, or
// at finishFlush.
func (c *clientConn) drain() {
	for {
		if !c.writeAll() {
			c.markDead()
			return
		}
		c.wmu.Lock()
		closing := c.closing
		c.wmu.Unlock()
		if closing != nil {
			if c.l.log.HasAfter(c.cur) && time.Now().Before(c.flushBy) {
				continue
			}
			c.ws.CloseGraceful(closing.Code, closing.Reason)
			c.markDead()
			return
		}
		if c.release() {
			return
		}
	}
}

// writeAll writes the gap notice if one is due, then every frame after the
// cursor: replayed frames first, then live ones, in seq order, never
// skipping a frame the log still holds. Each frame waits for room in the
// socket first (waitRoom), so a client that stops reading is left whole
// frames, never a part of one. It reports false on a write error.
func (c *clientConn) writeAll() bool {
	l, g := c.l, c.l.g
	if gap := c.gap; gap != nil {
		c.gap = nil // only the turn holder touches it
		g.m.ReplayGaps.Inc(gap.Reason)
		if !c.sendWhole(streamlog.GapFrame(l.id, gap)) {
			return false
		}
	}
	// Everything is held and leaves in as few writes as the buffer allows,
	// the last once the stream has nothing more for this client.
	buf := make([]streamlog.Entry, 0, 64)
	for {
		batch, missFrom, missThrough, _ := l.log.ReadBatch(c.cur, buf[:0], cap(buf), false)
		if missFrom > 0 {
			// This reader fell more than client_replay_buffer_bytes behind.
			if c.resumed && !c.sendWhole(g.evictedGap(l.id, missFrom, missThrough)) {
				return false
			}
			continue
		}
		if len(batch) == 0 {
			_, err := c.ws.Flush()
			return err == nil
		}
		for _, e := range batch {
			if !c.sendWhole(e.Data) {
				return false
			}
		}
		l.log.Advance(c.cur, batch[len(batch)-1].Seq)
		if c.closingExpired() {
			_, err := c.ws.Flush()
			return err == nil
		}
	}
}

// sendWhole holds one frame for the socket once it has room for all of it.
func (c *clientConn) sendWhole(data []byte) bool {
	if !c.ws.WaitRoom(len(data) + frameHeaderMax) {
		return false
	}
	_, err := c.ws.Send(data, true)
	return err == nil
}

func (c *clientConn) closingExpired() bool {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	return c.closing != nil && time.Now().After(c.flushBy)
}

// handleClient is WS /lease/{lease_id}. Ownership is checked before the
// upgrade, and a lease that is not yours is the same 404 as none at all.
func (g *Gateway) handleClient(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("lease_id")
	if owner := g.remoteOwner(id); owner != "" {
		g.rt.RelayClient(w, r, owner, id)
		return
	}
	p, credential, ok := g.clientPrincipal(w, r, id)
	if !ok {
		return
	}
	l := g.owned(r, id, p)
	if l == nil {
		writeUnknownLease(w)
		return
	}
	fromSeq := int64(-1) // absent or unparsable: live only
	if v := r.URL.Query().Get("from_seq"); v != "" {
		if n, err := strconv.ParseUint(v, 10, 63); err == nil {
			fromSeq = int64(n)
		}
	}
	// The turn is taken before the 101 goes out: a client that dials again
	// once its first handshake is answered is the newer, however the two
	// serving goroutines are scheduled.
	turn := l.clientTicket()
	conn, err := wire.Upgrader.Upgrade(w, r, nil)
	if err != nil {
		g.logAcceptFailed("client", r, err)
		return
	}
	// As for instances: return, so net/http can drop its per-connection
	// state, and serve the socket on its own goroutine.
	go g.serveClient(l, conn, turn, p.ID, credential, fromSeq)
}

// serveClient runs one client socket of l until it ends.
func (g *Gateway) serveClient(l *lease, conn *websocket.Conn, turn uint64, principal, credential string, fromSeq int64) {
	c := &clientConn{l: l, ws: wire.NewConn(conn, g.log, "client", l.id), principal: principal, resumed: fromSeq >= 0}

	if !g.attachClient(l, c, turn, fromSeq, principal, credential) {
		c.ws.CloseGraceful(websocket.CloseGoingAway, wire.CloseLeaseClosed)
		c.ws.DiscardUntilClosed()
		return
	}

	c.notify(false) // the replay, if any, on a drain goroutine
	// The read pump, which lives as long as the connection, gets a
	// goroutine of its own: the stack this one grew attaching (the log
	// lines) would stay with an idle client until the collector next ran.
	go c.serve()
}

// serve runs the read pump until the socket ends, then detaches it. A close
// this side began (a refused frame) is seen through to the client's echo, so
// what the client sent meanwhile does not reset the connection under it.
func (c *clientConn) serve() {
	c.ws.FlushBeforeRead(c.flushToInstance)
	c.readPump()
	c.flushToInstance()
	c.markDead()

	c.l.g.detachClient(c.l, c, c.cur)
	c.ws.DiscardUntilClosed()
}

// clientTicket is the turn of a client connection accepted now: the
// higher, the newer.
func (l *lease) clientTicket() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.clientTurns++
	return l.clientTurns
}

// attachClient makes c, accepted at turn (clientTicket; 0 takes the next
// turn now), the lease's client, its cursor placed by fromSeq: the newest connection wins,
// wherever it entered, and the one it displaces is closed with 4501; a
// connection that arrives after a newer one attached is itself the one
// displaced. It reports false when c is not attached: a draining lease, or
// c displaced on arrival.
func (g *Gateway) attachClient(l *lease, c attachedClient, turn uint64, fromSeq int64, principal, credential string) bool {
	l.mu.Lock()
	if l.state == stateDraining {
		l.mu.Unlock()
		return false
	}
	if turn == 0 {
		l.clientTurns++
		turn = l.clientTurns
	}
	if l.client != nil && l.clientTurn > turn {
		l.mu.Unlock()
		g.displaced(l, c, principal, credential)
		return false
	}
	cur, gap := l.log.Attach(fromSeq)
	c.place(cur, gap) // before it is the lease's client: the read pump may write to it at once
	startSeq, lastSeq := cur.Seq(), l.log.LastSeq()
	old := l.client
	l.client, l.clientTurn = c, turn
	l.mu.Unlock()
	g.publish(EventClient, l, "")
	g.log.Info("client connected", "lease_id", l.id, "principal_id", principal, "credential", credential, "evicted_previous_client", old != nil)
	if old != nil {
		g.displaced(l, old, principal, credential)
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
	return true
}

// displaced closes old with 4501: the newest connection wins, so that a
// half-open socket cannot lock its owner out of the reconnect the ticket
// flow exists for. principal and credential are the newer connection's.
func (g *Gateway) displaced(l *lease, old attachedClient, principal, credential string) {
	old.displace()
	g.m.ClientEvictions.Add(1)
	g.publish(EventEvicted, l, wire.CloseSuperseded)
	g.log.Warn("this connection displaced the lease's previous client, which has been "+
		"closed. A client must not keep two connections open to one lease — they will "+
		"evict each other",
		"lease_id", l.id, "principal_id", principal, "credential", credential,
		"reason", wire.CloseSuperseded, "close_status", wire.CodeSuperseded)
}

// detachClient ends c's attachment when its connection goes away.
func (g *Gateway) detachClient(l *lease, c attachedClient, cur *streamlog.Cursor) {
	l.log.Detach(cur)
	l.mu.Lock()
	if l.client == c {
		l.client = nil
	}
	l.mu.Unlock()
	g.publish(EventClient, l, "")
	g.log.Info("client disconnected", "lease_id", l.id)
}

// attachedClient is the connection a lease streams to: a WebSocket on this
// broker (clientConn) or one relayed through another (relayConn).
type attachedClient interface {
	// place sets where the connection starts reading the lease's stream,
	// and the gap notice it is sent first, if any.
	place(cur *streamlog.Cursor, gap *brokerframe.StreamGap)
	// notify says the stream grew; see clientConn.notify.
	notify(direct bool)
	// flushHeld writes what notify(true) left in the socket's buffer.
	flushHeld()
	// finish closes after flushing what the lease produced.
	finish(code int, reason string)
	// displace closes at once with 4501: a newer connection took over.
	displace()
	// goAway closes with 1001 at gateway shutdown.
	goAway()
}

func (c *clientConn) place(cur *streamlog.Cursor, gap *brokerframe.StreamGap) {
	c.cur, c.gap = cur, gap
}
func (c *clientConn) displace() { c.ws.CloseNow(wire.CodeSuperseded, wire.CloseSuperseded) }
func (c *clientConn) goAway()   { c.ws.CloseGraceful(websocket.CloseGoingAway, wire.CloseRestarting) }

// readPump forwards the client's io frames to the instance, until the
// socket ends or a frame is refused (the socket then closes with 1009).
// Each message is lent by the socket until its next read (wire.Conn.Next).
func (c *clientConn) readPump() {
	for {
		data, err := c.ws.Next()
		if err != nil {
			return
		}
		ic, refused := c.l.fromClient(data, true)
		if ic != nil {
			c.heldFor = ic
		}
		if refused != nil {
			c.ws.CloseGraceful(refused.Code, refused.Reason)
			return
		}
	}
}

// fromClient delivers one client message to the instance; with hold as
// sendToInstance takes it. A message larger than max_client_frame as the
// instance would be written it is not delivered: refused is the close its
// client gets, and the lease carries on for the next connection.
func (l *lease) fromClient(data []byte, hold bool) (ic *instanceConn, refused *CloseReq) {
	out, ok := l.forInstance(data)
	if !ok {
		return nil, nil
	}
	if limit := l.g.cfg.Load().MaxClientFrame; len(out) > int(limit) {
		l.g.log.Warn("client frame refused: larger than the instance may be sent; the client is closed with 1009 "+
			"and the lease stays claimed. Raise max_client_frame only if the lease's instance reads larger frames "+
			"(a stock nexus instance reads at most 32 KiB)",
			"lease_id", l.id, "frame_bytes", len(out), "max_client_frame", int64(limit))
		return nil, &CloseReq{Code: websocket.CloseMessageTooBig, Reason: frameTooBig(len(out), int64(limit))}
	}
	l.clientInput()
	return l.sendToInstance(out, hold), nil
}

// frameTooBig says that a frame of n bytes for the instance is over
// max_client_frame's limit (a close reason: at most 123 bytes).
func frameTooBig(n int, limit int64) string {
	return fmt.Sprintf("frame of %d bytes exceeds max_client_frame (%d bytes)", n, limit)
}

// flushToInstance writes the frames this client's read pump left in the
// instance socket's buffer: it runs before each read of the client's
// socket, once every frame already received has been handled.
func (c *clientConn) flushToInstance() {
	if ic := c.heldFor; ic != nil {
		c.heldFor = nil
		c.l.flushInstance(ic)
	}
}

// forInstance turns one client message into the bytes its instance is sent,
// or drops it and counts why. Only io travels client → instance: a client's
// shutdown or register is not the client's to send. A message that already
// is the io envelope for this lease is forwarded as it was sent; anything
// else is re-encoded.
func (l *lease) forInstance(data []byte) ([]byte, bool) {
	g := l.g
	f, err := brokerframe.DecodeShared(data, l.id)
	switch {
	case err != nil:
		// A bare IO payload ({"type":"input",…}) is what the spec's own
		// browser sketch sends; wrap it rather than drop it.
		var bare struct {
			Type string `json:"type"`
		}
		if json.Unmarshal(data, &bare) != nil || bare.Type == "" {
			l.dropUndecodable(err)
			return nil, false
		}
		f = brokerframe.Frame{Signal: brokerframe.SignalIO, Payload: data}
	case f.LeaseID != "" && f.LeaseID != l.id:
		l.dropMismatched(f.LeaseID)
		return nil, false
	case f.Signal != brokerframe.SignalIO:
		g.m.FramesDropped.Inc("client_control")
		return nil, false
	case f.LeaseID == l.id && f.Version == brokerframe.Version && f.Secret == "" && f.SessionID == "" && f.Seq == 0:
		return data, true
	}
	out, err := brokerframe.Encode(brokerframe.Frame{LeaseID: l.id, Signal: brokerframe.SignalIO, Payload: f.Payload})
	if err != nil {
		g.m.FramesDropped.Inc("undecodable")
		return nil, false
	}
	return out, true
}

// evictedGap is the notice, counted, that frames missFrom..missThrough were
// evicted before a resuming client was written them.
func (g *Gateway) evictedGap(leaseID string, missFrom, missThrough uint64) []byte {
	g.m.ReplayGaps.Inc(brokerframe.GapEvicted)
	return streamlog.GapFrame(leaseID, &brokerframe.StreamGap{Reason: brokerframe.GapEvicted,
		RequestedFromSeq: missFrom - 1, MissingFromSeq: missFrom, MissingThroughSeq: missThrough})
}

// logAcceptFailed logs a refused handshake as upstream does ("client
// websocket accept failed", "instance websocket accept failed").
func (g *Gateway) logAcceptFailed(peer string, r *http.Request, err error) {
	g.log.Error(peer+" websocket accept failed", "error", "failed to accept WebSocket connection: "+wire.AcceptFailure(r, err))
}
