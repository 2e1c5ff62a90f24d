// Package spawnclient is the gateway's side of spawnrpc: it attaches to the
// spawnd published in the run directory (checking the directory, the
// server's pid and uid, and that spawnd runs the gateway's config file),
// re-attaches across spawnd restarts behind one Client, and in development
// launches a detached spawnd when none is running. nexus-spawnd does not
// link it (cmd/nexus-spawnd's deps test keeps it so).
package spawnclient

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/go-plugin"
	"github.com/hashicorp/go-plugin/runner"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// DialOptions configures Dial.
type DialOptions struct {
	// RunDir is where spawnd publishes spawnd.json; use RunDir(cfg).
	RunDir string
	// ConfigPath is the canonical path of the gateway's config file
	// (core.Canonical). It is passed to a launched spawnd as -config, and
	// every attach checks that spawnd runs this very file.
	ConfigPath string
	// ConfigDigest is the digest of the version the gateway loaded
	// (config.Config.Digest). A spawnd running an earlier version of the
	// file is reloaded onto it on the first attach. Empty skips the
	// identity check. A Reload through Spawner that spawnd applies moves it
	// to the version reloaded.
	ConfigDigest string
	// NoReload checks only that spawnd runs ConfigPath, and never reloads
	// it onto ConfigDigest: nexus-broker -stop releases leases whatever
	// version of the file spawnd runs, an edit it could not apply included.
	NoReload bool
	// Launch (development) starts a detached spawnd when none is running,
	// and starts it again if it dies. Production leaves that to systemd.
	Launch bool
	// SpawndPath is the binary to launch; empty means nexus-spawnd beside
	// this executable, else nexus-spawnd on PATH.
	SpawndPath string
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

// Timings of attaching and re-attaching.
const (
	// launchTimeout bounds the wait for a launched spawnd to publish.
	launchTimeout = 10 * time.Second
	// healthTimeout bounds a health check; healthInterval is how often an
	// attached spawnd is checked, so an unresponsive one is noticed within
	// their sum.
	healthTimeout  = 2 * time.Second
	healthInterval = time.Second
	// Re-attach retries back off between these; a change to spawnd.json
	// cuts the wait short.
	minBackoff = 50 * time.Millisecond
	maxBackoff = 5 * time.Second
	// probeTimeout bounds the plain connection that checks a spawnd
	// before go-plugin attaches.
	probeTimeout = 5 * time.Second
)

var (
	// ErrNotRunning: no spawnd.json, or one naming a spawnd that is gone.
	ErrNotRunning = errors.New("nexus-spawnd is not running")
	// errBusy: a spawnd holds the run directory but does not answer yet
	// (starting or stopping); launching another would be refused.
	errBusy = errors.New("nexus-spawnd is starting or stopping")
)

// Client is the gateway's handle on spawnd. It outlives spawnd restarts:
// Spawner always talks to the spawnd currently published in the run
// directory, and Reconnected tells the gateway when that spawnd changed.
type Client struct {
	opts  DialOptions
	log   *slog.Logger
	hclog hclog.Logger

	ctx         context.Context // ends at Close
	cancel      context.CancelFunc
	supervised  chan struct{} // closed when the supervisor returns
	poke        chan struct{} // a call saw codes.Unavailable
	reconnected chan struct{}
	spawner     *spawner
	closeOnce   sync.Once

	// attached is set once the first attach succeeded: from then on an
	// attach is a re-attach.
	attached bool

	mu      sync.Mutex
	digest  string        // the config version this gateway runs
	cur     *conn         // nil while re-attaching
	ready   chan struct{} // closed when cur is set
	lastErr error         // why cur is nil
}

// conn is one attachment to one spawnd process.
type conn struct {
	ep     spawnrpc.Endpoint
	pc     *plugin.Client
	gc     *plugin.GRPCClient
	api    spawnpb.SpawnerClient
	runner *pidfdRunner

	stop      context.CancelFunc
	broken    chan struct{}
	breakOnce sync.Once
	why       string
}

// Dial attaches to the spawnd published in opts.RunDir, launching one first
// in Launch mode. ctx bounds only this first attach; the Client then keeps
// re-attaching until Close.
func Dial(ctx context.Context, opts DialOptions) (*Client, error) {
	if opts.RunDir == "" {
		return nil, errors.New("spawnclient.Dial: no RunDir")
	}
	if err := spawnrpc.CheckSocketPath(opts.RunDir); err != nil {
		return nil, err
	}
	log := opts.Logger
	if log == nil {
		log = slog.Default()
	}
	c := &Client{
		opts:        opts,
		log:         log,
		hclog:       spawnrpc.PluginLogger(log, func() bool { return false }),
		supervised:  make(chan struct{}),
		poke:        make(chan struct{}, 1),
		reconnected: make(chan struct{}, 1),
		ready:       make(chan struct{}),
		digest:      opts.ConfigDigest,
	}
	c.spawner = &spawner{c: c}
	c.ctx, c.cancel = context.WithCancel(context.WithoutCancel(ctx))

	cn, err := c.firstAttach(ctx)
	if err != nil {
		c.cancel()
		return nil, err
	}
	c.setConn(cn, nil)
	c.log.Info("attached to nexus-spawnd", "pid", cn.ep.Pid, "addr", cn.ep.Addr)
	c.attached = true // before supervise, the only re-attacher, starts
	go c.supervise()
	return c, nil
}

// Spawner returns the spawnd API. Each call goes to the spawnd attached at
// the time of the call; a call made while re-attaching waits, within its
// ctx, for the next spawnd. A Watch stream ends when its spawnd goes: wait
// for Reconnected and open a new one.
func (c *Client) Spawner() spawnpb.SpawnerClient { return c.spawner }

// Reconnected receives a value after each re-attach (to a restarted spawnd,
// or to the same one after its connection failed), never for the first
// attach. Values coalesce. The gateway should List and Watch again: exits
// that happened in between are only visible in List. It is closed by Close.
func (c *Client) Reconnected() <-chan struct{} { return c.reconnected }

// Endpoint returns the spawnd currently attached; the zero Endpoint while
// re-attaching.
func (c *Client) Endpoint() spawnrpc.Endpoint {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cur == nil {
		return spawnrpc.Endpoint{}
	}
	return c.cur.ep
}

// Close detaches from spawnd and stops re-attaching. It never stops spawnd
// or any instance.
func (c *Client) Close() error {
	c.closeOnce.Do(func() {
		c.cancel()
		<-c.supervised
		c.mu.Lock()
		cn := c.cur
		c.cur = nil
		c.lastErr = errors.New("client closed")
		c.mu.Unlock()
		if cn != nil {
			cn.close()
		}
		close(c.reconnected)
	})
	return nil
}

func (c *Client) setConn(cn *conn, why error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.cur = cn
	c.lastErr = why
	if cn != nil {
		close(c.ready)
	} else {
		c.ready = make(chan struct{})
	}
}

func (c *Client) setLastErr(err error) {
	c.mu.Lock()
	c.lastErr = err
	c.mu.Unlock()
}

// current waits for an attached spawnd.
func (c *Client) current(ctx context.Context) (*conn, error) {
	for {
		c.mu.Lock()
		cn, ready, why := c.cur, c.ready, c.lastErr
		c.mu.Unlock()
		if c.ctx.Err() != nil {
			return nil, status.Error(codes.Canceled, "spawnrpc: client closed")
		}
		if cn != nil {
			return cn, nil
		}
		select {
		case <-ready:
		case <-c.ctx.Done():
		case <-ctx.Done():
			code := status.FromContextError(ctx.Err()).Code()
			return nil, status.Errorf(code, "waiting for nexus-spawnd to come back: %v (last attempt: %v)", ctx.Err(), why)
		}
	}
}

// observe lets the supervisor check the connection when a call failed as
// unreachable. A spawnd that died is noticed by its pidfd at once; this
// catches a connection that failed while spawnd lives.
func (c *Client) observe(err error) {
	if status.Code(err) != codes.Unavailable {
		return
	}
	select {
	case c.poke <- struct{}{}:
	default:
	}
}

// supervise re-attaches whenever the current connection breaks.
func (c *Client) supervise() {
	defer close(c.supervised)
	// A spawnd that is alive but does not answer (stopped, or wedged) is
	// noticed by neither its pidfd nor gRPC: only asking it does.
	probe := time.NewTicker(healthInterval)
	defer probe.Stop()
	for {
		c.mu.Lock()
		cn := c.cur
		c.mu.Unlock()
		select {
		case <-c.ctx.Done():
			return
		case <-cn.broken:
		case <-c.poke:
			if !c.failsHealth(cn) {
				continue // spawnd answered: the failure was the call's own
			}
		case <-probe.C:
			if !c.failsHealth(cn) {
				continue
			}
		}
		// Calls from now on wait for the next spawnd.
		c.setConn(nil, errors.New(cn.why))
		cn.close()
		c.log.Warn("lost connection to nexus-spawnd", "pid", cn.ep.Pid, "reason", cn.why)
		next := c.reattach()
		if next == nil {
			return // closed
		}
		c.setConn(next, nil)
		c.log.Info("reattached to nexus-spawnd", "pid", next.ep.Pid, "addr", next.ep.Addr)
		select {
		case c.reconnected <- struct{}{}:
		default:
		}
	}
}

// failsHealth health-checks cn and reports whether it failed, marking it
// broken if so; false also once the Client is closing.
func (c *Client) failsHealth(cn *conn) bool {
	err := cn.health(c.ctx)
	if err == nil || c.ctx.Err() != nil {
		return false
	}
	cn.markBroken("health check failed: " + err.Error())
	return true
}

// Ready is nil while a spawnd is attached and answering, else why not: a
// caller that must not wait for spawnd (a claim) fails fast on it.
func (c *Client) Ready() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cur != nil {
		return nil
	}
	return fmt.Errorf("nexus-spawnd is not answering: %v", c.lastErr)
}

