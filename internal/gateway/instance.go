package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/gorilla/websocket"

	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/wire"
	"github.com/nexus-broker/nexus-broker/internal/spawnproof"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// registerWait bounds how long a dialer has to send its register frame.
const registerWait = 10 * time.Second

// maxRegisterFrame bounds what a dialer may send before its secret is
// verified: a register frame is a few hundred bytes, and anyone who can
// reach the port may dial. A larger frame is refused from its header (close
// 1009), never read.
const maxRegisterFrame = 64 << 10

// instanceConn is one dial-back socket of a lease's instance.
type instanceConn struct {
	ws *wire.Conn
	// drained is closed when the read pump has delivered everything the
	// instance wrote and returned.
	drained chan struct{}
	// heldFor is the client whose socket holds frames this read pump
	// wrote and has not flushed yet; only the read pump touches it.
	heldFor attachedClient
}

// flushToClient writes the frames the read pump left in its client's
// socket buffer: it runs before each read of the instance's socket, once
// every frame already received has been handled.
func (ic *instanceConn) flushToClient() {
	if cl := ic.heldFor; cl != nil {
		ic.heldFor = nil
		cl.flushHeld()
	}
}

// sendShutdown asks the instance to end its session and stop redialing.
func (ic *instanceConn) sendShutdown() {
	data, _ := brokerframe.Encode(brokerframe.Frame{Signal: brokerframe.SignalShutdown})
	_ = ic.ws.Write(data)
}

// handleInstance is WS /instance: where a process spawnd started proves it
// is that process (lease id + per-spawn secret) and then streams.
func (g *Gateway) handleInstance(w http.ResponseWriter, r *http.Request) {
	conn, err := wire.Upgrader.Upgrade(w, r, nil)
	if err != nil {
		g.logAcceptFailed("instance", r, err) // the wire.Upgrader has answered
		return
	}
	// Serve the socket on a fresh goroutine and return: a handler that never
	// returns pins net/http's per-connection buffers, request and contexts
	// for the socket's whole life.
	go g.serveInstance(conn, r.RemoteAddr)
}

// serveInstance runs one dial-back socket: register, then the read pump.
func (g *Gateway) serveInstance(conn *websocket.Conn, remote string) {
	ws := wire.NewConn(conn, g.log, "instance", "")
	conn.SetReadLimit(maxRegisterFrame)
	_ = conn.SetReadDeadline(time.Now().Add(registerWait))
	_, data, err := conn.ReadMessage()
	if err != nil {
		ws.CloseNow(websocket.ClosePolicyViolation, "no register frame")
		g.quiet.Warn(wire.PeerHost(remote), "instance closed before register frame", "remote", remote, "error", err)
		return
	}
	f, refuse, err := registerOf(data)
	if refuse != "" {
		ws.CloseNow(websocket.ClosePolicyViolation, refuse)
		if err != nil {
			g.quiet.Warn(wire.PeerHost(remote), "instance sent undecodable first frame", "remote", remote, "error", err)
		} else {
			g.quiet.Warn(wire.PeerHost(remote), "instance first frame was not register", "remote", remote, "signal", f.Signal)
		}
		return
	}
	l, refusal := g.admitInstance(g.ctx, f)
	if l == nil {
		// Every refusal is byte-identical on the wire, and sent before the
		// log line (whose wording differs) is written, so a dialer cannot
		// tell a live lease id from a dead one; the log tells them apart.
		ws.CloseNow(websocket.ClosePolicyViolation, wire.CloseUnknownLease)
		g.logRefusal(f, refusal, remote)
		return
	}
	ws.BoundReads()
	_ = ws.HeardNow()
	ws.SetLease(l.id)
	ic := &instanceConn{ws: ws, drained: make(chan struct{})}

	l.mu.Lock()
	if l.state == stateDraining {
		l.mu.Unlock()
		ws.CloseNow(websocket.CloseGoingAway, wire.CloseLeaseClosed)
		return
	}
	reattached := l.restored && l.state == stateSpawning
	if reattached && l.reattachTimer != nil {
		l.reattachTimer.Stop()
	}
	l.mu.Unlock()
	if old := l.attachInstance(ic); old != nil {
		old.ws.CloseNow(websocket.CloseGoingAway, "superseded by a newer instance connection")
	}
	if reattached {
		l.activate()
		g.m.RestoredLeases.Inc("reattached")
		g.pools.m.Booted(l.id)
		g.log.Info("restored lease reattached by its instance", "lease_id", l.id)
	}
	g.log.Info("instance registered", "lease_id", l.id)
	// The read pump, which lives as long as the lease, gets a goroutine of
	// its own: the stack this one grew for the handshake's RPC would stay
	// with an idle lease until the collector next ran.
	go ic.serve(l)
}

