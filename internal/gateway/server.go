package gateway

import (
	"net"
	"net/http"

	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/wire"
)

// TestHTTPTimeoutsEnv shortens the HTTP bounds for tests (see Server).
const TestHTTPTimeoutsEnv = wire.TestHTTPTimeoutsEnv

// Server is the broker's HTTP server over h, with its body and keep-alive
// bounds.
func Server(h http.Handler) *http.Server { return wire.Server(h) }

// Listener makes every connection ln accepts combine its writes; serve
// Server on it.
func Listener(ln net.Listener) net.Listener { return wire.Listener(ln) }
