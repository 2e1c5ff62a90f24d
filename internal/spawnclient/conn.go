package spawnclient

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"

	"github.com/hashicorp/go-plugin"
	"github.com/hashicorp/go-plugin/runner"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/nexus-broker/nexus-broker/internal/rawsock"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// conn is one attachment to one spawnd process.
type conn struct {
	ep     spawnrpc.Endpoint
	pc     *plugin.Client
	gc     *plugin.GRPCClient
	api    *RPC
	runner *pidfdRunner

	stop      context.CancelFunc
	broken    chan struct{}
	breakOnce sync.Once
	why       string
}

// attach connects to ep through go-plugin's reattach path.
func (c *Client) attach(ctx context.Context, ep spawnrpc.Endpoint) (*conn, error) {
	if ep.Protocol != string(plugin.ProtocolGRPC) || ep.Network != "unix" {
		return nil, fmt.Errorf("%s describes a %s server on %s; nexus-spawnd serves grpc on unix: is another program using run directory %s?", spawnrpc.EndpointFile, ep.Protocol, ep.Network, c.opts.RunDir)
	}
	// go-plugin's reattach skips its version negotiation entirely.
	if ep.ProtocolVersion != spawnrpc.ProtocolVersion {
		return nil, fmt.Errorf("nexus-spawnd pid %d speaks spawnrpc protocol version %d, this gateway version %d: run nexus-broker and nexus-spawnd from the same release", ep.Pid, ep.ProtocolVersion, spawnrpc.ProtocolVersion)
	}
	owner, err := checkRunDir(c.opts.RunDir)
	if err != nil {
		return nil, err
	}
	r, err := openPidfdRunner(ep.Pid)
	if err != nil {
		return nil, err
	}
	// Check liveness, identity and our admission on a plain connection
	// first: gRPC would turn each of them into a retrying, vague
	// "connection error" on the first call.
	if err := probe(ctx, ep, owner); err != nil {
		r.detach()
		return nil, err
	}
	pc := plugin.NewClient(&plugin.ClientConfig{
		HandshakeConfig: spawnrpc.Handshake,
		Plugins:         clientPlugins(laneDialer(ep, owner)),
		Reattach: &plugin.ReattachConfig{
			Protocol:        plugin.ProtocolGRPC,
			ProtocolVersion: ep.ProtocolVersion,
			Addr:            &net.UnixAddr{Net: "unix", Name: ep.Addr},
			Pid:             ep.Pid,
			ReattachFunc:    func() (runner.AttachedRunner, error) { return r, nil },
		},
		AllowedProtocols: []plugin.Protocol{plugin.ProtocolGRPC},
		Logger:           c.hclog,
		GRPCDialOptions:  dialOptions(ep.Pid, owner),
	})
	cn := &conn{ep: ep, pc: pc, runner: r, broken: make(chan struct{})}
	if err := cn.open(ctx); err != nil {
		cn.close()
		return nil, err
	}
	if err := c.sameConfig(ctx, cn); err != nil {
		cn.close()
		return nil, err
	}
	monCtx, stop := context.WithCancel(context.Background())
	cn.stop = stop
	go cn.monitor(monCtx)
	return cn, nil
}

// ErrOtherConfig is wrapped by the error of an attach to a spawnd that runs
// another config file than the gateway's, or a version of it that spawnd
// cannot switch to without a restart. Launching another spawnd would not
// help: this one holds the run directory.
var ErrOtherConfig = errors.New("nexus-spawnd runs another configuration")

