// Package spawnclient is the gateway's side of spawnrpc: it attaches to the
// spawnd published in the run directory (checking the directory, the
// server's pid and uid, and that spawnd runs the gateway's config file),
// re-attaches across spawnd restarts behind one Client, and in development
// launches a detached spawnd when none is running. nexus-spawnd does not
// link it (cmd/nexus-spawnd's deps test keeps it so).
//
// It may import internal/gateway/spawner (the interface it implements),
// pkg/spawnrpc and the helpers, never the lease core, its internals or
// any layer (internal/gateway/layers_test.go checks it).
package spawnclient

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc/codes"
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
	lifetime
	// poke: a call saw codes.Unavailable.
	poke        chan struct{}
	reconnected chan struct{}
	spawner     *spawner

	// attached is set once the first attach succeeded: from then on an
	// attach is a re-attach.
	attached bool

	attachment
}

// lifetime is the Client's own: Close cancels ctx and waits for the
// supervisor.
type lifetime struct {
	ctx        context.Context // ends at Close
	cancel     context.CancelFunc
	supervised chan struct{} // closed when the supervisor returns
	closeOnce  sync.Once
}

// attachment is the spawnd attached now, and what it last said; mu guards
// it.
type attachment struct {
	mu      sync.Mutex
	digest  string        // the config version this gateway runs
	cur     *conn         // nil while re-attaching
	ready   chan struct{} // closed when cur is set
	lastErr error         // why cur is nil
	// journal is cur's last word on its lease journal (Status): why it
	// cannot record a lease, "" while it can.
	journal string
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
		lifetime:    lifetime{supervised: make(chan struct{})},
		poke:        make(chan struct{}, 1),
		reconnected: make(chan struct{}, 1),
		attachment:  attachment{ready: make(chan struct{}), digest: opts.ConfigDigest},
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
func (c *Client) Spawner() API { return c.spawner }

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
	c.journal = ""
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
	// noticed by neither its pidfd nor gRPC: only asking it does. Asking
	// Status also learns whether its lease journal records (Journal).
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

// failsHealth checks cn and reports whether it failed, marking it broken
// if so; false also once the Client is closing.
func (c *Client) failsHealth(cn *conn) bool {
	err := c.check(cn)
	if err == nil || c.ctx.Err() != nil {
		return false
	}
	cn.markBroken("health check failed: " + err.Error())
	return true
}

// check asks cn's spawnd for its Status, bounded as a health check: an
// answer proves it serves verbs, and says whether its journal records.
func (c *Client) check(cn *conn) error {
	ctx, cancel := context.WithTimeout(c.ctx, healthTimeout)
	defer cancel()
	st, err := cn.api.Status(ctx, &spawnpb.StatusRequest{})
	if err != nil {
		return err
	}
	c.mu.Lock()
	if c.cur == cn {
		c.journal = st.GetJournalError()
	}
	c.mu.Unlock()
	return nil
}

// Journal is nil while the attached spawnd's lease journal can record a
// lease, else why not, as of its last check (every healthInterval). While
// it cannot, spawnd refuses every Spawn (SPAWN_STEP_JOURNAL).
func (c *Client) Journal() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.journal == "" {
		return nil
	}
	return errors.New(c.journal)
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
