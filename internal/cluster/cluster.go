// Package cluster is cluster mode's transport: the gateway's one NATS
// connection, a heartbeat per broker for membership, and signed
// request/reply addressed to one broker's own subjects. What a request
// means is the gateway's business; this package only carries it.
//
// Subjects, under cluster.subject_prefix (P):
//
//	P.hb                 every broker's heartbeat (publish, subscribe)
//	P.b.<broker_id>.<op> requests for one broker (that broker subscribes)
package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/nexus-broker/nexus-broker/internal/config"
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
	// visible: /readyz 503, an ERROR line, the gauge.
	failuresVisible = 3
	// missedBeats silent heartbeat intervals make a peer unreachable.
	missedBeats = 3
	// maxSkew is how far a signed message's clock may be from ours.
	maxSkew = 30 * time.Second
	// backoffBase, backoffCap and backoffMin shape the reconnect delay.
	backoffBase = 100 * time.Millisecond
	backoffCap  = 5 * time.Second
	backoffMin  = 50 * time.Millisecond
	sigHeader   = "Nexus-Sig"
	opHeartbeat = "hb"
	// noResponders is the status NATS answers a request with when nobody
	// subscribes to its subject.
	noResponders = "503"
)

// ErrUnavailable is a peer (or NATS itself) that did not answer.
var ErrUnavailable = errors.New("lease owner unavailable")

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
}

// Handler answers one request addressed to this broker. from is the
// sending broker's id; the answer is JSON-encoded into the reply.
type Handler func(ctx context.Context, from string, body json.RawMessage) (any, error)

// Peer is one broker as the heartbeats show it.
type Peer struct {
	ID        string
	Advertise string
	Reachable bool
}

type peer struct {
	advertise string
	lastSeen  time.Time
}

// Node is this broker's membership of the cluster.
type Node struct {
	id, prefix, advertise string
	secret                []byte
	every                 time.Duration
	log                   *slog.Logger
	opts                  []nats.Option
	urls                  string
	free                  func() int
	peerFree              func(string)
	// beatNow asks for a heartbeat before the next tick.
	beatNow chan struct{}

	nc       atomic.Pointer[nats.Conn]
	failures atomic.Int32
	lastErr  atomic.Pointer[string]
	handlers map[string]handler

	// inbox is this broker's reply subject prefix: a request's answer
	// comes to inbox.<n>, fresh for each request.
	inbox   string
	asked   atomic.Uint64
	seen    *replayGuard
	refused map[string]*atomic.Uint64 // by RefusedReasons

	mu      sync.Mutex
	peers   map[string]*peer
	waiting map[string]chan result // by reply subject
	parts   assembler

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
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
		return nil, fmt.Errorf("broker config: cluster.secret_env: %s holds %d bytes, too short to sign with; use at least %d random bytes, the same on every broker", k.SecretEnv, len(secret), config.MinClusterSecret)
	}
	n := newNode(o.BrokerID, []byte(secret), o.Log)
	n.prefix, n.advertise, n.every, n.urls = k.SubjectPrefix, o.Advertise, k.HeartbeatInterval.D(), strings.Join(k.URLs, ",")
	n.free, n.peerFree = o.Free, o.PeerFree
	if n.opts, err = n.natsOptions(k); err != nil {
		n.cancel()
		return nil, err
	}
	return n, nil
}

// newNode is a Node that signs with secret, not yet connected.
func newNode(id string, secret []byte, log *slog.Logger) *Node {
	ctx, cancel := context.WithCancel(context.Background())
	n := &Node{
		id: id, secret: secret, log: log, handlers: map[string]handler{}, peers: map[string]*peer{}, ctx: ctx, cancel: cancel,
		inbox: nats.NewInbox(), seen: newReplayGuard(time.Now()), waiting: map[string]chan result{},
		parts: assembler{parts: map[string]*assembly{}}, refused: map[string]*atomic.Uint64{}, beatNow: make(chan struct{}, 1),
	}
	for _, r := range RefusedReasons {
		n.refused[r] = new(atomic.Uint64)
	}
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
// reload may change).
func (n *Node) HandleFor(op string, timeout func() time.Duration, h Handler) {
	n.handlers[op] = handler{h: h, timeout: timeout}
}

// Start connects to NATS. An authentication or configuration error is
// returned (the boot is refused); a transient one is retried in the
// background with capped, jittered backoff, and the broker serves its own
// leases meanwhile.
func (n *Node) Start() error {
	err := n.connect()
	switch {
	case err == nil:
		return nil
	case !transient(err):
		n.cancel()
		return fmt.Errorf("cluster: connecting to NATS at %s: %w (check cluster.urls, cluster.creds_file / nkey_seed and cluster.tls_ca)", n.urls, err)
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
			n.failed(err)
		}
	}()
	return nil
}

