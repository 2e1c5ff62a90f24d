// Package wire is the lease core's sockets: every accepted connection
// combining its writes (bufconn.go), the WebSocket wrapper with its
// liveness probe, write wait and send room (wsconn.go), and the
// connection a request came over (conn.go; the HTTP server's bounds are
// internal/httpapi's). It is internal to the lease core
// (internal/gateway): no other layer can import it.
//
// It imports only internal/rawsock and internal/envdur of the project.
package wire

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/gorilla/websocket"
	"golang.org/x/sys/unix"

	"github.com/nexus-broker/nexus-broker/internal/envdur"
	"github.com/nexus-broker/nexus-broker/internal/rawsock"
)

// Liveness: ping every pingInterval, give up after peerTimeout of silence
// (three unanswered probes: one lost ping proves little). They are constants
// of the product; only tests shorten them, through TestLivenessEnv, because
// the end-to-end tests drive the real binary.
var (
	pingInterval = 15 * time.Second
	peerTimeout  = 45 * time.Second
)

// TestLivenessEnv overrides the two liveness intervals ("interval,timeout",
// Go durations). It exists for tests only and is not a configuration key.
const TestLivenessEnv = "NEXUS_BROKER_TEST_LIVENESS"

// writeWait is how long a socket may take no bytes before the gateway gives
// up on it. A constant of the product; only tests shorten it, through
// TestWriteWaitEnv, to stall a client within a test's patience.
var writeWait = 10 * time.Second

// TestWriteWaitEnv overrides writeWait (a Go duration). It exists for tests
// only and is not a configuration key.
const TestWriteWaitEnv = "NEXUS_BROKER_TEST_WRITE_WAIT"

func init() {
	envdur.Override(TestLivenessEnv, &pingInterval, &peerTimeout)
	envdur.Override(TestWriteWaitEnv, &writeWait)
}

const (
	// closeWait bounds how long a graceful close waits for the peer's echo
	// (the spec's five seconds).
	closeWait = 5 * time.Second
	// MaxMessage bounds one inbound WebSocket message: the hard read limit,
	// which a 1009 names (CloseTooBig).
	MaxMessage = 16 << 20
)

// ErrTooBig is Read's error for a message over MaxMessage, whose socket it
// has closed with 1009.
var ErrTooBig = errors.New("websocket: message exceeds the read limit")

// CloseTooBig is the 1009 reason of a message over MaxMessage.
var CloseTooBig = fmt.Sprintf("message exceeds the %d-byte WebSocket read limit", MaxMessage)

// Close codes and reasons of the wire contract.
const (
	CloseLeaseClosed = "lease closed"
	// CloseRestarting is a gateway's going away while the lease lives on
	// (SIGTERM): wire-facts' 1001, without saying the lease closed.
	CloseRestarting      = "broker restarting; reconnect with from_seq"
	CloseInstanceCrashed = "instance crashed"
	CloseSuperseded      = "superseded by a newer client connection"
	CloseUnknownLease    = "unknown lease"
	closeUnresponsive    = "peer unresponsive"
	CodeInstanceCrashed  = 4500
	CodeSuperseded       = 4501
)

var Upgrader = websocket.Upgrader{
	// An idle lease holds two sockets and its memory was mostly theirs:
	// gorilla keeps only a small read buffer, the connection lends a larger
	// one while bytes wait in it (see bufConn.Read), and write buffers come
	// from a pool only while writing.
	ReadBufferSize:  readBufferSize,
	WriteBufferSize: 4 << 10,
	WriteBufferPool: &sync.Pool{},
	// Browsers are a supported client (the ticket flow exists for them) and
	// the broker is not a cookie-authenticated site, so any origin may
	// connect; authorization is by credential and lease ownership.
	CheckOrigin: func(*http.Request) bool { return true },
	Error: func(w http.ResponseWriter, r *http.Request, status int, reason error) {
		status, text := handshakeRefusal(r, w.Header(), status, reason)
		http.Error(w, text, status)
	},
}

