package gateway

import (
	"context"
	"net"

	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/wire"
)

// Listener makes every connection ln accepts combine its writes; serve the
// HTTP layer's server (internal/httpapi.Server) on it.
func Listener(ln net.Listener) net.Listener { return wire.Listener(ln) }

// ConnContext is the HTTP server's ConnContext: a request's context
// carries the connection it came over, which StreamConn and the core's
// sockets read.
func ConnContext(ctx context.Context, c net.Conn) context.Context { return wire.WithConn(ctx, c) }
