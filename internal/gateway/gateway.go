// Package gateway is the lease core of nexus-broker's unprivileged half:
// leases and their states, claims and releases, the instance and client
// WebSockets, capacity and its FIFO queue (internal/capacity), the stream
// log and replay (internal/streamlog), the sockets (internal/wire), the
// idle and turn policy, metrics. It never spawns or signals a process
// itself: it asks spawnd through the spawner.Spawner interface, in its own
// types. The HTTP face (routes, the auth guard's wrappers, body bounds, the
// OpenAPI description) is internal/httpapi, the A2A door
// internal/a2a/ingress and the cluster router internal/cluster/router,
// each a layer over this package's exported face; the core asks the router
// through Router (api_router.go), and starts, reloads and stops the door
// as a Layer. docs/architecture.md draws the layers.
//
// Layers above it (the HTTP face, the A2A door, the cluster router,
// internal/console, internal/brokerd) use it only through its exported
// face, in api.go (and api_router.go for the router's part; ClaimRequest
// and CountClaim sit in claim.go, Routes in gateway.go, NotReady in
// release.go and WriteMetrics in metrics.go, with their logic): Claim,
// ClaimRequest, Release, Ticket, a Lease's Send, Follow and Attach,
// Leases, Subscribe, Extend, Mount, Routes, NotReady, WriteMetrics and the
// guard (Authenticate, Admit, Audit). It may not import them (nor the A2A
// door), internal/cluster (the router speaks NATS), pkg/spawnrpc or
// internal/spawnclient (layers_test.go checks it, and that no package
// holds more than 4 500 non-test lines, no file outside spawnd more than
// 600, nor any struct more than 15 fields).
package gateway

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"github.com/nexus-broker/nexus-broker/internal/logbound"
	"log/slog"
	"net/http"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/a2a"
	"github.com/nexus-broker/nexus-broker/internal/auth"
	"github.com/nexus-broker/nexus-broker/internal/config"
	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/capacity"
	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/metric"
	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/pool"
	"github.com/nexus-broker/nexus-broker/internal/gateway/spawner"
)

// Options wires a Gateway.
type Options struct {
	Config *config.Config
	// Spawner is spawnd. Calls made while spawnd restarts are expected to
	// wait for the new connection within their context.
	Spawner spawner.Spawner
	Logger  *slog.Logger
	// ListenPort is the port the listener bound, reported with each spawn:
	// spawnd builds NEXUS_BROKER_ADDR from its own listen_addr and takes
	// the port from here only where listen_addr asks for port 0.
	ListenPort int
	// Auth is the chain of Config's auth: block (auth.New); nil without one.
	Auth *auth.Authenticator
	// Ready is nil while spawnd is attached and answering, else why not
	// (spawnclient.Client.Ready). Nil means always ready.
	Ready func() error
	// Journal is nil while spawnd's lease journal can record a lease, else
	// why not (spawnclient.Client.Journal); nil means it always can.
	Journal func() error
}

// Gateway is the lease core. Create it with New, call Start once, serve
// the HTTP face over it (internal/httpapi.Handler), and Shutdown when done.
type Gateway struct {
	log *slog.Logger
	// quiet writes the lines a peer can make repeat per frame or request
	// (drops, refusals), bounded per subject and message (logbound).
	quiet *logbound.Limiter
	spawndLink
	settings
	cap *capacity.Slots[queuedOffer]
	m   *metric.Set
	// auth is nil without an auth: block; tickets are minted only with one.
	auth    *auth.Authenticator
	tickets *auth.Tickets
	// rt is cluster mode's router; single-broker mode builds none.
	rt Router
	// draining is an operator's drain (nexus-broker -drain): no new claim
	// or offer is taken, the leases keep working.
	draining atomic.Bool
	pools    warmPools
	above
	book
	life
}

// spawndLink is how the gateway reaches spawnd.
type spawndLink struct {
	sp         spawner.Spawner
	ready      func() error
	journal    func() error
	listenPort uint32
	// binaries is spawnd's registry as it last answered.
	binaries atomic.Pointer[[]spawner.Binary]
}

// settings are the configuration: boot holds the keys read only at boot;
// cfg the reloadable ones in force.
type settings struct {
	boot *config.Config
	cfg  atomic.Pointer[config.Config]
}