// sameConfig checks that the spawnd behind cn runs the gateway's config
// file: same path and digest, it proceeds; same path and another digest
// (the operator edited the file and restarted the gateway), spawnd is
// reloaded onto the gateway's version, validate-then-swap as SIGHUP does;
// another path, or a change spawnd reads only at boot, refuses the attach.
//
// A re-attach with another digest only warns: the gateway has run for a
// while, and spawnd (restarted, so reading the file as it is now) runs an
// edit the gateway was never sent SIGHUP for. Reloading spawnd back onto
// the gateway's version cannot work (the file no longer has it), and
// refusing would leave the gateway without spawnd for good.
func (c *Client) sameConfig(ctx context.Context, cn *conn) error {
	c.mu.Lock()
	digest := c.digest
	c.mu.Unlock()
	if digest == "" {
		return nil
	}
	st, err := cn.api.Status(ctx, &spawnpb.StatusRequest{})
	if err != nil {
		return fmt.Errorf("asking nexus-spawnd pid %d which config it runs: %w", cn.ep.Pid, err)
	}
	switch {
	case st.ConfigPath != c.opts.ConfigPath:
		return fmt.Errorf("%w: nexus-spawnd pid %d serving run directory %s runs %s, this gateway %s; "+
			"give each config its own spawnd.run_dir, or stop that spawnd and start this gateway again (nexus-broker -stop -config %s releases its leases, "+
			"after which a spawnd a gateway launched exits within 10 s)",
			ErrOtherConfig, cn.ep.Pid, c.opts.RunDir, st.ConfigPath, c.opts.ConfigPath, st.ConfigPath)
	case st.ConfigDigest == digest || c.opts.NoReload:
		return nil
	case c.attached:
		c.log.Warn("nexus-spawnd runs another version of the config file than this gateway: it was edited and nexus-spawnd restarted since the gateway last read it; "+
			"send the gateway SIGHUP to apply the file to both", "pid", cn.ep.Pid, "config", c.opts.ConfigPath)
		return nil
	}
	res, err := cn.api.Reload(ctx, &spawnpb.ReloadRequest{ConfigDigest: digest, RefuseBootOnly: true})
	if err != nil {
		return fmt.Errorf("reloading nexus-spawnd pid %d onto the edited %s: %w", cn.ep.Pid, c.opts.ConfigPath, err)
	}
	if !res.Applied {
		return fmt.Errorf("%w: nexus-spawnd pid %d runs an earlier version of %s and cannot switch to this one: %s",
			ErrOtherConfig, cn.ep.Pid, c.opts.ConfigPath, res.Error)
	}
	c.log.Info("nexus-spawnd reloaded onto the edited config", "pid", cn.ep.Pid, "config", c.opts.ConfigPath, "changed", strings.Join(res.Changed, ","))
	return nil
}

// open runs go-plugin's client start, which dials and opens its stdio
// stream on a context of its own, so it is raced against ctx; if ctx wins,
// close (detaching the runner) ends the start.
func (cn *conn) open(ctx context.Context) error {
	type result struct {
		proto plugin.ClientProtocol
		err   error
	}
	ch := make(chan result, 1)
	go func() {
		p, err := cn.pc.Client()
		ch <- result{p, err}
	}()
	var res result
	select {
	case res = <-ch:
	case <-ctx.Done():
		cn.runner.detach()
		res = <-ch
		if res.err == nil {
			res.err = ctx.Err()
		}
		if gc, ok := res.proto.(*plugin.GRPCClient); ok {
			cn.gc = gc
		}
		return res.err
	}
	if res.err != nil {
		return fmt.Errorf("attach to nexus-spawnd pid %d: %w", cn.ep.Pid, res.err)
	}
	gc, ok := res.proto.(*plugin.GRPCClient)
	if !ok {
		return fmt.Errorf("attach to nexus-spawnd pid %d: go-plugin returned a %T, not a gRPC client", cn.ep.Pid, res.proto)
	}
	cn.gc = gc
	raw, err := gc.Dispense(spawnrpc.PluginName)
	if err != nil {
		return err
	}
	cn.api = raw.(*RPC)
	// go-plugin's start treats an unreachable server as "no stdio" and
	// succeeds; only a round trip proves the connection.
	if err := cn.health(ctx); err != nil {
		return fmt.Errorf("attach to nexus-spawnd pid %d: %w", cn.ep.Pid, err)
	}
	return nil
}

// health is a gRPC health check, as go-plugin's Ping, but bounded.
func (cn *conn) health(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, healthTimeout)
	defer cancel()
	_, err := grpc_health_v1.NewHealthClient(cn.gc.Conn).Check(ctx, &grpc_health_v1.HealthCheckRequest{Service: plugin.GRPCServiceName})
	return err
}