// reattach retries until a spawnd answers or the Client is closed, waking
// early whenever spawnd.json changes. It returns nil once closed.
func (c *Client) reattach() *conn {
	w := watchFile(c.opts.RunDir, spawnrpc.EndpointFile)
	defer w.Close()
	backoff := minBackoff
	var logged string
	for {
		cn, err := c.attachOrLaunch(c.ctx)
		if err == nil {
			return cn
		}
		if c.ctx.Err() != nil {
			return nil
		}
		c.setLastErr(err)
		if msg := err.Error(); msg != logged {
			c.log.Warn("nexus-spawnd not reachable yet; retrying", "error", err)
			logged = msg
		}
		t := time.NewTimer(backoff)
		select {
		case <-c.ctx.Done():
		case <-w.C:
		case <-t.C:
		}
		t.Stop()
		backoff = min(2*backoff, maxBackoff)
	}
}

// firstAttach is Dial's attach. Without Launch it tries once, so a missing
// spawnd is reported at once. With Launch it waits, up to launchTimeout,
// for a spawnd that is starting or stopping.
func (c *Client) firstAttach(ctx context.Context) (*conn, error) {
	if !c.opts.Launch {
		return c.attachPublished(ctx)
	}
	ctx, cancel := context.WithTimeout(ctx, launchTimeout)
	defer cancel()
	w := watchFile(c.opts.RunDir, spawnrpc.EndpointFile)
	defer w.Close()
	backoff := minBackoff
	for {
		cn, err := c.attachOrLaunch(ctx)
		if err == nil || !errors.Is(err, errBusy) {
			return cn, err
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("%w (waited %v)", err, launchTimeout)
		case <-w.C:
		case <-t.C:
		}
		t.Stop()
		backoff = min(2*backoff, maxBackoff)
	}
}

