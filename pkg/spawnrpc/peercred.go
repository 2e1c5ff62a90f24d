package spawnrpc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/credentials"

	"github.com/nexus-broker/nexus-broker/internal/rawsock"
)

// Before any HTTP/2 byte, spawnd writes one verdict line on every accepted
// connection: verdictOK, or verdictDeny followed by the reason. Closing the
// connection alone would reach the refused client as "error reading server
// preface: EOF"; the line lets it say what is wrong and what to change.
// Both ends are ours, so the extra line costs no compatibility.
const (
	verdictPrefix = "nexus-spawnd "
	verdictOK     = verdictPrefix + "OK\n"
	verdictDeny   = verdictPrefix + "DENY "
	maxVerdictLen = 512
)

// SecurityProtocol names the handshake in gRPC's ProtocolInfo.
const SecurityProtocol = "nexus-peercred"

// ErrStale is wrapped by the error of an attach to a spawnd that
// spawnd.json names but that is not there any more.
var ErrStale = errors.New("spawnd.json is stale")

// ErrRefused is wrapped by every error that reports spawnd refusing this
// process's uid. Retrying does not help; running as the right user does.
var ErrRefused = errors.New("nexus-spawnd refused this connection")

// PeerCred is the kernel's account (SO_PEERCRED) of the process on the
// other end of a unix socket, taken at connect (or listen) time. On the
// server it is the grpc peer.Peer's AuthInfo.
type PeerCred struct {
	credentials.CommonAuthInfo
	PID int
	UID int
	GID int
}

// AuthType implements credentials.AuthInfo.
func (PeerCred) AuthType() string { return SecurityProtocol }

// ReadPeerCred reads SO_PEERCRED from a unix socket connection.
func ReadPeerCred(conn net.Conn) (PeerCred, error) {
	sc, ok := conn.(syscall.Conn)
	if !ok {
		return PeerCred{}, fmt.Errorf("peer credentials: %T is not a unix socket", conn)
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return PeerCred{}, err
	}
	var uc *unix.Ucred
	var uerr error
	if err := raw.Control(func(fd uintptr) {
		uc, uerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return PeerCred{}, err
	}
	if uerr != nil {
		return PeerCred{}, fmt.Errorf("peer credentials: %w", uerr)
	}
	return PeerCred{
		// The kernel vouches for the peer of a local socket; there is no
		// wire to protect.
		CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.PrivacyAndIntegrity},
		PID:            int(uc.Pid), UID: int(uc.Uid), GID: int(uc.Gid),
	}, nil
}

// serverCreds is spawnd's side: only allowedUID gets past the handshake.
type serverCreds struct {
	allowedUID int
	log        *slog.Logger
}

func (c *serverCreds) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	pc, err := ReadPeerCred(conn)
	if err != nil {
		c.log.Warn("refused spawnrpc connection: cannot read peer credentials", "err", err)
		return nil, nil, err
	}
	if pc.UID != c.allowedUID {
		reason := fmt.Sprintf("uid %d is not allowed: spawnd accepts only uid %d (spawnd.gateway_uid); run the gateway as that user or change spawnd.gateway_uid", pc.UID, c.allowedUID)
		// Serve's own readiness probe (see probeAccepting) is refused like
		// anyone else when spawnd's uid is not the gateway's; it is not an
		// intruder, so it is not logged as one.
		if pc.PID != os.Getpid() {
			c.log.Warn("refused spawnrpc connection", "peer_uid", pc.UID, "peer_pid", pc.PID, "allowed_uid", c.allowedUID)
		}
		_, _ = io.WriteString(conn, verdictDeny+reason+"\n")
		return nil, nil, fmt.Errorf("peer uid %d pid %d refused", pc.UID, pc.PID)
	}
	if _, err := io.WriteString(conn, verdictOK); err != nil {
		return nil, nil, err
	}
	// An RPC reaches a spawnd that is idle between claims: raw reads and
	// writes keep it from waking the runtime's monitor thread each time.
	return rawsock.Wrap(conn), pc, nil
}

func (c *serverCreds) ClientHandshake(context.Context, string, net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return nil, nil, errors.New("spawnrpc: server credentials used on a client")
}

func (c *serverCreds) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: SecurityProtocol}
}

func (c *serverCreds) Clone() credentials.TransportCredentials { cp := *c; return &cp }

func (c *serverCreds) OverrideServerName(string) error { return nil }

// ReadVerdict reads spawnd's verdict byte by byte: the server's HTTP/2
// preface follows it on the same connection and must stay unread.
func ReadVerdict(ctx context.Context, conn net.Conn) error {
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
	for len(line) < maxVerdictLen {
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
	case s == verdictOK:
		return nil
	case strings.HasPrefix(s, verdictDeny):
		return fmt.Errorf("%w: %s", ErrRefused, strings.TrimSpace(strings.TrimPrefix(s, verdictDeny)))
	default:
		return fmt.Errorf("the socket's server is not nexus-spawnd (handshake %q)", bytes.TrimSpace(line))
	}
}
