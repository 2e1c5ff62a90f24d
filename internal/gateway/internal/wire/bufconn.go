package wire

import (
	"encoding/binary"
	"errors"
	"net"
	"sync"
	"syscall"
	"time"

	"github.com/gorilla/websocket"

	"github.com/nexus-broker/nexus-broker/internal/rawsock"
)

// Write-combining. Every connection the gateway accepts is a bufConn. For
// HTTP, and for everything gorilla writes itself (the upgrade answer, ping,
// pong, close), it is the plain connection: each Write goes out at once,
// after whatever data frames were waiting, so a control frame is never held
// back. Data frames do not go through gorilla's writer: Conn hands them
// to writeFrame, which appends the frame to a buffer, and the buffer leaves
// in one write(2) when its writer says the queue has drained (flush), or
// when it is full. A pipelined stream then costs one syscall per batch
// rather than one per frame, and nothing is allocated per frame.

const (
	// combineLimit is how much a buffer holds before it is written whether
	// or not the queue has drained: the most one write(2) carries.
	combineLimit = 64 << 10
	// bufInitial is the size of a fresh buffer from combinePool.
	bufInitial = 4 << 10
)

// combinePool lends buffers only while frames wait in them: an idle
// connection holds none.
var combinePool = sync.Pool{New: func() any { b := make([]byte, 0, bufInitial); return &b }}

// Reading. gorilla reads through a bufio.Reader it keeps for the
// connection's life. Ours is small (readBufferSize): once the connection
// is a WebSocket, a read takes a buffer from readPool only when the socket
// has bytes (rawsock's ReadPooled), and gives it back as soon as gorilla
// has taken them, so an idle socket holds no read buffer. Two of those per
// lease were most of an idle lease's memory.
const (
	// readChunk is the most one read(2) asks for: what gorilla's buffer
	// read at once before, so a pipelined stream costs no more reads.
	readChunk = 4 << 10
	// readBufferSize is gorilla's own buffer: a frame header and a control
	// frame's payload fit in it.
	readBufferSize = 256
)

var readPool = sync.Pool{New: func() any { b := make([]byte, readChunk); return &b }}

// pooledReader is a socket that can read into a buffer it borrows only
// once bytes have come (rawsock's connections).
type pooledReader interface {
	ReadPooled(pool *sync.Pool) (*[]byte, int, error)
}

// errCloseSent is a data frame written after the close frame went out, as
// gorilla refuses one.
var errCloseSent = websocket.ErrCloseSent

// Listener wraps ln so that the connections it accepts combine writes (see
// bufConn). The gateway's WebSockets need it to write in batches; without
// it they write frame by frame through gorilla.
func Listener(ln net.Listener) net.Listener { return combineListener{ln} }

type combineListener struct{ net.Listener }

func (l combineListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &bufConn{Conn: rawsock.Wrap(c)}, nil
}

// bufConn is an accepted connection whose data frames can wait for a flush.
type bufConn struct {
	net.Conn

	mu  sync.Mutex
	buf *[]byte // frames not yet written; nil when none wait
	// frames counts what buf holds, for the caller's loss accounting.
	frames int
	// framing: the connection is a WebSocket now, so a Write that starts
	// with a close frame ends its data (closeSent).
	framing, closeSent bool
	// werr is the first write error. It is final: a write that failed may
	// have stopped part-way through a frame, and any byte after it would be
	// read as the rest of that frame. Every later write (gorilla's pings,
	// pongs and close included) returns it and nothing more reaches the
	// socket, which fail closed.
	werr error
	// writeBy is the write deadline in force; flushes push it out only
	// when half spent, keeping a timer update off most writes.
	writeBy time.Time
	// beforeRead runs before each read of the socket, on the reading
	// goroutine: the point where everything already received has been
	// handled, and so where the output it produced is flushed.
	beforeRead func()

	// Only the reading goroutine touches these. rbuf holds what the last
	// read brought and gorilla has not taken yet, rbuf[roff:rlen]; nil when
	// nothing waits. pooled is the socket once it is a WebSocket's, nil
	// before (or when it cannot lend: then reads go straight through).
	rbuf       *[]byte
	roff, rlen int
	pooled     pooledReader
}

// startFraming makes the connection a WebSocket's: a close frame written
// ends its data, and reads borrow their buffer only while bytes wait in
// it. It runs before anything reads the WebSocket.
func (c *bufConn) startFraming() {
	c.mu.Lock()
	c.framing = true
	c.mu.Unlock()
	c.pooled, _ = c.Conn.(pooledReader)
}

// SyscallConn exposes the socket for roomFor's queue checks.
func (c *bufConn) SyscallConn() (syscall.RawConn, error) {
	sc, ok := c.Conn.(syscall.Conn)
	if !ok {
		return nil, errors.New("not a socket")
	}
	return sc.SyscallConn()
}

