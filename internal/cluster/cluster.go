// Package cluster is cluster mode's transport: the gateway's one NATS
// connection, a heartbeat per broker for membership, and sealed
// request/reply addressed to one broker's own subjects. What a request
// means is the gateway's business; this package only carries it.
//
// Subjects, under cluster.subject_prefix (P), for broker B:
//
//	P.hb              every broker's heartbeat (publish, subscribe)
//	P.b.B.<op>        requests for broker B (B subscribes)
//	_INBOX.B.<id>.<n> answers to B's requests (B subscribes)
//
// It is of the floor: it may import internal/config and the helpers,
// never the lease core, the cluster router above it, the A2A door, the
// HTTP face, the console, spawnd's client or pkg/spawnrpc
// (internal/gateway/layers_test.go checks it).
package cluster

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	mrand "math/rand/v2"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/nexus-broker/nexus-broker/internal/config"
	"github.com/nexus-broker/nexus-broker/internal/logbound"
)

// Limits and timings.
const (
	// CallTimeout bounds one request to a peer, a wait of ReadWait included.
	CallTimeout = 2 * time.Second
	// ReadWait is the longest a relayed stream read waits for a frame
	// before answering "pending": half the call budget, as the ownership
	// rules have it.
	ReadWait = 500 * time.Millisecond
	// failuresVisible consecutive unexpected failures make the outage
	// loud: an ERROR line, the gauge.
	failuresVisible = 3
	// missedBeats silent heartbeat intervals make a peer unreachable, and
	// this broker unready when its own heartbeat has not come back.
	missedBeats = 3
	// maxSkew is how far a sealed message's clock may be from ours.
	maxSkew = 30 * time.Second
	// backoffBase, backoffCap and backoffMin shape the reconnect delay.
	backoffBase = 100 * time.Millisecond
	backoffCap  = 5 * time.Second
	backoffMin  = 50 * time.Millisecond
	opHeartbeat = "hb"
	// inboxPrefix starts every broker's reply subjects, followed by the
	// broker's id: each broker can be granted its own inbox alone.
	inboxPrefix = "_INBOX."
	// noResponders is the status NATS answers a request with when nobody
	// subscribes to its subject.
	noResponders = "503"
)

// ErrUnavailable is a peer (or NATS itself) that did not answer.
var ErrUnavailable = errors.New("lease owner unavailable")

// ErrNoResponders is NATS saying nobody subscribes to a request's
// subject. It is not sealed (anyone on the account could send it), so it
// is only ever a failure, never an answer.
var ErrNoResponders = fmt.Errorf("%w: nobody subscribes to its subjects", ErrUnavailable)

// Options wire a Node.
type Options struct {
	Config *config.Cluster
	// BrokerID is this broker's id, as spawnd reports it.
	BrokerID string
	// Advertise is this broker's advertise_addr, sent with each heartbeat.
	Advertise string
	Log       *slog.Logger
	// Free, when set, is how many claims this broker would take now without
	// queueing, sent with each heartbeat.
	Free func() int
	// PeerFree, when set, is told of each heartbeat of a peer that has a
	// free slot. It must not block.
	PeerFree func(peer string)
	// Binaries, when set, are the registry entries this broker spawns,
	// sent with each heartbeat.
	Binaries func() []string
	// Load, when set, is this broker's slots and queue, sent with each
	// heartbeat for GET /cluster.
	Load func() Load
	// StateDir is where the membership list is kept across restarts
	// (MembersFile); "" keeps none.
	StateDir string
}

// Handler answers one request addressed to this broker. from is the
// sending broker's id; the answer is JSON-encoded into the reply.
type Handler func(ctx context.Context, from string, body json.RawMessage) (any, error)