// serve runs the read pump until the socket ends, then detaches it.
func (ic *instanceConn) serve(l *lease) {
	g, ws := l.g, ic.ws
	ws.FlushBeforeRead(ic.flushToClient)
	ic.readPump(l)
	ic.flushToClient()

	l.mu.Lock()
	if l.inst == ic {
		l.inst = nil
	}
	l.mu.Unlock()
	close(ic.drained)
	ws.Finish()
	g.log.Info("instance disconnected", "lease_id", l.id)
}

// registerOf reads a dial-back's first message. Anything but a register
// frame answers the close reason refusing it: with err when it does not
// decode at all.
func registerOf(data []byte) (f brokerframe.Frame, refuse string, err error) {
	f, err = brokerframe.Decode(data)
	switch {
	case err != nil:
		return f, "invalid register frame", err
	case f.Signal != brokerframe.SignalRegister:
		return f, "expected register frame", nil
	}
	return f, "", nil
}

// refusal names why a registration was refused, for the log only.
type refusal int

const (
	refusedUnknownLease refusal = iota
	refusedNoSecret
	refusedWrongSecret
	refusedVersionSkew
	refusedSpawnPending
)

// admitInstance decides a register frame against the verifier of the
// lease's spawn secret, which spawnd handed over with the lease: no round
// trip to spawnd, and the spawn-key never enters the gateway. A lease id
// nobody holds is checked against no verifier by the same code
// (spawnproof.Matches), so the time a refusal takes does not tell a dialer
// whether its lease id is live. A frame that comes before the lease's Spawn
// has answered (only its instance knows the id by then) waits for it.
func (g *Gateway) admitInstance(ctx context.Context, f brokerframe.Frame) (*lease, refusal) {
	l := g.lookup(f.LeaseID)
	verifier, pending := proofOf(ctx, l)
	if pending {
		return nil, refusedSpawnPending
	}
	match := spawnproof.Matches(verifier, f.Secret)
	switch {
	case f.Version != brokerframe.Version:
		return nil, refusedVersionSkew
	case l == nil || verifier == nil:
		return nil, refusedUnknownLease
	case f.Secret == "":
		return nil, refusedNoSecret
	case !match:
		return nil, refusedWrongSecret
	case l.currentState() == stateDraining:
		return nil, refusedUnknownLease
	}
	return l, 0
}

// proofOf is l's verifier, nil for no lease; pending when l's Spawn did not
// answer within registerWait. A lease whose Spawn has answered (every one
// but one being spawned right now) costs one receive that does not block,
// and allocates nothing, so a live lease id is refused as fast as an
// unknown one (BenchmarkRegisterRefusal).
func proofOf(ctx context.Context, l *lease) (verifier []byte, pending bool) {
	if l == nil {
		return nil, false
	}
	select {
	case <-l.proven:
		return l.verifier, false
	default:
	}
	t := time.NewTimer(registerWait)
	defer t.Stop()
	select {
	case <-l.proven:
		return l.verifier, false
	case <-t.C:
	case <-ctx.Done():
	}
	return nil, true
}