// monitor marks the connection broken when spawnd exits (pidfd) or gRPC
// gives up on the socket (TRANSIENT_FAILURE).
func (cn *conn) monitor(ctx context.Context) {
	go func() {
		select {
		case <-cn.runner.done:
			if cn.runner.exited() {
				cn.markBroken(fmt.Sprintf("spawnd pid %d exited", cn.ep.Pid))
			}
		case <-ctx.Done():
		}
	}()
	for {
		s := cn.gc.Conn.GetState()
		if s == connectivity.TransientFailure {
			cn.markBroken("connection to " + cn.ep.Addr + " failed")
			return
		}
		if !cn.gc.Conn.WaitForStateChange(ctx, s) {
			return
		}
	}
}

// lost rewrites the error of a call that cn's breaking cut short: the
// caller sees codes.Unavailable and why, not the Canceled of our closing
// the connection under it.
func (cn *conn) lost(ctx context.Context, err error) error {
	if err == nil || ctx.Err() != nil {
		return err
	}
	select {
	case <-cn.broken:
		if code := status.Code(err); code == codes.Canceled || code == codes.Unavailable {
			return status.Errorf(codes.Unavailable, "lost connection to nexus-spawnd: %s (%v)", cn.why, status.Convert(err).Message())
		}
	default:
	}
	return err
}

func (cn *conn) markBroken(why string) {
	cn.breakOnce.Do(func() {
		cn.why = why
		close(cn.broken)
	})
}

// close detaches without a word to spawnd. go-plugin's Client.Kill is not
// used: it would send spawnd a Shutdown and then kill the runner.
func (cn *conn) close() {
	if cn.stop != nil {
		cn.stop()
	}
	if cn.api != nil {
		cn.api.Close()
	}
	if cn.gc != nil {
		_ = cn.gc.Conn.Close()
	}
	cn.runner.detach()
}

// probe connects to ep once and checks who serves it and whether it admits
// us.
func probe(ctx context.Context, ep spawnrpc.Endpoint, owner int) error {
	nc, err := dialChecked(ctx, ep, owner)
	if err == nil {
		nc.Close()
	}
	return err
}

// dialChecked connects to ep, checks who serves it and reads its verdict.
func dialChecked(ctx context.Context, ep spawnrpc.Endpoint, owner int) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	var d net.Dialer
	nc, err := d.DialContext(ctx, ep.Network, ep.Addr)
	switch {
	case errors.Is(err, unix.ECONNREFUSED) || errors.Is(err, unix.ENOENT):
		return nil, fmt.Errorf("%w: nobody accepts on %s: %v", ErrStale, ep.Addr, err)
	case errors.Is(err, unix.EACCES):
		return nil, fmt.Errorf("connect to nexus-spawnd at %s: %w; run the gateway as a member of group spawnd.socket_gid", ep.Addr, err)
	case err != nil:
		return nil, fmt.Errorf("connect to nexus-spawnd at %s: %w", ep.Addr, err)
	}
	if _, err := checkServer(ctx, nc, ep.Pid, owner); err != nil {
		nc.Close()
		return nil, err
	}
	return nc, nil
}

// laneDialer opens a lane's connection to ep, checked as probe checks one.
func laneDialer(ep spawnrpc.Endpoint, owner int) LaneDialer {
	return func(ctx context.Context) (net.Conn, error) {
		nc, err := dialChecked(ctx, ep, owner)
		if err != nil {
			return nil, err
		}
		// Raw reads and writes, as on every other socket of the gateway.
		return rawsock.Wrap(nc), nil
	}
}

// dialOptions are the gRPC options of every connection to spawnd (pid,
// running as uid). The credentials replace go-plugin's insecure ones: the
// last option wins. spawnrpc.Codec keeps protobuf's reflection off the
// RPCs and the health probe (docs/performance.md).
func dialOptions(pid, uid int) []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithTransportCredentials(&clientCreds{pid: pid, uid: uid}),
		grpc.WithStaticStreamWindowSize(spawnrpc.StaticWindow),
		grpc.WithStaticConnWindowSize(spawnrpc.StaticWindow),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(spawnrpc.Codec{})),
	}
}