// Node is this broker's membership of the cluster, in parts: the link to
// NATS, the sealed request/reply wire, the membership as heartbeats tell
// it, and what this broker's own heartbeats say.
type Node struct {
	id, prefix, advertise string
	every                 time.Duration
	log                   *slog.Logger
	// instance is random for each start: a heartbeat naming this broker's
	// id and another instance is a second broker using the id.
	instance string
	link
	wire
	members
	report

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// link is the NATS connection and its health.
type link struct {
	opts []nats.Option
	urls string
	// shownURLs is urls with any password redacted: what logs and errors say.
	shownURLs string
	nc        atomic.Pointer[nats.Conn]
	failures  atomic.Int32
	lastErr   atomic.Pointer[string]
	// linkUp and selfSeen (unix ns) are when the connection last came up
	// and when this broker last heard its own heartbeat back: readiness.
	linkUp, selfSeen atomic.Int64
	// refusedBoot, once set, is why a background connect gave up for good.
	refusedBoot atomic.Pointer[string]
}

// wire is the sealed request/reply: keys, handlers, and the requests of
// ours waiting for an answer.
type wire struct {
	keys     *sealer
	handlers map[string]handler
	// inbox is this broker's reply subject prefix: a request's answer
	// comes to inbox.<n>, fresh for each request.
	inbox   string
	asked   atomic.Uint64
	seen    *replayGuard
	refused map[string]*atomic.Uint64 // by RefusedReasons
	// quiet bounds the lines a message can cause (refusals), per subject
	// and reason (logbound).
	quiet   *logbound.Limiter
	wmu     sync.Mutex
	waiting map[string]waiter // by reply subject, under wmu
	parts   assembler
}

// report is what this broker's heartbeats say of it.
type report struct {
	free     func() int
	load     func() Load
	binaries func() []string
	peerFree func(string)
	// beatNow asks for a heartbeat before the next tick.
	beatNow  chan struct{}
	draining atomic.Bool
	// protocol is Protocol; a test sets another to play a broker of
	// another version.
	protocol int
}

// New resolves the block's secrets and builds a Node; Start connects it.
// Errors name the key at fault.
func New(o Options) (*Node, error) {
	k := o.Config
	secret, err := config.ResolveSecret("cluster", "secret", k.Secret, k.SecretEnv)
	if err != nil {
		return nil, err
	}
	if len(secret) < config.MinClusterSecret {
		return nil, fmt.Errorf("broker config: cluster.secret_env: %s holds %d bytes, too short to seal with; use at least %d random bytes, the same on every broker", k.SecretEnv, len(secret), config.MinClusterSecret)
	}
	n := newNode(o.BrokerID, []byte(secret), o.Log)
	n.prefix, n.advertise, n.every = k.SubjectPrefix, o.Advertise, k.HeartbeatInterval.D()
	n.urls, n.shownURLs = strings.Join(k.URLs, ","), RedactURLs(k.URLs)
	n.free, n.peerFree, n.binaries, n.load = o.Free, o.PeerFree, o.Binaries, o.Load
	if k.ForgetAfter > 0 { // else the default: a block not validated (tests)
		n.forgetAfter = k.ForgetAfter.D()
	}
	if o.StateDir != "" {
		n.recordPath = filepath.Join(o.StateDir, MembersFile)
		n.loadRecord(time.Now())
	}
	if n.opts, err = n.natsOptions(k); err != nil {
		n.cancel()
		return nil, err
	}
	return n, nil
}

// newNode is a Node that seals with keys derived from secret, not yet
// connected.
func newNode(id string, secret []byte, log *slog.Logger) *Node {
	ctx, cancel := context.WithCancel(context.Background())
	var inst [8]byte
	_, _ = rand.Read(inst[:])
	n := &Node{
		id: id, log: log, ctx: ctx, cancel: cancel, instance: hex.EncodeToString(inst[:]),
		wire: wire{keys: newSealer(secret), handlers: map[string]handler{}, quiet: logbound.New(log, logbound.Window), inbox: inboxPrefix + id + "." + nats.NewInbox()[len(inboxPrefix):],
			seen: newReplayGuard(time.Now()), waiting: map[string]waiter{}, parts: assembler{parts: map[string]*assembly{}}, refused: map[string]*atomic.Uint64{}},
		members: members{peers: map[string]*peer{}, record: map[string]*recorded{}, forgetAfter: config.DefaultForgetAfter},
		report:  report{beatNow: make(chan struct{}, 1), protocol: Protocol},
	}
	for _, r := range RefusedReasons {
		n.refused[r] = new(atomic.Uint64)
	}
	n.Handle(opLive, n.live)
	return n
}

// ID is this broker's id.
func (n *Node) ID() string { return n.id }

type handler struct {
	h       Handler
	timeout func() time.Duration
}

// Handle registers h for op, answered within CallTimeout; call before Start.
func (n *Node) Handle(op string, h Handler) {
	n.HandleFor(op, func() time.Duration { return CallTimeout }, h)
}

// HandleFor registers h for op, answered within timeout() as it is when
// each request arrives (a claim waits for its instance to boot, by keys a
// reload may change), or by the caller's deadline if that is sooner.
func (n *Node) HandleFor(op string, timeout func() time.Duration, h Handler) {
	n.handlers[op] = handler{h: h, timeout: timeout}
}

// bootError is a connect failure that waiting will not cure and that is
// not about reaching NATS: it is returned as it is.
type bootError struct{ error }

func (e bootError) Unwrap() error { return e.error }

// Start connects to NATS. An authentication or configuration error, a
// refused subscription or a live broker with this broker's id is returned
// (the boot is refused); a transient one is retried in the background with
// capped, jittered backoff, and the broker serves its own leases
// meanwhile.
func (n *Node) Start() error {
	err := n.connect()
	var be bootError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &be):
		n.cancel()
		return be.error
	case !transient(err):
		n.cancel()
		return fmt.Errorf("cluster: connecting to NATS at %s: %w (check cluster.urls, cluster.creds_file / nkey_seed / user and cluster.tls_ca)", n.shownURLs, err)
	}
	n.failed(err)
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		for attempt := 1; ; attempt++ {
			select {
			case <-n.ctx.Done():
				return
			case <-time.After(Backoff(attempt)):
			}
			err := n.connect()
			if err == nil {
				return
			}
			if errors.As(err, &be) {
				msg := be.Error()
				n.refusedBoot.Store(&msg)
				n.log.Error("cluster: not joining the cluster", "error", msg)
				return
			}
			n.failed(err)
		}
	}()
	return nil
}

