package brokerd

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/user"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/nexus-broker/nexus-broker/internal/auth"
	"github.com/nexus-broker/nexus-broker/internal/config"
	"github.com/nexus-broker/nexus-broker/internal/gateway"
	"github.com/nexus-broker/nexus-broker/internal/httpapi"
)

// listenProxy opens auth.proxy_listen: a unix socket of mode 0660 and
// group gid.
func listenProxy(path string, gid int) (*net.UnixListener, error) {
	return listenSocket(path, "auth.proxy_listen", gid, 0o660)
}

// listenSocket opens a unix socket at path of mode and group gid (-1: the
// process's). It is bound in a private directory beside path, given its
// mode and group, and only then renamed into place, so no process can
// connect while it is still open to more than it should be. An old socket
// at path (a gateway that died) is replaced; anything else there is an
// error naming key.
func listenSocket(path, key string, gid int, mode os.FileMode) (*net.UnixListener, error) {
	if st, err := os.Lstat(path); err == nil {
		if st.Mode()&os.ModeSocket == 0 {
			return nil, fmt.Errorf("%s: %s exists and is not a socket; remove it or choose another path", key, path)
		}
	}
	// Short: the bound path must fit the socket path limit too.
	tmp, err := os.MkdirTemp(filepath.Dir(path), ".s-")
	if err != nil {
		return nil, fmt.Errorf("%s: %w", key, err)
	}
	defer os.RemoveAll(tmp)
	bound := filepath.Join(tmp, "s")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: bound, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("%s: %w", key, err)
	}
	ln.SetUnlinkOnClose(false)
	for _, step := range []func() error{
		func() error { return os.Chown(bound, -1, gid) },
		func() error { return os.Chmod(bound, mode) },
		func() error { return os.Rename(bound, path) },
	} {
		if err := step(); err != nil {
			ln.Close()
			return nil, fmt.Errorf("%s: %w", key, err)
		}
	}
	return ln, nil
}

// proxyGroup resolves auth.proxy_listen_group (a name or a gid); unset, the
// gateway's own group.
func proxyGroup(name string) (int, error) {
	if name == "" {
		return os.Getegid(), nil
	}
	g, err := user.LookupGroup(name)
	if err != nil {
		if g, err = user.LookupGroupId(name); err != nil {
			return 0, fmt.Errorf("auth.proxy_listen_group: %q is neither a group name nor a gid of this host", name)
		}
	}
	return strconv.Atoi(g.Gid)
}

// peerLogger logs the peer of each connection on auth.proxy_listen once:
// its uid, gid and pid from SO_PEERCRED, the kernel's word on who the
// proxy is.
type peerLogger struct {
	*net.UnixListener
	path string
	log  *slog.Logger
}

func (l peerLogger) Accept() (net.Conn, error) {
	c, err := l.UnixListener.AcceptUnix()
	if err != nil {
		return nil, err
	}
	attrs := []any{"proxy_listen", l.path}
	if rc, err := c.SyscallConn(); err == nil {
		var cred *unix.Ucred
		var cerr error
		if err := rc.Control(func(fd uintptr) { cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) }); err == nil && cerr == nil {
			attrs = append(attrs, "peer_uid", cred.Uid, "peer_gid", cred.Gid, "peer_pid", cred.Pid)
		}
	}
	l.log.Info("proxy connection", attrs...)
	return c, nil
}

// serveProxy serves h on auth.proxy_listen, marking its requests as the
// proxy's (auth.OnProxySocket); a Serve error goes to serveErr.
func serveProxy(a *config.Auth, h http.Handler, log *slog.Logger, serveErr chan<- error) (*http.Server, error) {
	gid, err := proxyGroup(a.ProxyListenGroup)
	if err != nil {
		return nil, err
	}
	ln, err := listenProxy(a.ProxyListen, gid)
	if err != nil {
		return nil, err
	}
	srv := httpapi.Server(h)
	conn := srv.ConnContext
	srv.ConnContext = func(ctx context.Context, c net.Conn) context.Context {
		return auth.OnProxySocket(conn(ctx, c))
	}
	log.Info("proxy_headers socket listening", "proxy_listen", a.ProxyListen, "mode", "0660", "gid", gid)
	go func() {
		if err := srv.Serve(gateway.Listener(peerLogger{ln, a.ProxyListen, log})); err != http.ErrServerClosed {
			serveErr <- err
		}
	}()
	return srv, nil
}
