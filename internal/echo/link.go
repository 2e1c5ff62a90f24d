package echo

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/gorilla/websocket"
	"github.com/nexus-broker/nexus-broker/internal/logbound"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// brokerSubject is the subject of the lines a broker's frames cause
// (logbound): an instance serves one lease and has one peer.
const brokerSubject = "broker"

// Redial backoff, as upstream's plugin: quick enough to ride out a broker
// restart, capped so a broker that is gone for good costs one dial per 5 s.
const (
	minBackoff = 250 * time.Millisecond
	maxBackoff = 5 * time.Second
)

const (
	dialTimeout  = 10 * time.Second // the broker wants register within 10 s of connecting anyway
	writeTimeout = 10 * time.Second // a socket that accepts nothing for this long is dead
	// closeFlushTimeout bounds the last flush on a graceful close, so a stuck
	// socket cannot turn shutdown into a hang the broker must SIGKILL.
	closeFlushTimeout = 2 * time.Second
	closeAckTimeout   = time.Second
)

// link is the dial-back client: it owns the socket, redials it, and moves
// frames between it and the rest of the instance.
type link struct {
	addr      string
	leaseID   string
	secret    string
	sessionID string
	knobs     knobs
	flooded   bool // EnvReportFlood's reports went out; once is the attack
	// reportDue is set once the session id may be reported: at once, or
	// EnvSessionReportDelay after the first handshake.
	reportDue atomic.Bool
	out       *outbox
	log       *slog.Logger
	// quiet bounds the lines a broker can cause per frame (logbound).
	quiet *logbound.Limiter

	// onIO gets each io payload, on the read goroutine; it must not block.
	onIO func(json.RawMessage)
	// onShutdown is called when the broker sends shutdown (unless the knob
	// says to ignore it); it must make ctx passed to run end.
	onShutdown func()

	cur   atomic.Pointer[websocket.Conn] // the live connection, if any
	pause atomic.Int64                   // nanoseconds to stay away before the next dial
}

// drop closes the live connection without a close handshake and keeps the
// link down for d before redialing (agent's cmdDrop).
func (l *link) drop(d time.Duration) {
	l.pause.Store(int64(d))
	if c := l.cur.Load(); c != nil {
		_ = c.UnderlyingConn().Close()
	}
}

// run keeps a connection to the broker until ctx ends. A connection that
// drops for any reason is redialled with backoff; only ctx ends the loop.
func (l *link) run(ctx context.Context) {
	backoff := minBackoff
	for {
		up, err := l.connect(ctx)
		if ctx.Err() != nil {
			return
		}
		// A link that stayed up a while was healthy; one that is refused right
		// after the handshake (a wrong secret, say) keeps backing off instead
		// of hammering the broker four times a second.
		if up >= maxBackoff {
			backoff = minBackoff
		}
		wait := max(backoff, time.Duration(l.pause.Swap(0)))
		l.log.Warn("broker connection lost", "broker_addr", l.addr, "error", err, "retry_in", wait)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		backoff = min(2*backoff, maxBackoff)
	}
}

// connect dials, handshakes and pumps one connection until it fails or ctx
// ends. up is how long the connection lasted after the handshake.
func (l *link) connect(ctx context.Context) (up time.Duration, err error) {
	dialer := websocket.Dialer{Proxy: http.ProxyFromEnvironment, HandshakeTimeout: dialTimeout}
	conn, _, err := dialer.DialContext(ctx, l.addr, nil)
	if err != nil {
		return 0, fmt.Errorf("dialing %s: %w", l.addr, err)
	}
	defer conn.Close()
	if err := l.handshake(conn); err != nil {
		return 0, err
	}
	l.log.Info("registered with broker", "broker_addr", l.addr)
	if n := l.out.connect(); n > 0 {
		l.log.Warn("outbound buffer overflowed while disconnected; oldest frames dropped", "frames", n, "limit_bytes", l.out.limit)
	}
	defer l.out.disconnect()
	start := time.Now()
	l.cur.Store(conn)
	defer l.cur.Store(nil)

	readErr := make(chan error, 1)
	go func() { readErr <- l.readLoop(conn) }()
	err = l.writeLoop(ctx, conn, readErr)
	return time.Since(start), err
}