// connect dials once and, on success, subscribes and starts the heartbeat.
// Before it subscribes to its own subjects it asks whether another broker
// answers for its id.
func (n *Node) connect() error {
	nc, err := nats.Connect(n.urls, n.opts...)
	if err != nil {
		return err
	}
	if err := n.join(nc); err != nil {
		nc.Close()
		return err
	}
	n.linkUp.Store(time.Now().UnixNano())
	n.nc.Store(nc)
	n.recovered()
	n.log.Info("cluster: connected to NATS", "url", nc.ConnectedUrlRedacted(), "broker_id", n.id,
		"max_payload", nc.MaxPayload(), "subject_prefix", n.prefix)
	n.wg.Add(1)
	go n.beat(nc)
	return nil
}

func (n *Node) join(nc *nats.Conn) error {
	if nc.MaxPayload() < MinPayload {
		return bootError{fmt.Errorf("cluster: the NATS server's max_payload is %d bytes; cluster mode needs at least %d (raise max_payload in the server's configuration)", nc.MaxPayload(), MinPayload)}
	}
	if err := n.subscribe(nc, n.inbox+".*", n.answered); err != nil {
		return err
	}
	if err := n.subscribe(nc, n.prefix+"."+opHeartbeat, n.heard); err != nil {
		return err
	}
	if err := n.probe(nc); err != nil {
		return err
	}
	return n.subscribe(nc, n.subject(n.id, "*"), n.serve)
}