// above is what the layers above the core hooked into it.
type above struct {
	// subs are called with every lease event (Subscribe).
	subs []func(Event)
	// mounts add the routes of the layers above the core (Mount).
	mounts []func(*http.ServeMux)
	// mux is the HTTP layer's, for requests other brokers carry here
	// (ServeCarried).
	mux atomic.Pointer[http.ServeMux]
	// join builds the cluster router (JoinCluster); nil in single-broker
	// mode.
	join func(brokerID string) (Router, error)
	// layers start, reload and stop with the core (Extend).
	layers []Layer
	// a2aHolds and a2aTasks answer other brokers' questions with the A2A
	// door's (ServeA2A); nil without one.
	a2aHolds func(A2AQuery) bool
	a2aTasks func(TaskQuery) ([]a2a.Task, int)
}

// book is the leases this broker holds.
type book struct {
	mu     sync.Mutex
	leases map[string]*lease
	// claiming counts each principal's claims admitted under
	// max_leases_per_principal that hold no lease yet.
	claiming map[string]int
	// ahead holds the session ids whose Record is in flight after the
	// claim was answered (ahead.go), each with what its answer closes;
	// recording counts the ordinary Records in flight, by session id.
	ahead     map[string]chan struct{}
	recording map[string]int
}

// life is the gateway's lifetime: Shutdown cancels ctx and waits for wg.
type life struct {
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// New builds a gateway; nothing runs until Start.
func New(o Options) *Gateway {
	ctx, cancel := context.WithCancel(context.Background())
	g := &Gateway{
		log:        o.Logger,
		quiet:      logbound.New(o.Logger, logbound.Window),
		spawndLink: spawndLink{sp: o.Spawner, ready: o.Ready, journal: o.Journal, listenPort: uint32(o.ListenPort)},
		settings:   settings{boot: o.Config},
		cap:        capacity.New[queuedOffer](o.Config.MaxConcurrent, o.Config.MaxQueueDepth, o.Config.QueueWaitTimeout.D()),
		m:          metric.NewSet(),
		auth:       o.Auth,
		tickets:    auth.NewTickets(),
		book:       book{leases: map[string]*lease{}, claiming: map[string]int{}, ahead: map[string]chan struct{}{}, recording: map[string]int{}},
		life:       life{ctx: ctx, cancel: cancel},
	}
	g.pools = warmPools{m: pool.New(warmHost{g}, o.Logger), specs: poolSpecs}
	g.cfg.Store(o.Config)
	empty := []spawner.Binary{}
	g.binaries.Store(&empty)
	return g
}

// Start reads spawnd's registry, restores the leases spawnd still holds
// (a gateway restart kills nothing), and starts following instance exits.
func (g *Gateway) Start(ctx context.Context) error {
	st, err := g.sp.Status(ctx)
	if err != nil {
		return fmt.Errorf("asking nexus-spawnd for its registry: %w", err)
	}
	g.setBinaries(st.Binaries)
	if g.boot.StateDir == "" {
		// Upstream's words; "a restart" here is nexus-spawnd's, as the key says.
		g.log.Warn("state_dir is not set: lease state is in-memory only and a restart will lose track of every instance this broker spawned",
			"restart", "a nexus-spawnd restart loses every lease; a gateway restart keeps them (nexus-spawnd holds them)")
	} else {
		g.log.Info("lease durability enabled", "state_dir", g.boot.StateDir, "broker_id", st.BrokerID)
	}
	for _, l := range g.layers {
		if err := l.Start(); err != nil {
			return err
		}
	}
	g.pools.m.Set(g.pools.specs(g.cfg.Load()))
	if err := g.restore(ctx); err != nil {
		return err
	}
	// Followed before the port opens: an instance that exits right after
	// the first claim's spawn must find the stream already subscribed.
	stream, err := g.followExits()
	if err != nil {
		return fmt.Errorf("following nexus-spawnd's instance exits: %w", err)
	}
	g.wg.Add(1)
	go g.watchExits(stream)
	g.pools.m.Start(g.ctx)
	if g.join != nil {
		rt, err := g.join(st.BrokerID)
		if err != nil {
			return err
		}
		// Set before the first request can arrive: the claims read it.
		g.rt = rt
		return rt.Start()
	}
	return nil
}

func (g *Gateway) setBinaries(bs []spawner.Binary) {
	bs = append([]spawner.Binary(nil), bs...)
	sort.Slice(bs, func(i, j int) bool { return bs[i].Name < bs[j].Name })
	g.binaries.Store(&bs)
}

// restore re-creates the gateway side of every lease spawnd holds. Each waits
// as spawning for its instance to redial, up to reattach_window.
func (g *Gateway) restore(ctx context.Context) error {
	list, err := g.sp.List(ctx)
	if err != nil {
		return fmt.Errorf("listing nexus-spawnd's live leases: %w", err)
	}
	for _, rl := range list {
		l := g.newLease(rl.LeaseID, rl.Principal, rl.Entry, rl.Created)
		l.sessionID = rl.SessionID
		l.pid = rl.Pid
		l.spawned = true
		l.restored = true
		l.prove(rl.Verifier)
		g.cap.Take()
		g.mu.Lock()
		g.leases[l.id] = l
		g.mu.Unlock()
		if rl.Pool != "" {
			g.adopt(l, rl.Pool)
		}
		g.m.RestoredLeases.Inc("restored")
		window := g.boot.ReattachWindow.D()
		l.reattachTimer = time.AfterFunc(window, func() {
			if l.currentState() == stateSpawning {
				g.log.Warn("no instance reattached to a restored lease within reattach_window; reaping it",
					"lease_id", l.id, "pid", l.pid, "reattach_window", window)
				g.m.RestoredLeases.Inc("reaped")
				go l.teardown(reasonReattachTimeout, teardownSkipGrace)
			}
		})
		g.log.Info("restored lease from the journal; awaiting instance reattach", "lease_id", l.id, "pid", l.pid,
			"session_id", l.sessionID, "binary", l.entry, "principal_id", l.principal)
	}
	return nil
}

// watchExits follows spawnd's exit stream for the gateway's lifetime,
// re-subscribing across spawnd restarts and reconciling what it missed.
func (g *Gateway) watchExits(stream spawner.Exits) {
	defer g.wg.Done()
	backoff := 50 * time.Millisecond
	for g.ctx.Err() == nil {
		if stream == nil {
			var err error
			if stream, err = g.followExits(); err != nil {
				if g.ctx.Err() != nil {
					return
				}
				g.log.Warn("following nexus-spawnd's instance exits failed; retrying", "error", err)
				select {
				case <-g.ctx.Done():
					return
				case <-time.After(backoff):
				}
				backoff = min(2*backoff, 2*time.Second)
				continue
			}
			backoff = 50 * time.Millisecond
		}
		for {
			ev, err := stream.Recv()
			if err != nil {
				break
			}
			if l := g.lookup(ev.LeaseID); l != nil {
				l.onExit(ev)
			}
		}
		stream = nil
	}
}

// followExits opens a Watch stream, which returns once spawnd has
// subscribed it: every exit from then on reaches it, and one before it is
// found by difference.
func (g *Gateway) followExits() (spawner.Exits, error) {
	stream, err := g.sp.Watch(g.ctx)
	if err == nil {
		err = g.reconcile()
	}
	if err != nil {
		return nil, err
	}
	g.log.Info("following nexus-spawnd's instance exits")
	return stream, nil
}

// reconcile treats every lease spawnd no longer holds as exited.
func (g *Gateway) reconcile() error {
	g.mu.Lock()
	var spawned []*lease
	for _, l := range g.leases {
		if l.isSpawned() {
			spawned = append(spawned, l)
		}
	}
	g.mu.Unlock()
	list, err := g.sp.List(g.ctx)
	if err != nil {
		return err
	}
	live := map[string]bool{}
	for _, rl := range list {
		live[rl.LeaseID] = true
	}
	for _, l := range spawned {
		if !live[l.id] {
			g.log.Warn("nexus-spawnd no longer holds this lease's instance; closing the lease as crashed", "lease_id", l.id, "pid", l.pid)
			l.onExit(spawner.Exit{LeaseID: l.id, Pid: l.pid, ExitCode: -1})
		}
	}
	// A lease is known here before its Spawn is sent, so one spawnd holds
	// and the gateway does not is a Spawn the gateway gave up on (spawnd
	// stopped answering under it) that spawnd carried out later.
	for _, rl := range list {
		if g.lookup(rl.LeaseID) == nil {
			g.log.Warn("nexus-spawnd holds a lease whose claim already failed here; terminating its instance", "lease_id", rl.LeaseID, "pid", rl.Pid)
			go g.terminateAbandoned(rl.LeaseID)
		}
	}
	return nil
}

// terminateAbandoned tears down an instance nobody claims, once.
func (g *Gateway) terminateAbandoned(id string) {
	ctx, cancel := context.WithTimeout(g.ctx, g.cfg.Load().ReleaseGrace.D()*3+30*time.Second)
	defer cancel()
	if err := g.sp.Terminate(ctx, spawner.Termination{LeaseID: id, Reason: reasonClaimAbandoned, SkipGrace: true}); err != nil && spawner.CodeOf(err) != spawner.NotFound {
		g.log.Warn("terminating an abandoned instance failed", "lease_id", id, "error", err)
	}
}

func (g *Gateway) lookup(id string) *lease {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.leases[id]
}

// sessionLease is principal's live lease running session, if any.
func (g *Gateway) sessionLease(principal, session string) *lease {
	if session == "" {
		return nil
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, l := range g.leases {
		l.mu.Lock()
		// Never a warm lease, nor (with auth:) one without an owner.
		ok := l.principal == principal && l.warm.pool == "" && (principal != "" || !g.auth.Enabled()) &&
			l.sessionID == session && l.state != stateDraining
		l.mu.Unlock()
		if ok {
			return l
		}
	}
	return nil
}

func (g *Gateway) removeLease(l *lease) {
	g.mu.Lock()
	if g.leases[l.id] == l {
		delete(g.leases, l.id)
	}
	g.mu.Unlock()
	g.tickets.DropLease(l.id)
}

// Shutdown stops serving leases without touching a single instance: clients
// are closed with 1001, instance sockets dropped (they redial the next
// gateway), and spawnd keeps every process.
func (g *Gateway) Shutdown() {
	g.cancel()
	for _, l := range g.liveLeases() {
		l.detachAll()
	}
	g.wg.Wait()
	for _, l := range g.layers {
		l.Stop()
	}
	if g.rt != nil {
		g.rt.Close()
	}
}

// liveLeases is a snapshot of the leases the gateway holds.
func (g *Gateway) liveLeases() []*lease {
	g.mu.Lock()
	defer g.mu.Unlock()
	ls := make([]*lease, 0, len(g.leases))
	for _, l := range g.leases {
		ls = append(ls, l)
	}
	return ls
}

// newLeaseID mints a 128-bit random lease id; in cluster mode it names this
// broker as the owner.
func (g *Gateway) newLeaseID() (string, error) {
	if g.rt != nil {
		return g.rt.NewLeaseID()
	}
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	return hex.EncodeToString(b[:]), nil
}

// terminate asks spawnd to tear a lease's process group down and waits for
// the exit (or, with req.NoWait, for the teardown to have begun), retrying
// across a spawnd restart. A lease spawnd does not hold has nothing left to
// terminate.
func (g *Gateway) terminate(l *lease, req spawner.Termination) {
	for {
		ctx, cancel := context.WithTimeout(context.Background(), g.cfg.Load().ReleaseGrace.D()*3+30*time.Second)
		err := g.sp.Terminate(ctx, req)
		cancel()
		if err == nil || spawner.CodeOf(err) == spawner.NotFound {
			return
		}
		select {
		case <-l.exited:
			return
		default:
		}
		g.log.Warn("asking nexus-spawnd to terminate a lease failed; retrying", "lease_id", l.id, "error", err)
		select {
		case <-l.exited:
			return
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// Routes adds the core's own routes to mux, the HTTP layer's
// (internal/httpapi.Handler): its two WebSockets, and the routes of the
// layers above it that Mount named.
func (g *Gateway) Routes(mux *http.ServeMux) {
	// Never under auth: the instance dial-back proves itself with its
	// spawn secret.
	mux.HandleFunc("GET /instance", g.handleInstance)
	// Authenticates itself: it also takes ?ticket=.
	mux.HandleFunc("GET /lease/{lease_id}", g.handleClient)
	for _, m := range g.mounts {
		m(mux)
	}
}