// handshake sends register, ready and session-id-report, the order a stock
// nexus build uses on every (re)connect. They bypass the outbox so that
// buffered output can only follow them.
func (l *link) handshake(conn *websocket.Conn) error {
	register, err := l.registerFrame()
	if err != nil {
		return err
	}
	conn.SetWriteDeadline(time.Now().Add(writeTimeout))
	if err := conn.WriteMessage(websocket.TextMessage, register); err != nil {
		return fmt.Errorf("sending register: %w", err)
	}
	if l.knobs.ExitBeforeReady {
		l.log.Warn("exiting before ready", "knob", EnvExitBeforeReady, "exit_code", ExitBeforeReady)
		os.Exit(ExitBeforeReady)
	}
	frames := []brokerframe.Frame{{LeaseID: l.leaseID, Signal: brokerframe.SignalReady}}
	if l.reportDue.Load() {
		frames = append(frames, l.sessionReport())
	}
	if !l.flooded {
		l.flooded = true
		if !l.knobs.NoSessionReport && l.knobs.ReportDelay > 0 {
			time.AfterFunc(l.knobs.ReportDelay, l.reportLate)
		}
		for i := range l.knobs.FloodReports {
			id := strconv.Itoa(i)
			id += strings.Repeat("f", max(l.knobs.FloodBytes-len(id), 0))
			frames = append(frames, brokerframe.Frame{LeaseID: l.leaseID, Signal: brokerframe.SignalSessionIDReport, SessionID: id})
		}
	}
	for _, f := range frames {
		b, err := brokerframe.Encode(f)
		if err != nil {
			return err
		}
		if err := conn.WriteMessage(websocket.TextMessage, b); err != nil {
			return fmt.Errorf("sending %s: %w", f.Signal, err)
		}
	}
	return nil
}

func (l *link) sessionReport() brokerframe.Frame {
	return brokerframe.Frame{LeaseID: l.leaseID, Signal: brokerframe.SignalSessionIDReport, SessionID: l.sessionID}
}

// reportLate sends the session-id report EnvSessionReportDelay held back,
// behind whatever the instance has written by then.
func (l *link) reportLate() {
	b, err := brokerframe.Encode(l.sessionReport())
	if err != nil {
		l.log.Error("encoding the session-id report", "error", err)
		return
	}
	l.log.Info("reporting the session id late", "knob", EnvSessionReportDelay, "delay", l.knobs.ReportDelay)
	l.reportDue.Store(true)
	l.out.push(b)
}

// registerFrame encodes the register frame, bent by the secret and version
// knobs. A skewed version is marshalled directly because Encode stamps 1.
func (l *link) registerFrame() ([]byte, error) {
	f := brokerframe.Frame{LeaseID: l.leaseID, Signal: brokerframe.SignalRegister, Secret: l.secret}
	switch {
	case l.knobs.NoSecret:
		f.Secret = ""
	case l.knobs.WrongSecret:
		f.Secret = wrongSecret(l.secret)
	}
	if l.knobs.RegisterVersion != brokerframe.Version {
		f.Version = l.knobs.RegisterVersion
		return json.Marshal(f)
	}
	return brokerframe.Encode(f)
}

// wrongSecret returns a secret of the same length as s that differs from it
// in every byte and so contains none of it.
func wrongSecret(s string) string {
	if s == "" {
		return "wrong"
	}
	b := []byte(s)
	for i := range b {
		if b[i] == 'x' {
			b[i] = 'y'
		} else {
			b[i] = 'x'
		}
	}
	return string(b)
}

// readLoop reads frames until the socket fails. Any frame, ping or pong from
// the broker proves it alive and pushes the read deadline out; silence for
// PeerTimeout fails the read and so drops the link.
func (l *link) readLoop(conn *websocket.Conn) error {
	alive := func() { conn.SetReadDeadline(time.Now().Add(l.knobs.PeerTimeout)) }
	alive()
	conn.SetPongHandler(func(string) error { alive(); return nil })
	answerPing := conn.PingHandler()
	conn.SetPingHandler(func(data string) error { alive(); return answerPing(data) })

	var buf bytes.Buffer // reused: Decode copies what it keeps
	for {
		_, r, err := conn.NextReader()
		if err != nil {
			return err
		}
		buf.Reset()
		if _, err := buf.ReadFrom(r); err != nil {
			return err
		}
		alive()
		l.dispatch(buf.Bytes())
	}
}