// subscribe subscribes cb to subject and waits for the server to take it:
// a permission violation is a refused boot naming the subject, never a
// broker that runs deaf.
func (n *Node) subscribe(nc *nats.Conn, subject string, cb nats.MsgHandler) error {
	if _, err := nc.Subscribe(subject, cb); err != nil {
		return err
	}
	if err := nc.Flush(); err != nil {
		return err
	}
	// The server answers a refused SUB with -ERR before the flush's PONG,
	// and the connection records it before Flush returns.
	if err := nc.LastError(); errors.Is(err, nats.ErrPermissionViolation) && strings.Contains(err.Error(), `"`+subject+`"`) {
		return bootError{fmt.Errorf("cluster: NATS refuses this broker's subscription to %s (%v): grant its NATS user subscribe permission on it (docs/cluster.md lists every subject)", subject, err)}
	}
	return nil
}

func (n *Node) natsOptions(k *config.Cluster) ([]nats.Option, error) {
	opts := []nats.Option{
		nats.Name("nexus-broker " + n.id),
		nats.MaxReconnects(-1),
		nats.CustomReconnectDelay(Backoff),
		nats.Timeout(CallTimeout),
		// Publishes fail while disconnected: a request kept in a reconnect
		// buffer would reach its owner after its caller gave up on it.
		nats.ReconnectBufSize(-1),
		// A link that stops carrying anything is found within about two
		// heartbeat intervals.
		nats.PingInterval(n.every),
		nats.MaxPingsOutstanding(2),
		nats.ReconnectErrHandler(func(_ *nats.Conn, err error) { n.failed(err) }),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil && n.ctx.Err() == nil {
				msg := "disconnected: " + err.Error()
				n.lastErr.Store(&msg)
				n.log.Warn("cluster: disconnected from NATS; reconnecting", "error", err)
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			n.linkUp.Store(time.Now().UnixNano())
			n.recovered()
			n.log.Info("cluster: reconnected to NATS", "url", nc.ConnectedUrlRedacted())
		}),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			if errors.Is(err, nats.ErrPermissionViolation) {
				n.log.Error("cluster: NATS refused a publish or subscription of this broker; grant its NATS user the permissions docs/cluster.md lists", "error", err)
				return
			}
			n.log.Warn("cluster: NATS error", "error", err)
		}),
	}
	if k.CredsFile != "" {
		opts = append(opts, nats.UserCredentials(k.CredsFile))
	}
	if k.NkeySeed != "" || k.NkeySeedEnv != "" {
		seed, err := config.ResolveSecret("cluster", "nkey_seed", k.NkeySeed, k.NkeySeedEnv)
		if err != nil {
			return nil, err
		}
		o, err := nkeyOption(seed)
		if err != nil {
			return nil, err
		}
		opts = append(opts, o)
	}
	if k.User != "" {
		password, err := config.ResolveSecret("cluster", "password", "", k.PasswordEnv)
		if err != nil {
			return nil, err
		}
		opts = append(opts, nats.UserInfo(k.User, password))
	}
	if k.TLSCA != "" {
		opts = append(opts, nats.RootCAs(k.TLSCA))
	}
	return opts, nil
}

// RedactURLs is urls joined as nats.Connect takes them, each password
// replaced by xxxxx: the form every log line and error shows.
func RedactURLs(urls []string) string {
	out := make([]string, len(urls))
	for i, u := range urls {
		out[i] = config.RedactURL(strings.TrimSpace(u))
	}
	return strings.Join(out, ",")
}

// transient reports whether a connect error may go away by itself: the
// servers are unreachable or slow. Authentication, permission and
// configuration errors will not.
func transient(err error) bool {
	for _, fatal := range []error{nats.ErrAuthorization, nats.ErrAuthExpired, nats.ErrAuthRevoked,
		nats.ErrAccountAuthExpired, nats.ErrPermissionViolation, nats.ErrBadSubject} {
		if errors.Is(err, fatal) {
			return false
		}
	}
	msg := err.Error()
	return errors.Is(err, nats.ErrNoServers) || errors.Is(err, nats.ErrTimeout) ||
		strings.Contains(msg, "connection refused") || strings.Contains(msg, "i/o timeout") ||
		strings.Contains(msg, "connection reset") || strings.Contains(msg, "EOF")
}