// connect dials once and, on success, subscribes and starts the heartbeat.
func (n *Node) connect() error {
	nc, err := nats.Connect(n.urls, n.opts...)
	if err != nil {
		return err
	}
	if _, err := nc.Subscribe(n.subject(n.id, "*"), n.serve); err != nil {
		nc.Close()
		return err
	}
	if _, err := nc.Subscribe(n.prefix+"."+opHeartbeat, n.heard); err != nil {
		nc.Close()
		return err
	}
	if _, err := nc.Subscribe(n.inbox+".*", n.answered); err != nil {
		nc.Close()
		return err
	}
	if err := nc.Flush(); err != nil {
		nc.Close()
		return err
	}
	if nc.MaxPayload() < MinPayload {
		nc.Close()
		return fmt.Errorf("the NATS server's max_payload is %d bytes; cluster mode needs at least %d (raise max_payload in the server's configuration)", nc.MaxPayload(), MinPayload)
	}
	n.nc.Store(nc)
	n.recovered()
	n.log.Info("cluster: connected to NATS", "url", nc.ConnectedUrlRedacted(), "broker_id", n.id,
		"max_payload", nc.MaxPayload(), "subject_prefix", n.prefix)
	n.wg.Add(1)
	go n.beat(nc)
	return nil
}

func (n *Node) natsOptions(k *config.Cluster) ([]nats.Option, error) {
	opts := []nats.Option{
		nats.Name("nexus-broker " + n.id),
		nats.MaxReconnects(-1),
		nats.CustomReconnectDelay(Backoff),
		nats.Timeout(CallTimeout),
		nats.ReconnectErrHandler(func(_ *nats.Conn, err error) { n.failed(err) }),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil && n.ctx.Err() == nil {
				n.log.Warn("cluster: disconnected from NATS; reconnecting", "error", err)
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			n.recovered()
			n.log.Info("cluster: reconnected to NATS", "url", nc.ConnectedUrlRedacted())
		}),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
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
	if k.TLSCA != "" {
		opts = append(opts, nats.RootCAs(k.TLSCA))
	}
	return opts, nil
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
	d = d/2 + rand.N(d/2+1)
	return max(d, backoffMin)
}

// failed counts one unexpected failure; the third in a row is made
// visible.
func (n *Node) failed(err error) {
	msg := err.Error()
	n.lastErr.Store(&msg)
	if c := n.failures.Add(1); c == failuresVisible {
		n.log.Error("cluster: NATS unreachable after consecutive attempts; this broker answers only its own leases until it is back (GET /readyz is 503)",
			"attempts", c, "url", n.urls, "error", err)
	} else if c < failuresVisible {
		n.log.Warn("cluster: NATS connection attempt failed; retrying with backoff", "attempt", c, "error", err)
	}
}

func (n *Node) recovered() {
	if n.failures.Swap(0) >= failuresVisible {
		n.log.Info("cluster: NATS reachable again")
	}
}

// Failures is the count of consecutive unexpected failures (a gauge).
func (n *Node) Failures() int { return int(n.failures.Load()) }

// Ready is nil unless the NATS outage has become visible.
func (n *Node) Ready() error {
	if n.failures.Load() < failuresVisible {
		return nil
	}
	msg := "unknown error"
	if p := n.lastErr.Load(); p != nil {
		msg = *p
	}
	return fmt.Errorf("cluster: NATS unreachable (%d consecutive failures): %s", n.failures.Load(), msg)
}

// MaxPayload is the connected server's max_payload, 0 while not connected.
func (n *Node) MaxPayload() int64 {
	if nc := n.nc.Load(); nc != nil {
		return nc.MaxPayload()
	}
	return 0
}

