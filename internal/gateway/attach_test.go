package gateway

import (
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/config/core"
	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/wire"
)

// TestTheLaterAcceptedClientWinsWhateverTheAttachOrder: two connections
// accepted one after the other may reach attachClient in either order (each
// is served on its own goroutine after its handshake was answered); the one
// accepted later stays attached and the earlier is closed with 4501.
func TestTheLaterAcceptedClientWinsWhateverTheAttachOrder(t *testing.T) {
	g := bareGateway()
	l := g.newLease("L", "", core.ReservedEntry, time.Now())
	older, newer := &relayConn{l: l, closed: make(chan struct{})}, &relayConn{l: l, closed: make(chan struct{})}
	first, second := l.clientTicket(), l.clientTicket()

	if !g.attachClient(l, newer, second, -1, "", credentialAnonymous) {
		t.Fatal("the newer connection was not attached")
	}
	if g.attachClient(l, older, first, -1, "", credentialAnonymous) {
		t.Fatal("the older connection, arriving late, was attached over the newer one")
	}
	if older.closing == nil || older.closing.Code != wire.CodeSuperseded {
		t.Errorf("the older connection was closed with %+v, want %d", older.closing, wire.CodeSuperseded)
	}
	if newer.closing != nil || l.client != newer {
		t.Errorf("the newer connection was closed (%+v) or detached", newer.closing)
	}
	if n := g.m.clientEvictions.Load(); n != 1 {
		t.Errorf("client_evictions_total %d, want 1", n)
	}
}
