package gateway

import (
	"io"
	"net"
	"sync"
	"syscall"
	"unsafe"

	"github.com/nexus-broker/nexus-broker/internal/rawsock"
)

// pooledRead reads a socket as rawsock's connections do, into a buffer it
// takes from a pool only once the socket has bytes, and puts back while it
// waits: a reader parked on an idle socket holds none. Only the reading
// goroutine uses it; the callback is bound once, so a read allocates
// nothing.
type pooledRead struct {
	conn net.Conn
	rc   syscall.RawConn
	pool *sync.Pool
	lent *[]byte
	n    int
	err  error
	fn   func(fd uintptr) bool
}

// newPooledRead is a pooledRead of c, nil when c is not a socket.
func newPooledRead(c net.Conn, pool *sync.Pool) *pooledRead {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return nil
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil
	}
	r := &pooledRead{conn: c, rc: rc, pool: pool}
	r.fn = r.readOnce
	return r
}

// read returns the buffer it filled and how much of it was read; the caller
// puts the buffer back. With an error or at the end of the stream the
// buffer is nil.
func (r *pooledRead) read() (*[]byte, int, error) {
	r.lent, r.n, r.err = nil, 0, nil
	err := r.rc.Read(r.fn)
	b, n, rerr := r.lent, r.n, r.err
	r.lent, r.err = nil, nil
	switch {
	case err != nil: // deadline or Close, as the poller reports them
		return nil, 0, err
	case rerr == io.EOF:
		return nil, 0, io.EOF
	case rerr != nil:
		return nil, 0, &net.OpError{Op: "read", Net: r.conn.LocalAddr().Network(), Source: r.conn.LocalAddr(), Addr: r.conn.RemoteAddr(), Err: rerr}
	}
	return b, n, nil
}

// readOnce is rawsock.ReadOnce into a buffer from the pool, kept (lent)
// only when bytes came.
func (r *pooledRead) readOnce(fd uintptr) bool {
	b := r.pool.Get().(*[]byte)
	var done bool
	r.n, done, r.err = rawsock.ReadOnce(fd, *b)
	if done && r.err == nil {
		r.lent = b
	} else {
		r.pool.Put(b)
	}
	return done
}

// ioctlInt and sockoptInt read an int from a socket the way rawsock's reads
// and writes are made, for callers inside syscall.RawConn.Control.
func ioctlInt(fd uintptr, req uint) (int, error) {
	var v int32
	if _, _, e := syscall.RawSyscall(syscall.SYS_IOCTL, fd, uintptr(req), uintptr(unsafe.Pointer(&v))); e != 0 {
		return 0, e
	}
	return int(v), nil
}

func sockoptInt(fd uintptr, level, opt int) (int, error) {
	var v int32
	size := uint32(unsafe.Sizeof(v))
	if _, _, e := syscall.RawSyscall6(syscall.SYS_GETSOCKOPT, fd, uintptr(level), uintptr(opt), uintptr(unsafe.Pointer(&v)), uintptr(unsafe.Pointer(&size)), 0); e != 0 {
		return 0, e
	}
	return int(v), nil
}