// handshakeRefusal is how upstream's WebSocket library refuses a request it
// cannot upgrade, checked in its order: 426 when the Connection or Upgrade
// token is missing (asking for both), 400 for a version other than 13 or no
// key. Anything else keeps gorilla's status and reason. hdr, when not nil,
// gets the headers the refusal carries.
func handshakeRefusal(r *http.Request, hdr http.Header, status int, reason error) (int, string) {
	set := func(kv ...string) {
		for i := 0; hdr != nil && i+1 < len(kv); i += 2 {
			hdr.Set(kv[i], kv[i+1])
		}
	}
	switch {
	case !hasToken(r.Header, "Connection", "upgrade"):
		set("Connection", "Upgrade", "Upgrade", "websocket")
		return http.StatusUpgradeRequired, fmt.Sprintf("WebSocket protocol violation: Connection header %q does not contain Upgrade", r.Header.Get("Connection"))
	case !hasToken(r.Header, "Upgrade", "websocket"):
		set("Connection", "Upgrade", "Upgrade", "websocket")
		return http.StatusUpgradeRequired, fmt.Sprintf("WebSocket protocol violation: Upgrade header %q does not contain websocket", r.Header.Get("Upgrade"))
	case r.Header.Get("Sec-WebSocket-Version") != "13":
		set("Sec-WebSocket-Version", "13")
		return http.StatusBadRequest, fmt.Sprintf("unsupported WebSocket protocol version (only 13 is supported): %q", r.Header.Get("Sec-WebSocket-Version"))
	case r.Header.Get("Sec-WebSocket-Key") == "":
		return http.StatusBadRequest, "WebSocket protocol violation: missing Sec-WebSocket-Key"
	}
	return status, reason.Error()
}

// hasToken reports whether header key lists token (case-insensitively).
func hasToken(h http.Header, key, token string) bool {
	for _, v := range h.Values(key) {
		for t := range strings.SplitSeq(v, ",") {
			if strings.EqualFold(strings.TrimSpace(t), token) {
				return true
			}
		}
	}
	return false
}

// AcceptFailure is how a refused handshake is worded in the log.
func AcceptFailure(r *http.Request, err error) string {
	_, text := handshakeRefusal(r, nil, 0, err)
	return text
}

// Conn serializes data writes on one gorilla connection (gorilla allows one
// concurrent writer; control frames are safe from any goroutine) and runs the
// liveness probe.
type Conn struct {
	// peer ("client" or "instance") and leaseID name the socket in logs.
	peer, leaseID string
	log           *slog.Logger

	c *websocket.Conn
	// heard is when the peer last answered or sent a ping (unix nanos): the
	// silence a liveness give-up reports.
	heard atomic.Int64
	// bc is c's connection when it combines writes (see bufConn), else
	// nil and data frames go through gorilla one write at a time.
	bc   *bufConn
	wmu  sync.Mutex
	once sync.Once
	done chan struct{} // closed when the connection is finished
	// pinger probes the peer every pingInterval; a timer rather than a
	// goroutine per socket.
	pinger *time.Timer
	// writeBy is the write deadline in force (guarded by wmu) when bc is
	// nil; it is pushed out only when half spent, not on every message.
	writeBy time.Time
	// room is roomFor's remaining budget of bytes.
	room int
	// lent is the buffer Next lent its caller the last message in, taken
	// back at the next read (only the reading goroutine touches it): a
	// socket waiting for its next message holds none.
	lent *[]byte
}

// SetLease names the lease the socket serves in its log lines, once it is
// known (an instance's socket learns it from its register frame).
func (w *Conn) SetLease(id string) { w.leaseID = id }

// NewConn wraps c, naming it peer ("client" or "instance") of leaseID.
func NewConn(c *websocket.Conn, log *slog.Logger, peer, leaseID string) *Conn {
	w := &Conn{c: c, done: make(chan struct{}), log: log, peer: peer, leaseID: leaseID}
	if bc, ok := c.UnderlyingConn().(*bufConn); ok {
		bc.startFraming()
		w.bc = bc
	}
	w.BoundReads()
	w.HeardNow()
	c.SetPongHandler(func(string) error { return w.HeardNow() })
	c.SetPingHandler(func(data string) error {
		_ = w.HeardNow()
		err := c.WriteControl(websocket.PongMessage, []byte(data), time.Now().Add(writeWait))
		if errors.Is(err, websocket.ErrCloseSent) {
			return nil
		}
		return err
	})
	w.pinger = time.AfterFunc(pingInterval, w.Probe)
	return w
}

// heardNow notes that the peer is alive and pushes the liveness deadline.
func (w *Conn) HeardNow() error {
	now := time.Now()
	w.heard.Store(now.UnixNano())
	return w.c.SetReadDeadline(now.Add(peerTimeout))
}

// BoundReads has Read bound each message at MaxMessage itself rather than
// gorilla, whose own limit closes with a 1009 that gives no reason.
func (w *Conn) BoundReads() { w.c.SetReadLimit(0) }

// Read returns the next message, the caller's to keep (see Next).
func (w *Conn) Read() ([]byte, error) {
	data, err := w.Next()
	if err != nil {
		return nil, err
	}
	return bytes.Clone(data), nil
}

