package wire

import (
	"context"
	"net"
)

// connKey carries the accepted connection in a request's context, for the
// socket checks of a direct write: WithConn is the HTTP server's
// ConnContext (gateway.ConnContext), ConnOf reads it.
type connKey struct{}

// WithConn is ctx carrying c, the connection its request came over.
func WithConn(ctx context.Context, c net.Conn) context.Context {
	return context.WithValue(ctx, connKey{}, c)
}

// ConnOf is the connection r's context came over, and whether it has one.
func ConnOf(ctx context.Context) (c net.Conn, ok bool) {
	c, ok = ctx.Value(connKey{}).(net.Conn)
	return c, ok
}

// PeerHost is a remote address without its port: the subject of the lines
// logbound bounds per peer.
func PeerHost(remote string) string {
	if host, _, err := net.SplitHostPort(remote); err == nil {
		return host
	}
	return remote
}