// Close stops the heartbeat and drops the connection.
func (n *Node) Close() {
	n.cancel()
	if nc := n.nc.Load(); nc != nil {
		nc.Close()
	}
	n.wg.Wait()
}

func (n *Node) subject(broker, op string) string { return n.prefix + ".b." + broker + "." + op }

// --- membership ---------------------------------------------------------------

type heartbeat struct {
	Advertise string `json:"advertise"`
	// Free is how many claims the broker would take now without queueing.
	Free int `json:"free,omitempty"`
}

// BeatNow sends a heartbeat at once (without waiting for the next tick):
// a slot just became free, and brokers with claims queued should hear it.
func (n *Node) BeatNow() {
	select {
	case n.beatNow <- struct{}{}:
	default: // one is pending already
	}
}

func (n *Node) beat(nc *nats.Conn) {
	defer n.wg.Done()
	t := time.NewTicker(n.every)
	defer t.Stop()
	for {
		hb := heartbeat{Advertise: n.advertise}
		if n.free != nil {
			hb.Free = n.free()
		}
		if data, err := n.seal(hb); err == nil {
			_ = n.publish(nc, n.prefix+"."+opHeartbeat, "", data) // buffered while reconnecting; failures count in ReconnectErrHandler
		}
		select {
		case <-n.ctx.Done():
			return
		case <-t.C:
		case <-n.beatNow:
		}
		if nc.IsClosed() {
			return
		}
	}
}

func (n *Node) heard(msg *nats.Msg) {
	data, done, err := n.receive(msg)
	if err != nil || !done {
		return
	}
	from, body, err := n.open(data)
	if err != nil || from == n.id {
		return
	}
	var hb heartbeat
	if json.Unmarshal(body, &hb) != nil {
		return
	}
	n.mu.Lock()
	p := n.peers[from]
	if p == nil {
		p = &peer{}
		n.peers[from] = p
		n.log.Info("cluster: peer joined", "peer", from, "advertise", hb.Advertise)
	}
	p.advertise, p.lastSeen = hb.Advertise, time.Now()
	n.mu.Unlock()
	if hb.Free > 0 && n.peerFree != nil {
		n.peerFree(from)
	}
}

// Known reports whether id is this broker or a broker that has been heard.
func (n *Node) Known(id string) bool {
	if id == n.id {
		return true
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.peers[id] != nil
}

// Reachable reports whether peer id's heartbeat is current.
func (n *Node) Reachable(id string) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	p := n.peers[id]
	return p != nil && n.current(p)
}

func (n *Node) current(p *peer) bool {
	return time.Since(p.lastSeen) < missedBeats*n.every && n.nc.Load() != nil && n.nc.Load().IsConnected()
}

// Peers lists every broker heard from but this one, sorted by id.
func (n *Node) Peers() []Peer {
	n.mu.Lock()
	defer n.mu.Unlock()
	out := make([]Peer, 0, len(n.peers))
	for id, p := range n.peers {
		out = append(out, Peer{ID: id, Advertise: p.advertise, Reachable: n.current(p)})
	}
	slices.SortFunc(out, func(a, b Peer) int { return strings.Compare(a.ID, b.ID) })
	return out
}

// --- signed request/reply -----------------------------------------------------

// RemoteError is a handler's error, as the peer said it.
type RemoteError struct{ Text string }

func (e *RemoteError) Error() string { return e.Text }

// Refused is how many signed-message checks refused a message for reason
// (one of RefusedReasons) since the start.
func (n *Node) Refused(reason string) uint64 {
	return n.refused[reason].Load()
}