// attachOrLaunch attaches to the published spawnd, or in Launch mode starts
// one when there is none to attach to.
func (c *Client) attachOrLaunch(ctx context.Context) (*conn, error) {
	cn, err := c.attachPublished(ctx)
	if err == nil || !c.opts.Launch || errors.Is(err, ErrRefused) || errors.Is(err, ErrOtherConfig) || ctx.Err() != nil {
		return cn, err
	}
	return c.launchAndAttach(ctx, err)
}

// attachPublished attaches to the spawnd that spawnd.json names. Without
// Launch, an error saying spawnd is not running also says how to start it.
func (c *Client) attachPublished(ctx context.Context) (*conn, error) {
	ep, err := spawnrpc.ReadEndpoint(c.opts.RunDir)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		err = fmt.Errorf("%w for run directory %s (no %s)", ErrNotRunning, c.opts.RunDir, spawnrpc.EndpointFile)
	case errors.Is(err, fs.ErrPermission):
		// Not "not running": a spawnd may well serve there, for other users.
		err = fmt.Errorf("%w: %v, so uid %d may not reach the nexus-spawnd of run directory %s; "+
			"run as the user spawnd.gateway_uid names (or in spawnd.socket_gid's group)", ErrRefused, err, os.Getuid(), c.opts.RunDir)
	case err != nil:
		err = fmt.Errorf("%w (%w: %v)", ErrNotRunning, ErrStale, err)
	default:
		var cn *conn
		cn, err = c.attach(ctx, ep)
		if err == nil {
			return cn, nil
		}
		if errors.Is(err, ErrStale) {
			err = fmt.Errorf("%w (%w)", ErrNotRunning, err)
		}
	}
	if !c.opts.Launch && errors.Is(err, ErrNotRunning) {
		err = fmt.Errorf("%w: start `%s` first", err, c.startHint())
	}
	return nil, err
}

