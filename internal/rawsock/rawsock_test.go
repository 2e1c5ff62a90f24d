package rawsock

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/sockdir"
)

// rawPair is an accepted TCP connection, wrapped, and the plain client on
// the other end.
func rawPair(t *testing.T) (*rawConn, net.Conn) {
	t.Helper()
	return rawPairOn(t, "tcp", "127.0.0.1:0")
}

func rawPairOn(t *testing.T, network, addr string) (*rawConn, net.Conn) {
	t.Helper()
	ln, err := net.Listen(network, addr)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	client, err := net.Dial(network, ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.Close() })
	c, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	rc, ok := Wrap(c).(*rawConn)
	if !ok {
		t.Fatalf("a wrapped %s connection is %T, not a rawConn", network, Wrap(c))
	}
	return rc, client
}

func TestRawConnCarriesBytesBothWays(t *testing.T) {
	c, client := rawPair(t)
	if _, err := client.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 5)
	if _, err := io.ReadFull(c, got); err != nil || string(got) != "hello" {
		t.Fatalf("read %q, %v", got, err)
	}
	// More than the socket buffers hold: the write waits for room (EAGAIN,
	// then the poller) while the peer reads, and all of it arrives in order.
	big := bytes.Repeat([]byte("0123456789abcdef"), 1<<18) // 4 MiB
	done := make(chan error, 1)
	go func() {
		n, err := c.Write(big)
		if err == nil && n != len(big) {
			err = io.ErrShortWrite
		}
		done <- err
	}()
	back := make([]byte, len(big))
	if _, err := io.ReadFull(client, back); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(back, big) {
		t.Fatal("the large write arrived altered")
	}
}

func TestRawConnOnAUnixSocket(t *testing.T) {
	c, client := rawPairOn(t, "unix", filepath.Join(sockdir.New(t, "rs"), "s"))
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 4)
	if _, err := io.ReadFull(client, got); err != nil || string(got) != "ping" {
		t.Fatalf("read %q, %v", got, err)
	}
	_ = client.Close()
	if _, err := c.Read(got); err != io.EOF {
		t.Fatalf("read after the peer closed: %v, want EOF", err)
	}
}

func TestOtherConnectionsAreLeftAlone(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	if Wrap(a) != a {
		t.Fatal("Wrap changed a connection that is not a socket")
	}
}

func TestRawConnEndsAsANetConnDoes(t *testing.T) {
	c, client := rawPair(t)

	// A read deadline is a timeout error.
	_ = c.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
	var ne net.Error
	if _, err := c.Read(make([]byte, 8)); !errors.As(err, &ne) || !ne.Timeout() || !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read past its deadline: %v, want a timeout", err)
	}
	_ = c.SetReadDeadline(time.Time{})

	// The peer's close is EOF.
	_ = client.Close()
	if n, err := c.Read(make([]byte, 8)); n != 0 || err != io.EOF {
		t.Fatalf("read after the peer closed: %d, %v; want 0, EOF", n, err)
	}
	// Writing to it fails, sooner or later (the first write may be taken
	// before the peer's reset arrives), as a net.OpError.
	var err error
	for i := 0; i < 100 && err == nil; i++ {
		_, err = c.Write([]byte("x"))
	}
	var oe *net.OpError
	if !errors.As(err, &oe) || oe.Op != "write" {
		t.Fatalf("writing to a closed peer: %v, want a write OpError", err)
	}
}

func TestRawConnCloseEndsAPendingRead(t *testing.T) {
	c, _ := rawPair(t)
	done := make(chan error, 1)
	go func() {
		_, err := c.Read(make([]byte, 8))
		done <- err
	}()
	// The read is parked in the poller or about to be; Close ends it either way.
	_ = c.Close()
	select {
	case err := <-done:
		if !errors.Is(err, net.ErrClosed) {
			t.Fatalf("read ended by Close: %v, want net.ErrClosed", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not end the pending read")
	}
}

func TestRawConnAllocatesNothing(t *testing.T) {
	c, client := rawPair(t)
	out, in := []byte("frame"), make([]byte, 5)
	allocs := testing.AllocsPerRun(100, func() {
		if _, err := c.Write(out); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(client, in); err != nil {
			t.Fatal(err)
		}
		if _, err := client.Write(out); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(c, in); err != nil {
			t.Fatal(err)
		}
	})
	if allocs != 0 {
		t.Fatalf("a write and a read on a rawConn allocate %.1f times, want 0", allocs)
	}
}

func TestFileAppendsWholeAndAllocatesNothing(t *testing.T) {
	path := filepath.Join(t.TempDir(), "lines")
	of, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	f, err := NewFile(of)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	line := []byte("one line\n")
	allocs := testing.AllocsPerRun(100, func() {
		if n, err := f.Write(line); err != nil || n != len(line) {
			t.Fatalf("Write = %d, %v; want %d, nil", n, err, len(line))
		}
	})
	if allocs != 0 {
		t.Fatalf("a write on a File allocates %.1f times, want 0", allocs)
	}
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	// AllocsPerRun runs the function once more than it counts.
	if want := bytes.Repeat(line, 101); !bytes.Equal(got, want) {
		t.Fatalf("the file holds %d bytes, want %d: %q", len(got), len(want), got)
	}
}

func TestFileWriteFailsAsOSFileDoes(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ro")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	of, err := os.Open(path) // read-only: write(2) answers EBADF
	if err != nil {
		t.Fatal(err)
	}
	f, err := NewFile(of)
	if err != nil {
		t.Fatal(err)
	}
	_, err = f.Write([]byte("x"))
	var pe *os.PathError
	if !errors.As(err, &pe) || pe.Op != "write" || pe.Path != path || !errors.Is(err, syscall.EBADF) {
		t.Fatalf("a write to a read-only file answered %v, want a write PathError naming %s with EBADF", err, path)
	}
	_ = f.Close()
	if _, err := f.Write([]byte("x")); !errors.As(err, &pe) || pe.Path != path {
		t.Fatalf("a write after Close answered %v, want a PathError naming %s", err, path)
	}
}