// Next returns the next message in a buffer the connection lends until the
// next read of the socket: the caller must keep neither it nor any part of
// it past that. The buffers come from a pool, so a relay's reads allocate
// nothing, and an idle socket holds none. The liveness deadline is pushed
// out by the peer's pongs and pings (see NewConn), not by each message: any
// conformant peer answers every ping, and not touching the deadline per
// message keeps a timer update off the relay's hot path. A message over
// MaxMessage closes the socket with 1009 naming the limit (CloseTooBig) and
// is ErrTooBig. Only the socket's reading goroutine calls it.
func (w *Conn) Next() ([]byte, error) {
	w.giveBack()
	_, r, err := w.c.NextReader()
	var data []byte
	if err == nil {
		w.lent = messagePool.Get().(*[]byte)
		data, err = readMessage(r, (*w.lent)[:0])
		*w.lent = data
	}
	if err == nil && len(data) > MaxMessage {
		w.CloseGraceful(websocket.CloseMessageTooBig, CloseTooBig)
		return nil, ErrTooBig
	}
	if err != nil {
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() && !w.Closing() {
			w.giveUp(err)
		}
		return nil, err
	}
	return data, nil
}

// messagePool holds Next's buffers; one that grew past messageKeep for a
// large message is left to the collector rather than kept.
var messagePool = sync.Pool{New: func() any { b := make([]byte, 0, 1<<10); return &b }}

const messageKeep = 64 << 10

// giveBack returns the buffer Next lent, if any, to the pool.
func (w *Conn) giveBack() {
	if b := w.lent; b != nil {
		w.lent = nil
		if cap(*b) <= messageKeep {
			messagePool.Put(b)
		}
	}
}

// readMessage appends r's message to buf, stopping once it holds more than
// MaxMessage bytes: so bounded, a message too big is never read whole.
func readMessage(r io.Reader, buf []byte) ([]byte, error) {
	for len(buf) <= MaxMessage {
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)]
		}
		n, err := r.Read(buf[len(buf):min(cap(buf), MaxMessage+1)])
		buf = buf[:len(buf)+n]
		if err == io.EOF {
			return buf, nil
		}
		if err != nil {
			return buf, err
		}
	}
	return buf, nil
}

// write sends one text message now, with any held before it. A write that
// cannot complete within writeWait fails rather than pinning the writer on a
// dead peer.
func (w *Conn) Write(data []byte) error {
	_, err := w.Send(data, false)
	return err
}

// send writes one text message; with hold it may wait in the connection's
// buffer for a flush (see bufConn). It reports how many messages a failed
// write lost.
func (w *Conn) Send(data []byte, hold bool) (lost int, err error) {
	if w.bc != nil {
		return w.bc.writeFrame(data, hold)
	}
	w.wmu.Lock()
	defer w.wmu.Unlock()
	if now := time.Now(); w.writeBy.Sub(now) < writeWait/2 {
		w.writeBy = now.Add(writeWait)
		_ = w.c.SetWriteDeadline(w.writeBy)
	}
	if err := w.c.WriteMessage(websocket.TextMessage, data); err != nil {
		return 1, err
	}
	return 0, nil
}

// flush writes the messages send held. It reports how many a failed write
// lost.
func (w *Conn) Flush() (lost int, err error) {
	if w.bc == nil {
		return 0, nil
	}
	return w.bc.flush()
}

// flushBeforeRead makes f run before each read of the socket (see
// bufConn.beforeRead). Only the socket's reading goroutine may call it.
func (w *Conn) FlushBeforeRead(f func()) {
	if w.bc != nil {
		w.bc.beforeRead = f
	}
}

// roomFor reports whether the socket's send buffer can take n more bytes
// without the write blocking (see SendRoom). A check leaves a byte budget
// that later calls spend before asking the kernel again: the queue only
// drains meanwhile, so the budget never overstates the room. Only the
// holder of the client's writing turn calls it.
func (w *Conn) RoomFor(n int) bool {
	if n <= w.room {
		w.room -= n
		return true
	}
	w.room, _ = SendRoom(w.c.UnderlyingConn())
	if n > w.room {
		return false
	}
	w.room -= n
	return true
}