// Backoff is the delay before reconnect attempt n (1-based): exponential
// from backoffBase, capped at backoffCap, with the upper half jittered so
// brokers that lost NATS together do not return in step.
func Backoff(attempt int) time.Duration {
	d := backoffCap
	if attempt < 16 {
		d = min(backoffCap, backoffBase<<attempt)
	}
	d = d/2 + mrand.N(d/2+1)
	return max(d, backoffMin)
}

// failed counts one unexpected failure; the third in a row is made loud.
func (n *Node) failed(err error) {
	msg := err.Error()
	n.lastErr.Store(&msg)
	if c := n.failures.Add(1); c == failuresVisible {
		n.log.Error("cluster: NATS unreachable after consecutive attempts; this broker answers only its own leases until it is back (GET /readyz is 503)",
			"attempts", c, "url", n.shownURLs, "error", err)
	} else if c < failuresVisible {
		n.log.Warn("cluster: NATS connection attempt failed; retrying with backoff", "attempt", c, "url", n.shownURLs, "error", err)
	}
}

func (n *Node) recovered() {
	if n.failures.Swap(0) >= failuresVisible {
		n.log.Info("cluster: NATS reachable again")
	}
}

// Failures is the count of consecutive unexpected failures (a gauge).
func (n *Node) Failures() int { return int(n.failures.Load()) }

// Ready is nil while this broker's own link to the cluster works: it is
// connected to NATS, its own heartbeat came back through NATS within
// missedBeats intervals, and no other broker heartbeats with its id. What
// peers do never makes it unready.
func (n *Node) Ready() error {
	if p := n.refusedBoot.Load(); p != nil {
		return errors.New(*p)
	}
	nc := n.nc.Load()
	if nc == nil || !nc.IsConnected() {
		msg := "not connected"
		if p := n.lastErr.Load(); p != nil {
			msg = *p
		}
		if f := n.failures.Load(); f > 0 {
			return fmt.Errorf("cluster: NATS unreachable (%d consecutive failures): %s", f, msg)
		}
		return fmt.Errorf("cluster: NATS unreachable: %s", msg)
	}
	since := time.Unix(0, max(n.selfSeen.Load(), n.linkUp.Load()))
	if d := time.Since(since); d >= missedBeats*n.every {
		return fmt.Errorf("cluster: this broker's own heartbeat has not come back through NATS for %s (%d intervals): its link to NATS is stalled", d.Round(time.Millisecond), missedBeats)
	}
	if err := n.twinErr(); err != nil {
		return err
	}
	return nil
}

// MaxPayload is the connected server's max_payload, 0 while not connected.
func (n *Node) MaxPayload() int64 {
	if nc := n.nc.Load(); nc != nil {
		return nc.MaxPayload()
	}
	return 0
}

// Close stops the heartbeat, then says this broker is leaving (its peers
// drop it from their lists at once rather than after missed heartbeats),
// drops the connection and saves the membership list. The leaving
// heartbeat goes last on the connection: an ordinary one after it would
// list this broker again, until forget_after.
func (n *Node) Close() {
	n.cancel()
	n.wg.Wait()
	if nc := n.nc.Load(); nc != nil && nc.IsConnected() {
		if data, err := n.stampBody(n.heartbeat(true), time.Time{}); err == nil {
			_ = n.publish(nc, forHeartbeat, n.prefix+"."+opHeartbeat, "", data)
			_ = nc.FlushTimeout(CallTimeout)
		}
	}
	if nc := n.nc.Load(); nc != nil {
		nc.Close()
	}
	n.saveRecord(time.Now())
}

func (n *Node) subject(broker, op string) string { return n.prefix + ".b." + broker + "." + op }