func (c *Client) startHint() string {
	cfg := c.opts.ConfigPath
	if cfg == "" {
		cfg = "broker.yaml"
	}
	return "nexus-spawnd -config " + cfg
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
		Plugins:         spawnrpc.Plugins(nil),
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
	cn.api = raw.(spawnpb.SpawnerClient)
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
	if cn.gc != nil {
		_ = cn.gc.Conn.Close()
	}
	cn.runner.detach()
}

// probe connects to ep once and checks who serves it and whether it admits
// us.
func probe(ctx context.Context, ep spawnrpc.Endpoint, owner int) error {
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	var d net.Dialer
	nc, err := d.DialContext(ctx, ep.Network, ep.Addr)
	switch {
	case errors.Is(err, unix.ECONNREFUSED) || errors.Is(err, unix.ENOENT):
		return fmt.Errorf("%w: nobody accepts on %s: %v", ErrStale, ep.Addr, err)
	case errors.Is(err, unix.EACCES):
		return fmt.Errorf("connect to nexus-spawnd at %s: %w; run the gateway as a member of group spawnd.socket_gid", ep.Addr, err)
	case err != nil:
		return fmt.Errorf("connect to nexus-spawnd at %s: %w", ep.Addr, err)
	}
	defer nc.Close()
	_, err = checkServer(ctx, nc, ep.Pid, owner)
	return err
}

// launchAndAttach starts a spawnd under the launch lock, so racing
// gateways start one between them, and attaches to it.
func (c *Client) launchAndAttach(ctx context.Context, why error) (*conn, error) {
	lock, err := lockLaunch(ctx, c.opts.RunDir)
	if err != nil {
		// Not "start it yourself": spawnd would prepare the directory the
		// same way, and refuse it for the same reason.
		return nil, fmt.Errorf("cannot launch nexus-spawnd for run directory %s: %w", c.opts.RunDir, err)
	}
	defer lock.Close()
	// Whoever held the lock before us may have launched one.
	cn, err := c.attachPublished(ctx)
	if err == nil || errors.Is(err, ErrRefused) || errors.Is(err, ErrOtherConfig) {
		return cn, err
	}
	if held, pid := serveLockHolder(c.opts.RunDir); held {
		return nil, fmt.Errorf("%w: pid %d holds %s but does not answer yet", errBusy, pid, filepath.Join(c.opts.RunDir, spawnrpc.ServeLockFile))
	}
	l, err := c.startSpawnd()
	if err != nil {
		return nil, err
	}
	c.log.Info("launched nexus-spawnd", "pid", l.pid, "path", l.path, "log", l.logPath, "reason", why.Error())
	ep, err := l.awaitEndpoint(ctx, c.opts.RunDir)
	// Also, and above all, when it failed: spawnd logged why.
	stray := l.relayBoot(c.log)
	if err != nil {
		if len(stray) > 0 {
			err = fmt.Errorf("%w; it also wrote: %s", err, strings.Join(stray, " | "))
		}
		return nil, err
	}
	return c.attach(ctx, ep)
}