// waitRoom waits until the socket can take n more bytes without a write
// blocking, so that a write never stops part-way through a frame on a peer
// that stopped reading: what the connection holds is written first (the
// room counted it), and a frame larger than half the send buffer waits for
// the queue to empty. Past writeWait without room the peer is stalled: the
// connection fails for good (see bufConn.fail) and waitRoom reports false.
// Only the holder of the client's writing turn calls it.
func (w *Conn) WaitRoom(n int) bool {
	if w.RoomFor(n) {
		return true
	}
	deadline := time.Now().Add(writeWait)
	for pause := time.Millisecond; ; pause = min(2*pause, 50*time.Millisecond) {
		if _, err := w.Flush(); err != nil {
			return false
		}
		if w.RoomFor(n) {
			return true
		}
		if queued, _, ok := socketQueue(w.c.UnderlyingConn()); ok && queued == 0 {
			return true // larger than the room the socket ever has: it may block
		}
		if w.Closing() || time.Now().After(deadline) {
			if w.bc != nil {
				w.bc.fail(errStalled)
			}
			return false
		}
		time.Sleep(pause) // the kernel signals no "this much room"; poll, backing off
	}
}

// errStalled is the write error of a peer that took no bytes for writeWait.
var errStalled = errors.New("peer took no bytes within the write wait; connection closed")

// SendRoom is how many more bytes c's socket takes without a write
// blocking: half its send buffer (SO_SNDBUF) less what is queued
// (SIOCOUTQ) and what its bufConn holds. Anything unexpected answers 0.
func SendRoom(c net.Conn) (int, bool) {
	queued, size, known := socketQueue(c)
	if !known {
		return 0, false
	}
	room := size/2 - queued
	if bc, ok := c.(*bufConn); ok {
		room -= bc.pending()
	}
	return room, true
}

// socketQueue is what c's socket has queued unsent (SIOCOUTQ) and its send
// buffer's size (SO_SNDBUF).
func socketQueue(c net.Conn) (queued, size int, ok bool) {
	sc, isSock := c.(syscall.Conn)
	if !isSock {
		return 0, 0, false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return 0, 0, false
	}
	_ = rc.Control(func(fd uintptr) {
		var err1, err2 error
		queued, err1 = rawsock.IoctlInt(fd, unix.SIOCOUTQ)
		size, err2 = rawsock.SockoptInt(fd, unix.SOL_SOCKET, unix.SO_SNDBUF)
		ok = err1 == nil && err2 == nil
	})
	return queued, size, ok
}

// probe sends one ping and re-arms itself until the connection ends.
func (w *Conn) Probe() {
	if w.Closing() {
		return
	}
	if err := w.c.WriteControl(websocket.PingMessage, nil, time.Now().Add(writeWait)); err != nil {
		return
	}
	w.pinger.Reset(pingInterval)
}

// giveUp tears an unresponsive peer down without waiting for a close
// handshake it will never answer.
func (w *Conn) giveUp(err error) {
	w.log.Warn("peer stopped answering pings; closing its socket so the lease detaches. "+
		"The connection is half-open — the peer's host slept, moved network, or had its flow "+
		"dropped by a NAT — and would otherwise have looked healthy until the OS keepalive noticed",
		"lease_id", w.leaseID, "peer", w.peer, "silent_for", time.Since(time.Unix(0, w.heard.Load())),
		"deadline", peerTimeout, "error", err)
	w.CloseNow(websocket.CloseGoingAway, closeUnresponsive)
}

// closeNow sends a close frame and drops the connection at once.
func (w *Conn) CloseNow(code int, reason string) {
	w.once.Do(func() {
		w.pinger.Stop()
		_ = w.c.WriteControl(websocket.CloseMessage, websocket.FormatCloseMessage(code, reason), time.Now().Add(time.Second))
		_ = w.c.Close()
		close(w.done)
	})
}

// closeGraceful sends a close frame and lets the read loop see the peer's
// echo (or closeWait pass) before the connection is dropped, so the frame is
// not lost to a reset.
func (w *Conn) CloseGraceful(code int, reason string) {
	w.once.Do(func() {
		w.pinger.Stop()
		_ = w.c.WriteControl(websocket.CloseMessage, websocket.FormatCloseMessage(code, reason), time.Now().Add(time.Second))
		_ = w.c.SetReadDeadline(time.Now().Add(closeWait))
		close(w.done)
		time.AfterFunc(closeWait, func() { _ = w.c.Close() })
	})
}

// discardUntilClosed reads and drops messages until the connection ends (a
// graceful close's echo or closeWait), then releases it. It is the read
// loop of a socket closed before anything was relayed over it.
func (w *Conn) DiscardUntilClosed() {
	for {
		if _, err := w.Next(); err != nil {
			w.Finish()
			return
		}
	}
}

// closing reports whether a close has begun.
func (w *Conn) Closing() bool {
	select {
	case <-w.done:
		return true
	default:
		return false
	}
}

// finish releases the connection after its read loop ended.
func (w *Conn) Finish() {
	w.once.Do(func() {
		w.pinger.Stop()
		close(w.done)
	})
	_ = w.c.Close()
}
