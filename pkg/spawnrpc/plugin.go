// Package spawnrpc is the transport between the gateway and nexus-spawnd:
// the go-plugin glue around the gRPC service in spawnpb, spawnd's serving
// side (Serve, which publishes its reattach config to spawnd.json in the run
// directory and checks every connection with SO_PEERCRED), the lanes that
// carry Spawn and Record beside gRPC (lane.go: their frames, and spawnd's
// end of them; Verbs puts them in a unary call's shape), and what both
// sides share. The gateway attaches with internal/spawnclient, which holds
// its end of the lanes and which spawnd does not link. The verbs live in
// internal/spawnd.
//
// Both processes link it, so it may import spawnpb and the helpers both
// share, none of the gateway's layers nor anything else gateway-side
// (internal/gateway/layers_test.go and cmd/nexus-spawnd's deps test check
// it).
package spawnrpc

import (
	"context"
	"errors"

	"github.com/hashicorp/go-plugin"
	"google.golang.org/grpc"

	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// The go-plugin handshake. Reattaching skips its negotiation, so the
// gateway compares ProtocolVersion with spawnd.json's itself: bump it on an
// incompatible change to the service.
const (
	MagicCookieKey   = "NEXUS_SPAWND_PLUGIN"
	MagicCookieValue = "8f1c2b7e-nexus-spawnd-9d43"
	// 2: Spawn and List answer the verifier the gateway checks register
	// frames with (a gateway of 2 refuses every registration against a
	// spawnd of 1, so it must not attach to one).
	// 3: Spawn and Record are lanes, gRPC streams a gateway of 2 does
	// not open.
	// 4: the lanes are connections of their own (lane.go), which a
	// spawnd of 3 does not serve.
	ProtocolVersion = 4
	// PluginName is the one plugin spawnd serves.
	PluginName = "spawner"
)

// StaticWindow is the flow-control window, per stream and connection, both
// sides set instead of gRPC's dynamic one, whose bandwidth probe (a PING and
// ACK per RPC) cost each process two wake-ups per RPC to tune a window
// messages this small (a claim's config, 1 MiB by default) never fill.
const StaticWindow = 1 << 20

// Handshake is the go-plugin handshake config shared by both sides.
var Handshake = plugin.HandshakeConfig{
	ProtocolVersion:  ProtocolVersion,
	MagicCookieKey:   MagicCookieKey,
	MagicCookieValue: MagicCookieValue,
}

// SpawnerPlugin is the go-plugin plugin for the Spawner service, as spawnd
// serves it; the gateway's (internal/spawnclient) embeds it and dispenses
// its own client.
type SpawnerPlugin struct {
	plugin.NetRPCUnsupportedPlugin
	Impl spawnpb.SpawnerServer
}

var _ plugin.GRPCPlugin = (*SpawnerPlugin)(nil)

// GRPCServer registers Impl on the server go-plugin built.
func (p *SpawnerPlugin) GRPCServer(_ *plugin.GRPCBroker, s *grpc.Server) error {
	spawnpb.RegisterSpawnerServer(s, p.Impl)
	return nil
}

// GRPCClient is the gateway's to implement: spawnd dispenses no client.
func (p *SpawnerPlugin) GRPCClient(context.Context, *plugin.GRPCBroker, *grpc.ClientConn) (any, error) {
	return nil, errors.New("spawnrpc: nexus-spawnd's plugin has no client side (internal/spawnclient's has)")
}

// Plugins is what spawnd registers.
func Plugins(impl spawnpb.SpawnerServer) plugin.PluginSet {
	return plugin.PluginSet{PluginName: &SpawnerPlugin{Impl: impl}}
}