func (g *Gateway) logRefusal(f brokerframe.Frame, why refusal, remote string) {
	switch why {
	case refusedVersionSkew:
		g.quiet.Warn(f.LeaseID, "rejecting instance registration: its register frame declares a broker frame "+
			"schema version this broker does not speak. The binary the binaries registry entry for "+
			"this lease points at is a different build from this broker: upgrade whichever is older "+
			"so both speak the same version",
			"lease_id", f.LeaseID, "instance_frame_version", f.Version, "broker_frame_version", brokerframe.Version, "remote", remote,
			"error", fmt.Sprintf("register frame schema version does not match this broker: instance sent version %d, this broker speaks version %d", f.Version, brokerframe.Version))
	case refusedNoSecret:
		g.quiet.Warn(f.LeaseID, "rejecting instance registration: its register frame carried NO spawn secret, "+
			"and this broker requires one for every registration — with or without an auth block. "+
			"The most likely cause is that the instance binary the binaries registry entry points at "+
			"predates the spawn-secret protocol: upgrade it. Removing the auth block no longer makes "+
			"this work", "lease_id", f.LeaseID, "remote", remote, "error", "register frame carried no spawn secret")
	case refusedWrongSecret:
		g.quiet.Warn(f.LeaseID, "rejecting instance registration: its register frame carried the WRONG spawn secret. "+
			"This broker did not spawn the process that dialed back", "lease_id", f.LeaseID, "remote", remote,
			"error", "register frame spawn secret does not match")
	case refusedSpawnPending:
		g.quiet.Warn(f.LeaseID, "rejecting instance registration", "lease_id", f.LeaseID, "remote", remote,
			"error", "nexus-spawnd has not answered this lease's Spawn, whose answer carries what the spawn secret is checked against; the instance will redial")
	default:
		g.quiet.Warn(f.LeaseID, "rejecting instance registration", "lease_id", f.LeaseID, "remote", remote,
			"error", "unknown lease: no live lease has this id (released, reaped, or never minted by this broker)")
	}
}

// readPump delivers the instance's frames to the lease's stream until the
// socket ends, each message decoded in the buffer the socket lends until
// its next read (wire.Conn.Next): nothing below keeps a part of it.
func (ic *instanceConn) readPump(l *lease) {
	g := l.g
	for {
		data, err := ic.ws.Next()
		if err != nil {
			var ne net.Error
			if !errors.As(err, &ne) && !websocket.IsCloseError(err, websocket.CloseNormalClosure, websocket.CloseGoingAway) &&
				!websocket.IsUnexpectedCloseError(err) {
				g.log.Debug("instance read ended", "lease_id", l.id, "error", err)
			}
			return
		}
		f, err := brokerframe.DecodeShared(data, l.id)
		if err != nil {
			l.dropUndecodable(err)
			continue
		}
		// A frame without lease_id is the socket's lease's, as upstream
		// reads it.
		if f.LeaseID != "" && f.LeaseID != l.id {
			l.dropMismatched(f.LeaseID)
			continue
		}
		state := ""
		switch f.Signal {
		case brokerframe.SignalRegister, brokerframe.SignalStreamGap:
			continue // meaningless mid-stream; never a client's business
		case brokerframe.SignalReady:
			l.markReady()
		case brokerframe.SignalSessionIDReport:
			l.markSession(f.SessionID)
		case brokerframe.SignalIO:
			state, _ = statusState(f.Payload)
			if state != "" {
				l.turnStatus(state)
			}
		}
		f.Secret = "" // never relayed, whatever an instance put there
		lost, err := l.log.Append(f)
		if err != nil {
			g.m.FramesDropped.Inc("undecodable")
			continue
		}
		if lost > 0 {
			// Upstream's words for a client that stopped draining; here the
			// frames lost are the oldest its cursor had not reached.
			g.m.FramesDropped.Add("client_buffer_full", uint64(lost))
			g.quiet.Warn(l.id, "peer send buffer full, dropping frame", "lease_id", l.id, "signal", f.Signal, "frames", lost)
		}
		// Recorded in the step that reads the observer: a conversation
		// adopting this lease sees either this state or this payload.
		l.mu.Lock()
		if state == brokerframe.StateIdle || brokerframe.IsWorkState(state) {
			l.reported = state
		}
		cl, obs := l.client, l.follower
		l.mu.Unlock()
		if cl != nil {
			cl.notify(true)
			ic.heldFor = cl
		}
		if obs != nil && f.Signal == brokerframe.SignalIO {
			obs.Payload(l.handle(), bytes.Clone(f.Payload))
		}
	}
}

