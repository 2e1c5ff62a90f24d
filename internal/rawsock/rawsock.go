// Package rawsock makes a socket's reads and writes raw system calls.
//
// The descriptor is non-blocking, so neither can block; the runtime's
// poller still waits for readiness and enforces deadlines and Close
// (syscall.RawConn). What the raw call leaves out is the runtime's entry
// into a blocking system call, and that is the point: every such entry made
// while the process was idle wakes the runtime's monitor thread (sysmon),
// which then polls on a 20 µs sleep for about a millisecond. A relayed frame
// arrives at an idle gateway, and an RPC at an idle spawnd, so each paid
// that: most of the gateway's CPU per sequential echo, taken from the
// instance and the client on a small machine.
package rawsock

import (
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"unsafe"
)

// rawConn is a socket whose reads and writes are raw system calls.
type rawConn struct {
	net.Conn
	rc syscall.RawConn

	// The state of the one read and the one write in flight: the callbacks
	// are bound once (readFn, writeFn) so a call allocates nothing.
	rmu     sync.Mutex
	rbuf    []byte
	rn      int
	rerr    error
	readFn  func(fd uintptr) bool
	wmu     sync.Mutex
	wbuf    []byte
	wn      int
	werr    error
	writeFn func(fd uintptr) bool
}

// Wrap returns c reading and writing with raw system calls when it is a TCP
// or unix socket, else c as it was.
func Wrap(c net.Conn) net.Conn {
	var sc syscall.Conn
	switch s := c.(type) {
	case *net.TCPConn:
		sc = s
	case *net.UnixConn:
		sc = s
	default:
		return c
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return c
	}
	r := &rawConn{Conn: c, rc: rc}
	r.readFn, r.writeFn = r.readOnce, r.writeSome
	return r
}

// SyscallConn is the socket's.
func (c *rawConn) SyscallConn() (syscall.RawConn, error) { return c.rc, nil }

func (c *rawConn) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	c.rmu.Lock()
	defer c.rmu.Unlock()
	c.rbuf, c.rn, c.rerr = p, 0, nil
	err := c.rc.Read(c.readFn)
	n, rerr := c.rn, c.rerr
	c.rbuf, c.rerr = nil, nil
	switch {
	case err != nil: // deadline or Close, as the poller reports them
		return 0, err
	case rerr == io.EOF:
		return 0, io.EOF
	case rerr != nil:
		return n, c.opError("read", rerr)
	}
	return n, nil
}

// readOnce is one read(2) into rbuf; false asks the poller to wait for
// readability.
func (c *rawConn) readOnce(fd uintptr) bool {
	var done bool
	c.rn, done, c.rerr = ReadOnce(fd, c.rbuf)
	return done
}

// ReadOnce is one read(2) of a non-blocking descriptor into p, for a
// callback of syscall.RawConn.Read: done false asks the poller to wait for
// readability; io.EOF is the end of the stream.
func ReadOnce(fd uintptr, p []byte) (n int, done bool, err error) {
	for {
		r, _, e := syscall.RawSyscall(syscall.SYS_READ, fd, uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
		switch e {
		case 0:
			if r == 0 {
				return 0, true, io.EOF
			}
			return int(r), true, nil
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			return 0, false, nil
		default:
			return 0, true, os.NewSyscallError("read", e)
		}
	}
}

func (c *rawConn) Write(p []byte) (int, error) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.wbuf, c.wn, c.werr = p, 0, nil
	var err error
	if len(p) > 0 {
		err = c.rc.Write(c.writeFn)
	}
	n, werr := c.wn, c.werr
	c.wbuf, c.werr = nil, nil
	switch {
	case err != nil:
		return n, err
	case werr != nil:
		return n, c.opError("write", werr)
	}
	return n, nil
}

// writeSome writes what is left of wbuf; false asks the poller to wait for
// room.
func (c *rawConn) writeSome(fd uintptr) bool {
	for c.wn < len(c.wbuf) {
		rest := c.wbuf[c.wn:]
		n, _, e := syscall.RawSyscall(syscall.SYS_WRITE, fd, uintptr(unsafe.Pointer(&rest[0])), uintptr(len(rest)))
		switch e {
		case 0:
			c.wn += int(n)
		case syscall.EINTR:
		case syscall.EAGAIN:
			return false
		default:
			c.werr = os.NewSyscallError("write", e)
			return true
		}
	}
	return true
}

// opError wraps err as the net package does its own socket errors.
func (c *rawConn) opError(op string, err error) error {
	return &net.OpError{Op: op, Net: c.LocalAddr().Network(), Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: err}
}