// spawner implements spawnpb.SpawnerClient on top of whichever spawnd is
// attached at the time of each call.
type spawner struct{ c *Client }

var _ spawnpb.SpawnerClient = (*spawner)(nil)

func call[Req, Resp any](c *Client, ctx context.Context, in Req, opts []grpc.CallOption,
	method func(spawnpb.SpawnerClient, context.Context, Req, ...grpc.CallOption) (Resp, error),
) (Resp, error) {
	cn, err := c.current(ctx)
	if err != nil {
		var zero Resp
		return zero, err
	}
	out, err := method(cn.api, ctx, in, opts...)
	c.observe(err)
	return out, cn.lost(ctx, err)
}

func (s *spawner) Spawn(ctx context.Context, in *spawnpb.SpawnRequest, opts ...grpc.CallOption) (*spawnpb.SpawnResponse, error) {
	return call(s.c, ctx, in, opts, spawnpb.SpawnerClient.Spawn)
}

func (s *spawner) Verify(ctx context.Context, in *spawnpb.VerifyRequest, opts ...grpc.CallOption) (*spawnpb.VerifyResponse, error) {
	return call(s.c, ctx, in, opts, spawnpb.SpawnerClient.Verify)
}

func (s *spawner) Terminate(ctx context.Context, in *spawnpb.TerminateRequest, opts ...grpc.CallOption) (*spawnpb.TerminateResponse, error) {
	return call(s.c, ctx, in, opts, spawnpb.SpawnerClient.Terminate)
}

func (s *spawner) List(ctx context.Context, in *spawnpb.ListRequest, opts ...grpc.CallOption) (*spawnpb.ListResponse, error) {
	return call(s.c, ctx, in, opts, spawnpb.SpawnerClient.List)
}

func (s *spawner) Record(ctx context.Context, in *spawnpb.RecordRequest, opts ...grpc.CallOption) (*spawnpb.RecordResponse, error) {
	return call(s.c, ctx, in, opts, spawnpb.SpawnerClient.Record)
}

// Reload also records the version spawnd applied as the gateway's, so a
// re-attach after a SIGHUP expects that version, not the boot one.
func (s *spawner) Reload(ctx context.Context, in *spawnpb.ReloadRequest, opts ...grpc.CallOption) (*spawnpb.ReloadResponse, error) {
	res, err := call(s.c, ctx, in, opts, spawnpb.SpawnerClient.Reload)
	if err == nil && res.GetApplied() && in.GetConfigDigest() != "" {
		s.c.mu.Lock()
		s.c.digest = in.GetConfigDigest()
		s.c.mu.Unlock()
	}
	return res, err
}

func (s *spawner) Status(ctx context.Context, in *spawnpb.StatusRequest, opts ...grpc.CallOption) (*spawnpb.StatusResponse, error) {
	return call(s.c, ctx, in, opts, spawnpb.SpawnerClient.Status)
}

func (s *spawner) Binding(ctx context.Context, in *spawnpb.BindingRequest, opts ...grpc.CallOption) (*spawnpb.BindingResponse, error) {
	return call(s.c, ctx, in, opts, spawnpb.SpawnerClient.Binding)
}

func (s *spawner) Watch(ctx context.Context, in *spawnpb.WatchRequest, opts ...grpc.CallOption) (grpc.ServerStreamingClient[spawnpb.ExitEvent], error) {
	cn, err := s.c.current(ctx)
	if err != nil {
		return nil, err
	}
	stream, err := cn.api.Watch(ctx, in, opts...)
	s.c.observe(err)
	if err != nil {
		return nil, cn.lost(ctx, err)
	}
	return &watchStream{ServerStreamingClient: stream, c: s.c, cn: cn, ctx: ctx}, nil
}

// watchStream reports a broken stream to the supervisor like a failed
// call, and a stream cut by a lost spawnd as codes.Unavailable.
type watchStream struct {
	grpc.ServerStreamingClient[spawnpb.ExitEvent]
	c   *Client
	cn  *conn
	ctx context.Context
}

func (w *watchStream) Recv() (*spawnpb.ExitEvent, error) {
	ev, err := w.ServerStreamingClient.Recv()
	w.c.observe(err)
	return ev, w.cn.lost(w.ctx, err)
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
