package spawnclient

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/credentials"

	"github.com/nexus-broker/nexus-broker/internal/rawsock"
	"github.com/nexus-broker/nexus-broker/internal/safedir"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc"
)

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
	// Raw reads and writes, as spawnd's side (spawnrpc's server handshake).
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
		return spawnrpc.PeerCred{}, fmt.Errorf("%w: the socket is served by pid %d, not by spawnd pid %d of %s", spawnrpc.ErrStale, pc.PID, pid, spawnrpc.EndpointFile)
	}
	if uid >= 0 && pc.UID != uid {
		return spawnrpc.PeerCred{}, fmt.Errorf("the socket is served by uid %d, but the run directory belongs to uid %d: refusing to talk to it", pc.UID, uid)
	}
	if err := spawnrpc.ReadVerdict(ctx, conn); err != nil {
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
	f, err := safedir.Flock(path, os.O_RDONLY, 0, unix.LOCK_SH|unix.LOCK_NB)
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
