// Package spawnrpc is the transport between the gateway (nexus-broker) and
// the privileged spawn daemon (nexus-spawnd): the go-plugin glue around the
// generated gRPC service in spawnpb, spawnd's serving side, and what both
// sides share (the run directory, spawnd.json, the handshake).
//
// spawnd serves standalone (Serve): it runs go-plugin's server in test mode,
// which hands the server its own reattach config instead of printing it to a
// host that launched it, and publishes that config to spawnd.json in its run
// directory. The gateway attaches from that file with internal/spawnclient,
// which spawnd does not link. Every connection is checked with SO_PEERCRED.
//
// Nothing here knows what a lease is: the verbs live in internal/spawnd.
package spawnrpc

import (
	"context"

	"github.com/hashicorp/go-plugin"
	"google.golang.org/grpc"

	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// The go-plugin handshake of nexus-spawnd. Reattaching skips go-plugin's
// cookie and version negotiation, so Dial compares ProtocolVersion with
// spawnd.json's protocol_version itself; bump it on an incompatible change
// to the service.
const (
	MagicCookieKey   = "NEXUS_SPAWND_PLUGIN"
	MagicCookieValue = "8f1c2b7e-nexus-spawnd-9d43"
	ProtocolVersion  = 1
	// PluginName is the one plugin spawnd serves.
	PluginName = "spawner"
)

// StaticWindow is the flow-control window, per stream and per connection,
// that both sides set instead of gRPC's dynamic one. The dynamic window is
// tuned by a bandwidth-delay probe: a PING after every DATA frame that
// arrives while none is outstanding, and its ACK, so each RPC cost each
// process two more wake-ups than its request and answer, to tune a window
// messages this small (at most a claim's config, 1 MiB by default) never
// fill. A message larger than the window still flows, a window at a time.
const StaticWindow = 1 << 20

// Handshake is the go-plugin handshake config shared by both sides.
var Handshake = plugin.HandshakeConfig{
	ProtocolVersion:  ProtocolVersion,
	MagicCookieKey:   MagicCookieKey,
	MagicCookieValue: MagicCookieValue,
}

// SpawnerPlugin is the go-plugin plugin.GRPCPlugin for the Spawner service.
// Impl is only needed on the serving side.
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

// GRPCClient returns the generated client over go-plugin's connection.
func (p *SpawnerPlugin) GRPCClient(_ context.Context, _ *plugin.GRPCBroker, cc *grpc.ClientConn) (any, error) {
	return spawnpb.NewSpawnerClient(cc), nil
}

// Plugins is what both sides register: the spawner under PluginName (impl
// is nil on the gateway's side).
func Plugins(impl spawnpb.SpawnerServer) plugin.PluginSet {
	return plugin.PluginSet{PluginName: &SpawnerPlugin{Impl: impl}}
}