// serve takes one request (or one chunk of it: chunks are reassembled
// here, in the order they arrive) and answers it on its own goroutine: a
// stream read may wait up to ReadWait, and must not hold up the requests
// behind it. Requests that must stay in order (a client's frames) are sent
// one at a time.
func (n *Node) serve(msg *nats.Msg) {
	data, done, err := n.receive(msg)
	switch {
	case errors.Is(err, ErrIncomplete):
		n.incomplete(msg.Subject, msg.Reply, err)
		return
	case err != nil:
		// No answer: an unsigned caller learns nothing. The subject only:
		// never the data.
		n.log.Warn("cluster: request refused", "subject", msg.Subject, "error", err)
		return
	case !done:
		return
	}
	go func() {
		from, body, err := n.open(data)
		if err != nil {
			// No answer either: a replay is not done twice.
			n.log.Warn("cluster: request refused", "subject", msg.Subject, "error", err)
			return
		}
		op := msg.Subject[strings.LastIndexByte(msg.Subject, '.')+1:]
		h, ok := n.handlers[op]
		var out any
		if !ok {
			err = fmt.Errorf("unknown op %q", op)
		} else {
			ctx, cancel := context.WithTimeout(n.ctx, h.timeout())
			out, err = h.h(ctx, from, body)
			cancel()
		}
		var e envelope
		if err != nil {
			e.Error = err.Error()
		} else if e.Body, err = json.Marshal(out); err != nil {
			e.Error = err.Error()
		}
		n.respond(msg.Reply, e)
	}()
}

// respond sends e, signed, to a request's reply subject.
func (n *Node) respond(reply string, e envelope) {
	nc := n.nc.Load()
	if reply == "" || nc == nil {
		return
	}
	data, err := n.sealEnvelope(e)
	if err == nil {
		err = n.publish(nc, reply, "", data)
	}
	if err != nil {
		n.log.Warn("cluster: answering a request failed", "subject", reply, "error", err)
	}
}

// result is what a request of ours got: an answer's data, or why none.
type result struct {
	data []byte
	err  error
}

// answered takes an answer (or a chunk of one) to a request of ours. One
// that is not signed is ignored (the real answer may still come); one
// nobody waits for (late, or sent again) is dropped.
func (n *Node) answered(msg *nats.Msg) {
	if len(msg.Data) == 0 && msg.Header.Get("Status") == noResponders {
		n.deliver(msg.Subject, result{err: ErrUnavailable})
		return
	}
	data, done, err := n.receive(msg)
	switch {
	case errors.Is(err, ErrIncomplete):
		n.deliver(msg.Subject, result{err: err})
	case err == nil && done:
		n.deliver(msg.Subject, result{data: data})
	}
}

// deliver hands r to the request waiting on reply subject, once.
func (n *Node) deliver(subject string, r result) {
	n.mu.Lock()
	ch := n.waiting[subject]
	delete(n.waiting, subject)
	n.mu.Unlock()
	if ch != nil {
		ch <- r
	}
}

// Call sends body to broker to's op and decodes the answer into out. A
// peer that does not answer within CallTimeout (down, partitioned, NATS
// lost) is ErrUnavailable; a handler's error is a *RemoteError.
func (n *Node) Call(ctx context.Context, to, op string, body, out any) error {
	return n.CallFor(ctx, CallTimeout, to, op, body, out)
}

// CallFor is Call with its own deadline. The reply subject is this
// broker's own, fresh for the request and signed with it, so neither the
// request nor where its answer goes can be re-used.
func (n *Node) CallFor(ctx context.Context, timeout time.Duration, to, op string, body, out any) error {
	nc := n.nc.Load()
	if nc == nil || !nc.IsConnected() {
		return ErrUnavailable
	}
	data, err := n.seal(body)
	if err != nil {
		return err
	}
	reply := n.inbox + "." + strconv.FormatUint(n.asked.Add(1), 10)
	ch := make(chan result, 1)
	n.mu.Lock()
	n.waiting[reply] = ch
	n.mu.Unlock()
	defer func() {
		n.mu.Lock()
		delete(n.waiting, reply)
		n.mu.Unlock()
	}()
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if err := n.publish(nc, n.subject(to, op), reply, data); err != nil {
		if errors.Is(err, nats.ErrConnectionClosed) || errors.Is(err, nats.ErrConnectionReconnecting) {
			return ErrUnavailable
		}
		return err
	}
	var r result
	select {
	case r = <-ch:
	case <-ctx.Done():
		return ErrUnavailable
	}
	if r.err != nil {
		return r.err
	}
	_, raw, err := n.open(r.data)
	if err != nil {
		return err
	}
	if out == nil {
		return nil
	}
	return json.Unmarshal(raw, out)
}