// dropUndecodable and dropMismatched count and log a frame either pump
// drops, in upstream's words: the count alone does not say which lease.
func (l *lease) dropUndecodable(err error) {
	l.g.m.FramesDropped.Inc("undecodable")
	l.g.quiet.Warn(l.id, "dropping undecodable frame", "lease_id", l.id, "error", err)
}

func (l *lease) dropMismatched(frameLease string) {
	l.g.m.FramesDropped.Inc("lease_mismatch")
	l.g.quiet.Warn(l.id, "dropping frame with mismatched lease", "bound_lease", l.id, "frame_lease", frameLease)
}

var statusType = []byte(`"status"`)

// statusState extracts a status payload's state. The cheap byte test keeps
// the decode off the path of every delta.
func statusState(payload json.RawMessage) (string, bool) {
	if !bytes.Contains(payload, statusType) {
		return "", false
	}
	var p struct {
		Type  string `json:"type"`
		State string `json:"state"`
	}
	if json.Unmarshal(payload, &p) != nil || p.Type != brokerframe.IOStatus {
		return "", false
	}
	return p.State, true
}

// sendToInstance delivers one client frame. With an instance attached it is
// written at once, or with hold left in the socket's buffer for the caller
// to flush (flushInstance on the connection it returns); a slow instance
// blocks the write (and so the client's socket: TCP backpressure, not
// loss). While the instance redials, copies of frames are held up to
// holdFrames / holdBytes and counted when dropped beyond that.
func (l *lease) sendToInstance(data []byte, hold bool) *instanceConn {
	l.sendMu.Lock()
	defer l.sendMu.Unlock()
	l.mu.Lock()
	inst := l.inst
	l.mu.Unlock()
	if inst == nil {
		if len(l.held) >= holdFrames || l.heldBytes+len(data) > holdBytes {
			l.g.m.FramesDropped.Inc("no_instance")
			return nil
		}
		l.held = append(l.held, bytes.Clone(data))
		l.heldBytes += len(data)
		return nil
	}
	lost, err := inst.ws.Send(data, hold)
	l.instanceWriteFailed(lost, err)
	return inst
}

// flushInstance writes the client frames ic's socket holds.
func (l *lease) flushInstance(ic *instanceConn) {
	lost, err := ic.ws.Flush()
	l.instanceWriteFailed(lost, err)
}

// instanceWriteFailed counts and reports the client frames a failed write
// to the instance socket lost.
func (l *lease) instanceWriteFailed(lost int, err error) {
	if err == nil {
		return
	}
	l.g.m.FramesDropped.Add("no_instance", uint64(lost))
	l.g.quiet.Warn(l.id, "client frames were lost: the instance socket failed while they were being written", "lease_id", l.id, "frames", lost, "error", err)
}

// attachInstance makes ic the lease's instance connection and delivers the
// frames held while there was none, before any newer client frame.
func (l *lease) attachInstance(ic *instanceConn) (old *instanceConn) {
	l.sendMu.Lock()
	defer l.sendMu.Unlock()
	l.mu.Lock()
	old = l.inst
	l.inst = ic
	l.mu.Unlock()
	for i, data := range l.held {
		if lost, err := ic.ws.Send(data, true); err != nil {
			l.g.m.FramesDropped.Add("no_instance", uint64(lost+len(l.held)-i-1))
			break
		}
	}
	if lost, _ := ic.ws.Flush(); lost > 0 {
		l.g.m.FramesDropped.Add("no_instance", uint64(lost))
	}
	l.held, l.heldBytes = nil, 0
	return old
}
