// Package rawsock makes a socket's reads and writes raw system calls (and
// the appends of a file written on a latency path, see File).
//
// The descriptor is non-blocking, so neither can block; the runtime's
// poller still waits for readiness and enforces deadlines and Close
// (syscall.RawConn). What the raw call leaves out is the runtime's entry
// into a blocking system call, and that is the point: every such entry made
// while the process was idle wakes the runtime's monitor thread (sysmon),
// which then polls on a 20 µs sleep for about a millisecond. A relayed frame
// arrives at an idle gateway, so each paid that: most of the gateway's CPU
// per sequential echo, taken from the instance and the client on a small
// machine. It is the gateway's: nexus-spawnd links none of it.
//
// It is of the gateway's floor: it may import none of the gateway's
// layers (internal/gateway/layers_test.go checks it).
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
	rmu    sync.Mutex
	rbuf   []byte
	rn     int
	rerr   error
	readFn func(fd uintptr) bool
	// ReadPooled's: the pool it borrows from, the buffer it kept, and its
	// bound callback.
	rpool        *sync.Pool
	rlent        *[]byte
	readPooledFn func(fd uintptr) bool
	w            rawWriter
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
	r.readFn, r.readPooledFn = r.readOnce, r.readPooledOnce
	r.w.bind(rc)
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

// ReadPooled reads as Read does, into a buffer it takes from pool only once
// the socket has bytes, and puts back while it waits: a reader parked on
// an idle socket holds none. It returns the buffer and how much of it was
// read; the caller puts the buffer back. With an error or at the end of
// the stream the buffer is nil.
func (c *rawConn) ReadPooled(pool *sync.Pool) (*[]byte, int, error) {
	c.rmu.Lock()
	defer c.rmu.Unlock()
	c.rpool, c.rlent, c.rn, c.rerr = pool, nil, 0, nil
	err := c.rc.Read(c.readPooledFn)
	b, n, rerr := c.rlent, c.rn, c.rerr
	c.rpool, c.rlent, c.rbuf, c.rerr = nil, nil, nil, nil
	switch {
	case err != nil:
		return nil, 0, err
	case rerr == io.EOF:
		return nil, 0, io.EOF
	case rerr != nil:
		return nil, 0, c.opError("read", rerr)
	}
	return b, n, nil
}

// readPooledOnce is readOnce into a buffer from rpool, kept (rlent) only
// when bytes came.
func (c *rawConn) readPooledOnce(fd uintptr) bool {
	b := c.rpool.Get().(*[]byte)
	c.rbuf = *b
	done := c.readOnce(fd)
	if done && c.rerr == nil {
		c.rlent = b
	} else {
		c.rpool.Put(b)
	}
	c.rbuf = nil
	return done
}

// readOnce is one read(2); false asks the poller to wait for readability.
func (c *rawConn) readOnce(fd uintptr) bool {
	for {
		n, _, e := syscall.RawSyscall(syscall.SYS_READ, fd, uintptr(unsafe.Pointer(&c.rbuf[0])), uintptr(len(c.rbuf)))
		switch e {
		case 0:
			c.rn = int(n)
			if n == 0 {
				c.rerr = io.EOF
			}
			return true
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			return false
		default:
			c.rerr = os.NewSyscallError("read", e)
			return true
		}
	}
}

func (c *rawConn) Write(p []byte) (int, error) {
	n, errno, err := c.w.write(p)
	switch {
	case err != nil: // deadline or Close, as the poller reports them
		return n, err
	case errno != 0:
		return n, c.opError("write", os.NewSyscallError("write", errno))
	}
	return n, nil
}

// rawWriter is the one write in flight on a descriptor, its callback bound
// once (fn) so that a write allocates nothing.
type rawWriter struct {
	mu    sync.Mutex
	rc    syscall.RawConn
	buf   []byte
	n     int
	errno syscall.Errno
	fn    func(fd uintptr) bool
}

func (w *rawWriter) bind(rc syscall.RawConn) {
	w.rc, w.fn = rc, w.writeSome
}

// write writes all of p, or until an error: errno is the system call's,
// err the poller's (a deadline, Close).
func (w *rawWriter) write(p []byte) (n int, errno syscall.Errno, err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf, w.n, w.errno = p, 0, 0
	if len(p) > 0 {
		err = w.rc.Write(w.fn)
	}
	n, errno = w.n, w.errno
	w.buf = nil
	return n, errno, err
}

// writeSome writes what is left of buf; false asks the poller to wait for
// room.
func (w *rawWriter) writeSome(fd uintptr) bool {
	for w.n < len(w.buf) {
		rest := w.buf[w.n:]
		n, _, e := syscall.RawSyscall(syscall.SYS_WRITE, fd, uintptr(unsafe.Pointer(&rest[0])), uintptr(len(rest)))
		switch e {
		case 0:
			w.n += int(n)
		case syscall.EINTR:
		case syscall.EAGAIN:
			return false
		default:
			w.errno = e
			return true
		}
	}
	return true
}

// File is an open regular file whose writes are raw system calls, for the
// small appends a latency path makes (a line of a store that is not
// fsynced per write). Such a write copies into the page cache and returns;
// made the normal way it would, on an idle process, wake sysmon as a socket
// write did (see the package comment). A write that does wait in the kernel
// (dirty-page throttling) holds its thread and its processor meanwhile, so
// File is not for bulk writes or for files opened with O_SYNC.
type File struct {
	*os.File
	w rawWriter
}

// NewFile returns f writing with raw system calls.
func NewFile(f *os.File) (*File, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return nil, err
	}
	r := &File{File: f}
	r.w.bind(rc)
	return r, nil
}

// Write writes all of p, or reports why not as os.File.Write does.
func (f *File) Write(p []byte) (int, error) {
	n, errno, err := f.w.write(p)
	if err == nil && errno != 0 {
		err = errno
	}
	if err != nil {
		return n, &os.PathError{Op: "write", Path: f.Name(), Err: err}
	}
	return n, nil
}

// opError wraps err as the net package does its own socket errors.
func (c *rawConn) opError(op string, err error) error {
	return &net.OpError{Op: op, Net: c.LocalAddr().Network(), Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: err}
}

// IoctlInt and SockoptInt read an int from a socket the way Wrap's reads
// and writes are made, for callers inside syscall.RawConn.Control.
func IoctlInt(fd uintptr, req uint) (int, error) {
	var v int32
	if _, _, e := syscall.RawSyscall(syscall.SYS_IOCTL, fd, uintptr(req), uintptr(unsafe.Pointer(&v))); e != 0 {
		return 0, e
	}
	return int(v), nil
}

func SockoptInt(fd uintptr, level, opt int) (int, error) {
	var v int32
	size := uint32(unsafe.Sizeof(v))
	if _, _, e := syscall.RawSyscall6(syscall.SYS_GETSOCKOPT, fd, uintptr(level), uintptr(opt), uintptr(unsafe.Pointer(&v)), uintptr(unsafe.Pointer(&size)), 0); e != 0 {
		return 0, e
	}
	return int(v), nil
}
