package gateway

import (
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/config/core"
	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/streamlog"
	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/wire"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// closingClient is an attached client that records how it was closed.
type closingClient struct{ closing *CloseReq }

func (c *closingClient) place(*streamlog.Cursor, *brokerframe.StreamGap) {}
func (c *closingClient) notify(bool)                                     {}
func (c *closingClient) flushHeld()                                      {}
func (c *closingClient) finish(code int, reason string)                  { c.close(code, reason) }
func (c *closingClient) displace()                                       { c.close(wire.CodeSuperseded, wire.CloseSuperseded) }
func (c *closingClient) goAway()                                         { c.close(1001, wire.CloseRestarting) }
func (c *closingClient) close(code int, reason string) {
	if c.closing == nil {
		c.closing = &CloseReq{Code: code, Reason: reason}
	}
}

// TestTheLaterAcceptedClientWinsWhateverTheAttachOrder: two connections
// accepted one after the other may reach attachClient in either order (each
// is served on its own goroutine after its handshake was answered); the one
// accepted later stays attached and the earlier is closed with 4501.
func TestTheLaterAcceptedClientWinsWhateverTheAttachOrder(t *testing.T) {
	g := bareGateway()
	l := g.newLease("L", "", core.ReservedEntry, time.Now())
	older, newer := &closingClient{}, &closingClient{}
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
	if n := g.m.ClientEvictions.Load(); n != 1 {
		t.Errorf("client_evictions_total %d, want 1", n)
	}
}
