package spawnclient

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/credentials"

	"github.com/nexus-broker/nexus-broker/internal/rawsock"
	"github.com/nexus-broker/nexus-broker/internal/safedir"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc"
)

// ErrStale is wrapped by the error of an attach to a spawnd that
// spawnd.json names but that is not there any more.
var ErrStale = errors.New("spawnd.json is stale")

// ErrRefused is wrapped by every error that reports spawnd refusing this
// process's uid. Retrying does not help; running as the right user does.
var ErrRefused = errors.New("nexus-spawnd refused this connection")

// clientCreds is the gateway's side: read spawnd's verdict, and check that
// the socket is served by the spawnd that spawnd.json names (pid) running
// as the owner of the run directory (uid). A socket path can outlive its
// server; a pid can be reused; the kernel's peer credentials cannot lie.
type clientCreds struct {
	pid int
	uid int
}

func (c *clientCreds) ClientHandshake(ctx context.Context, _ string, conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	pc, err := checkServer(ctx, conn, c.pid, c.uid)
	if err != nil {
		return nil, nil, err
	}
	// Raw reads and writes, as on every other socket of the gateway.
	return rawsock.Wrap(conn), pc, nil
}

func (c *clientCreds) ServerHandshake(net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return nil, nil, errors.New("spawnclient: client credentials used on a server")
}

func (c *clientCreds) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: spawnrpc.SecurityProtocol}
}

func (c *clientCreds) Clone() credentials.TransportCredentials { cp := *c; return &cp }

func (c *clientCreds) OverrideServerName(string) error { return nil }

// checkServer verifies the server end of conn (pid and uid, each skipped
// when < 0) and reads its verdict line.
func checkServer(ctx context.Context, conn net.Conn, pid, uid int) (spawnrpc.PeerCred, error) {
	pc, err := spawnrpc.ReadPeerCred(conn)
	if err != nil {
		return spawnrpc.PeerCred{}, err
	}
	if pid >= 0 && pc.PID != pid {
		return spawnrpc.PeerCred{}, fmt.Errorf("%w: the socket is served by pid %d, not by spawnd pid %d of %s", ErrStale, pc.PID, pid, spawnrpc.EndpointFile)
	}
	if uid >= 0 && pc.UID != uid {
		return spawnrpc.PeerCred{}, fmt.Errorf("the socket is served by uid %d, but the run directory belongs to uid %d: refusing to talk to it", pc.UID, uid)
	}
	if err := readVerdict(ctx, conn); err != nil {
		return spawnrpc.PeerCred{}, err
	}
	return pc, nil
}

// checkRunDir is the gateway's view of spawnrpc.PrepareRunDir: the directory must be
// a real directory nobody but its owner can write. In a world-writable
// parent (the /tmp default) anyone could have created it first, so there
// it must also be ours or root's. It returns the owner, the uid spawnd is
// expected to run as.
func checkRunDir(runDir string) (owner int, err error) {
	st, err := os.Lstat(runDir)
	if err != nil {
		return -1, err
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	if !st.IsDir() || !ok {
		return -1, fmt.Errorf("run directory %s is not a directory; remove it or set spawnd.run_dir", runDir)
	}
	uid := int(sys.Uid)
	if uid != 0 && uid != os.Getuid() && uid != os.Geteuid() {
		parent, err := os.Stat(filepath.Dir(runDir))
		if err != nil {
			return -1, err
		}
		if parent.Mode().Perm()&0o002 != 0 {
			return -1, fmt.Errorf("run directory %s is owned by uid %d, neither root nor this user, in world-writable %s: refusing to trust a socket in it; set spawnd.run_dir", runDir, uid, filepath.Dir(runDir))
		}
	}
	if st.Mode().Perm()&0o022 != 0 {
		return -1, fmt.Errorf("run directory %s is writable by group or others (mode %v): refusing to trust a socket in it; chmod 0750 it", runDir, st.Mode().Perm())
	}
	return int(sys.Uid), nil
}

// serveLockHolder reports whether some spawnd holds runDir's serve lock,
// and the pid it wrote there. It needs only read access, so an unprivileged
// gateway can ask it about a root spawnd.
func serveLockHolder(runDir string) (held bool, pid int) {
	path := filepath.Join(runDir, spawnrpc.ServeLockFile)
	f, err := flock(path, os.O_RDONLY, 0, unix.LOCK_SH|unix.LOCK_NB)
	if err == nil {
		f.Close()
		return false, 0
	}
	if !errors.Is(err, unix.EWOULDBLOCK) {
		return false, 0
	}
	f, err = safedir.OpenFile(path, os.O_RDONLY, 0)
	if err != nil {
		return true, 0
	}
	defer f.Close()
	pid, _ = strconv.Atoi(safedir.ReadPid(f))
	return true, pid
}

// readVerdict reads spawnd's verdict byte by byte: the server's HTTP/2
// preface follows it on the same connection and must stay unread.
func readVerdict(ctx context.Context, conn net.Conn) error {
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(10 * time.Second)
	}
	if err := conn.SetReadDeadline(deadline); err != nil {
		return err
	}
	defer conn.SetReadDeadline(time.Time{})
	var line []byte
	b := make([]byte, 1)
	for len(line) < spawnrpc.MaxVerdictLen {
		if _, err := conn.Read(b); err != nil {
			if len(line) == 0 && errors.Is(err, io.EOF) {
				return fmt.Errorf("%w: spawnd closed the connection without a verdict", ErrStale)
			}
			return fmt.Errorf("read spawnd's handshake: %w", err)
		}
		if b[0] == '\n' {
			line = append(line, '\n')
			break
		}
		line = append(line, b[0])
	}
	s := string(line)
	switch {
	case s == spawnrpc.VerdictOK:
		return nil
	case strings.HasPrefix(s, spawnrpc.VerdictDeny):
		return fmt.Errorf("%w: %s", ErrRefused, strings.TrimSpace(strings.TrimPrefix(s, spawnrpc.VerdictDeny)))
	default:
		return fmt.Errorf("the socket's server is not nexus-spawnd (handshake %q)", bytes.TrimSpace(line))
	}
}