func (l *link) dispatch(data []byte) {
	f, err := brokerframe.Decode(data)
	if err != nil {
		l.quiet.Warn(brokerSubject, "dropping an undecodable frame from the broker", "error", err)
		return
	}
	switch f.Signal {
	case brokerframe.SignalIO:
		l.onIO(f.Payload)
	case brokerframe.SignalShutdown:
		if l.knobs.IgnoreShutdown || l.knobs.IgnoreShutdownFrame {
			knob := EnvIgnoreShutdownFrame
			if l.knobs.IgnoreShutdown {
				knob = EnvIgnoreShutdown
			}
			l.quiet.Warn(brokerSubject, "ignoring shutdown frame", "knob", knob)
			return
		}
		if l.knobs.ExitOnShutdown {
			// No close handshake, no flush, and not even the runtime's exit
			// hooks (a -race build's take milliseconds): the process is gone
			// before the broker's next move.
			l.log.Info("broker requested shutdown; exiting at once", "knob", EnvExitOnShutdown)
			syscall.Exit(ExitOK)
		}
		l.log.Info("broker requested shutdown")
		l.onShutdown()
	default:
		l.quiet.Warn(brokerSubject, "ignoring a frame an instance does not expect", "signal", f.Signal)
	}
}

// writeLoop drains the outbox to the socket and pings the broker, until the
// socket fails (its own write or the read loop's error) or ctx ends. It
// always returns after the read loop has.
func (l *link) writeLoop(ctx context.Context, conn *websocket.Conn, readErr <-chan error) error {
	ping := time.NewTicker(l.knobs.PingInterval)
	defer ping.Stop()
	var batch [][]byte
	for {
		var err error
		batch, err = l.flush(conn, batch, time.Now().Add(writeTimeout))
		if err == nil {
			select {
			case <-ctx.Done():
				l.closeGracefully(conn, batch, readErr)
				return ctx.Err()
			case err = <-readErr:
				return err
			case <-l.out.ready:
				continue
			case <-ping.C:
				err = conn.WriteControl(websocket.PingMessage, nil, time.Now().Add(writeTimeout))
				if err == nil {
					continue
				}
			}
		}
		conn.Close() // unblocks the read loop
		<-readErr
		return err
	}
}

// flush writes everything queued in one batch. Frames the socket refuses go
// back to the outbox for the next connection: a failed write means the bytes
// never fully reached the kernel of a socket that is now dead.
func (l *link) flush(conn *websocket.Conn, batch [][]byte, deadline time.Time) ([][]byte, error) {
	batch = l.out.take(batch[:0])
	conn.SetWriteDeadline(deadline)
	for i, b := range batch {
		if err := conn.WriteMessage(websocket.TextMessage, b); err != nil {
			l.out.finish(batch[i:])
			clear(batch)
			return batch, fmt.Errorf("writing to broker: %w", err)
		}
	}
	l.out.finish(nil)
	clear(batch)
	return batch, nil
}

// closeGracefully sends what is still queued and a normal close, then waits
// (briefly) for the broker's close reply so the broker sees a clean end.
func (l *link) closeGracefully(conn *websocket.Conn, batch [][]byte, readErr <-chan error) {
	deadline := time.Now().Add(closeFlushTimeout)
	if _, err := l.flush(conn, batch, deadline); err != nil {
		l.log.Warn("output not flushed before shutdown", "error", err)
	}
	msg := websocket.FormatCloseMessage(websocket.CloseNormalClosure, "shutdown")
	if err := conn.WriteControl(websocket.CloseMessage, msg, deadline); err != nil && !errors.Is(err, websocket.ErrCloseSent) {
		l.log.Warn("sending close to broker", "error", err)
	}
	t := time.NewTimer(closeAckTimeout)
	defer t.Stop()
	select {
	case <-readErr:
		return
	case <-t.C:
	}
	conn.Close()
	<-readErr
}
