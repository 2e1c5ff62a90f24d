package spawnrpc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/credentials"
)

// Before any HTTP/2 byte, spawnd writes a verdict line on every accepted
// connection: VerdictOK, or VerdictDeny and the reason, which a bare close
// would reach the client as "error reading server preface: EOF".
const (
	VerdictPrefix = "nexus-spawnd "
	VerdictOK     = VerdictPrefix + "OK\n"
	VerdictDeny   = VerdictPrefix + "DENY "
	MaxVerdictLen = 512
)

// SecurityProtocol names the handshake in gRPC's ProtocolInfo.
const SecurityProtocol = "nexus-peercred"

// PeerCred is the kernel's account (SO_PEERCRED) of the peer of a unix
// socket, taken at connect time; the server's grpc AuthInfo.
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
	lanes      *laneServer
}

func (c *serverCreds) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	pc, err := ReadPeerCred(conn)
	if err != nil {
		c.log.Warn("refused spawnrpc connection: cannot read peer credentials", "error", err)
		return nil, nil, err
	}
	if pc.UID != c.allowedUID {
		reason := fmt.Sprintf("uid %d is not allowed: spawnd accepts only uid %d (spawnd.gateway_uid); run the gateway as that user or change spawnd.gateway_uid", pc.UID, c.allowedUID)
		// Serve's own probe (probeAccepting) is no intruder to log.
		if pc.PID != os.Getpid() {
			c.log.Warn("refused spawnrpc connection", "peer_uid", pc.UID, "peer_pid", pc.PID, "allowed_uid", c.allowedUID)
		}
		_, _ = io.WriteString(conn, VerdictDeny+reason+"\n")
		return nil, nil, fmt.Errorf("peer uid %d pid %d refused", pc.UID, pc.PID)
	}
	if _, err := io.WriteString(conn, VerdictOK); err != nil {
		return nil, nil, err
	}
	// The client's first 24 bytes say what the connection carries: gRPC
	// (HTTP/2's preface, replayed to gRPC's server) or a lane.
	var pre [len(http2Preface)]byte
	if _, err := io.ReadFull(conn, pre[:]); err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) {
			err = io.EOF // a probe's close, as gRPC counts it
		}
		return nil, nil, err
	}
	if string(pre[:]) == http2Preface {
		return &prefacedConn{Conn: conn, pre: pre[:]}, pc, nil
	}
	if c.lanes != nil && c.lanes.dispatch(string(pre[:]), conn, pc) {
		return nil, nil, credentials.ErrConnDispatched
	}
	c.log.Warn("refused spawnrpc connection: it opened with neither gRPC nor a lane", "peer_pid", pc.PID, "preface", fmt.Sprintf("%q", pre[:]))
	return nil, nil, fmt.Errorf("peer pid %d opened with %q, neither gRPC nor a lane", pc.PID, pre[:])
}

// prefacedConn replays the preface ServerHandshake read to gRPC's server.
type prefacedConn struct {
	net.Conn
	pre []byte
}

func (c *prefacedConn) Read(b []byte) (int, error) {
	if len(c.pre) > 0 {
		n := copy(b, c.pre)
		c.pre = c.pre[n:]
		return n, nil
	}
	return c.Conn.Read(b)
}

func (c *serverCreds) ClientHandshake(context.Context, string, net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return nil, nil, errors.New("spawnrpc: server credentials used on a client")
}

func (c *serverCreds) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: SecurityProtocol}
}

func (c *serverCreds) Clone() credentials.TransportCredentials { cp := *c; return &cp }

func (c *serverCreds) OverrideServerName(string) error { return nil }