func (c *bufConn) Read(p []byte) (int, error) {
	if c.rbuf != nil {
		return c.take(p), nil
	}
	if f := c.beforeRead; f != nil {
		f()
	}
	// Before the upgrade net/http reads through its own buffer, and a read
	// as large as a chunk gains nothing from one.
	if c.pooled == nil || len(p) >= readChunk {
		return c.Conn.Read(p)
	}
	b, n, err := c.pooled.ReadPooled(&readPool)
	if b == nil {
		return 0, err
	}
	c.rbuf, c.roff, c.rlen = b, 0, n
	return c.take(p), nil
}

// take copies what waits in rbuf into p, and puts rbuf back in the pool
// once it is all taken.
func (c *bufConn) take(p []byte) int {
	n := copy(p, (*c.rbuf)[c.roff:c.rlen])
	c.roff += n
	if c.roff == c.rlen {
		readPool.Put(c.rbuf)
		c.rbuf = nil
	}
	return n
}

// Write is everything but data frames: it goes out at once, after the frames
// that were waiting.
func (c *bufConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.werr != nil {
		return 0, c.werr
	}
	if c.framing && len(p) > 0 && p[0] == finalBit|websocket.CloseMessage {
		c.closeSent = true
	}
	if c.buf == nil {
		n, err := c.Conn.Write(p)
		if err != nil {
			c.failLocked(err)
		}
		return n, err
	}
	*c.buf = append(*c.buf, p...)
	if _, err := c.flushLocked(false); err != nil {
		return 0, err
	}
	return len(p), nil
}

func (c *bufConn) SetWriteDeadline(t time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.writeBy = t
	return c.Conn.SetWriteDeadline(t)
}

// finalBit marks the last frame of a message in a WebSocket frame header.
const finalBit = 0x80

// writeFrame appends one unmasked text frame (the server's kind) carrying
// data, and writes the buffer out now unless hold is set and it is under
// combineLimit. It reports how many frames a failed write lost.
func (c *bufConn) writeFrame(data []byte, hold bool) (lost int, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.werr != nil {
		return 1, c.werr
	}
	if c.closeSent {
		return 1, errCloseSent
	}
	if c.buf == nil {
		c.buf = combinePool.Get().(*[]byte)
	}
	b := append(*c.buf, finalBit|websocket.TextMessage)
	switch n := len(data); {
	case n < 126:
		b = append(b, byte(n))
	case n <= 0xffff:
		b = binary.BigEndian.AppendUint16(append(b, 126), uint16(n))
	default:
		b = binary.BigEndian.AppendUint64(append(b, 127), uint64(n))
	}
	*c.buf = append(b, data...)
	c.frames++
	if hold && len(*c.buf) < combineLimit {
		return 0, nil
	}
	return c.flushLocked(true)
}

// flush writes whatever frames wait. It reports how many a failed write
// lost.
func (c *bufConn) flush() (lost int, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.werr != nil {
		return 0, c.werr
	}
	if c.buf == nil {
		return 0, nil
	}
	return c.flushLocked(true)
}

// fail makes err the connection's final write error (see werr) unless it
// already has one.
func (c *bufConn) fail(err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.failLocked(err)
}

func (c *bufConn) failLocked(err error) {
	if c.werr != nil {
		return
	}
	c.werr = err
	_ = c.Conn.Close()
	if c.buf != nil {
		c.releaseBufLocked() // frames held behind the failure never go out
	}
}

// releaseBufLocked empties the buffer and returns it to the pool.
func (c *bufConn) releaseBufLocked() {
	*c.buf = (*c.buf)[:0]
	if cap(*c.buf) <= combineLimit*2 {
		combinePool.Put(c.buf)
	}
	c.buf, c.frames = nil, 0
}

// pending is how many bytes wait for a flush.
func (c *bufConn) pending() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.buf == nil {
		return 0
	}
	return len(*c.buf)
}

// flushLocked writes the buffer and returns it to the pool. With ownDeadline
// the write runs under writeWait, pushed out when half spent; otherwise
// under the deadline its caller (gorilla) set.
func (c *bufConn) flushLocked(ownDeadline bool) (lost int, err error) {
	if ownDeadline {
		if now := time.Now(); c.writeBy.Sub(now) < writeWait/2 {
			c.writeBy = now.Add(writeWait)
			_ = c.Conn.SetWriteDeadline(c.writeBy)
		}
	}
	_, err = c.Conn.Write(*c.buf)
	if err != nil {
		lost = c.frames
	}
	c.releaseBufLocked()
	if err != nil {
		c.failLocked(err)
	}
	return lost, err
}
