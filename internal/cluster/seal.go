package cluster

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
)

// Why a signed-message check refused a message: the values of
// nexus_broker_cluster_messages_refused_total.
const (
	RefusedSignature = "signature" // unsigned, badly signed, or the signature does not cover its subjects
	RefusedStale     = "stale"     // signed outside the skew window, or before this broker could remember it
	RefusedReplay    = "replay"    // its nonce was seen before: a captured message sent again
)

// RefusedReasons lists every refusal reason, in exposition order.
var RefusedReasons = []string{RefusedSignature, RefusedStale, RefusedReplay}

const (
	// nonceLen is a message's nonce, in bytes: random, never reused.
	nonceLen = 16
	// maxNonces bounds the replay cache. Past it the oldest second of
	// nonces is forgotten and messages signed in it are refused from then
	// on, so the cache never grows and never lets a replay through.
	maxNonces = 1 << 17
)

// envelope is every message's body: who sent it, when, a nonce, and what.
// The signature over the subject, the reply subject and the envelope
// travels in the Nexus-Sig header, so none of them can be changed or
// re-used without the cluster secret.
type envelope struct {
	From  string          `json:"from"`
	At    int64           `json:"at"`
	Nonce string          `json:"nonce"`
	Body  json.RawMessage `json:"body,omitempty"`
	Error string          `json:"error,omitempty"`
}

// refusal is a signed-message check that failed, with its metric reason.
type refusal struct {
	reason string
	err    error
}

func (r *refusal) Error() string { return r.err.Error() }

var (
	errBadSignature = errors.New("unsigned or badly signed")
	errReplayed     = errors.New("replayed: its nonce was seen before")
)

func (n *Node) seal(body any) ([]byte, error) {
	raw, err := json.Marshal(body)
	if err != nil {
		return nil, err
	}
	return n.sealEnvelope(envelope{Body: raw})
}

// sealEnvelope stamps e with this broker's id, the time and a fresh nonce.
func (n *Node) sealEnvelope(e envelope) ([]byte, error) {
	var b [nonceLen]byte
	if _, err := rand.Read(b[:]); err != nil {
		return nil, err
	}
	e.From, e.At, e.Nonce = n.id, time.Now().UnixNano(), hex.EncodeToString(b[:])
	return json.Marshal(e)
}

// mac signs what a message is: where it goes, where its answer goes,
// which chunk of a larger message it is ("" for a whole one), and its data.
func (n *Node) mac(subject, reply, part string, data []byte) string {
	h := hmac.New(sha256.New, n.secret)
	for _, s := range []string{subject, reply, part} {
		h.Write([]byte(s))
		h.Write([]byte{0})
	}
	h.Write(data)
	return hex.EncodeToString(h.Sum(nil))
}

func (n *Node) sign(msg *nats.Msg, part string) {
	if msg.Header == nil {
		msg.Header = nats.Header{}
	}
	msg.Header.Set(sigHeader, n.mac(msg.Subject, msg.Reply, part, msg.Data))
}

func (n *Node) verify(msg *nats.Msg, part string) error {
	sig := msg.Header.Get(sigHeader)
	if sig == "" || !hmac.Equal([]byte(sig), []byte(n.mac(msg.Subject, msg.Reply, part, msg.Data))) {
		return &refusal{RefusedSignature, errBadSignature}
	}
	return nil
}

// count counts err when it is a refusal, and returns it.
func (n *Node) count(err error) error {
	var r *refusal
	if errors.As(err, &r) {
		n.refused[r.reason].Add(1)
	}
	return err
}

// open checks a received message's envelope, once its signature (or every
// chunk's) has been verified: its freshness and its nonce.
func (n *Node) open(data []byte) (from string, body json.RawMessage, err error) {
	from, body, err = n.unseal(data)
	return from, body, n.count(err)
}

func (n *Node) unseal(data []byte) (string, json.RawMessage, error) {
	var e envelope
	if err := json.Unmarshal(data, &e); err != nil {
		return "", nil, err
	}
	now := time.Now()
	if d := now.Sub(time.Unix(0, e.At)); d > maxSkew || d < -maxSkew {
		return "", nil, &refusal{RefusedStale, fmt.Errorf("signed %s away from this broker's clock", d)}
	}
	nonce, err := hex.DecodeString(e.Nonce)
	if err != nil || len(nonce) != nonceLen {
		return "", nil, &refusal{RefusedSignature, errors.New("signed without a nonce")}
	}
	if err := n.seen.admit(e.At, [nonceLen]byte(nonce), now); err != nil {
		return "", nil, err
	}
	if e.Error != "" {
		return e.From, nil, &RemoteError{Text: e.Error}
	}
	return e.From, e.Body, nil
}

// replayGuard remembers the nonce of every message accepted while its
// timestamp is still within the skew window, so a captured message sent
// again (to the same subjects: the signature covers them) is refused.
// Nonces are kept in buckets by the second of their timestamp, and a
// bucket goes once every message in it is too old to be accepted anyway.
type replayGuard struct {
	mu      sync.Mutex
	buckets map[int64]map[[nonceLen]byte]struct{}
	n       int
	// floor (unix ns): messages signed earlier are refused. It starts at
	// this broker's start, since the nonces seen before a restart are
	// gone, and rises when the cache is full and forgets a second.
	floor int64
	swept int64 // the second of the last sweep
}

func newReplayGuard(now time.Time) *replayGuard {
	return &replayGuard{buckets: map[int64]map[[nonceLen]byte]struct{}{}, floor: now.UnixNano()}
}

// admit records nonce, refusing one seen before or signed before floor.
func (g *replayGuard) admit(at int64, nonce [nonceLen]byte, now time.Time) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if at < g.floor {
		return &refusal{RefusedStale, errors.New("signed before this broker could remember its nonce")}
	}
	if sec := now.Unix(); sec != g.swept {
		g.swept = sec
		expired := now.Add(-maxSkew).UnixNano()
		for s, b := range g.buckets {
			if (s+1)*int64(time.Second) <= expired {
				g.n -= len(b)
				delete(g.buckets, s)
			}
		}
	}
	sec := at / int64(time.Second)
	b := g.buckets[sec]
	if _, ok := b[nonce]; ok {
		return &refusal{RefusedReplay, errReplayed}
	}
	if b == nil {
		b = map[[nonceLen]byte]struct{}{}
		g.buckets[sec] = b
	}
	b[nonce] = struct{}{}
	g.n++
	for g.n > maxNonces {
		oldest := sec
		for s := range g.buckets {
			oldest = min(oldest, s)
		}
		g.n -= len(g.buckets[oldest])
		delete(g.buckets, oldest)
		g.floor = max(g.floor, (oldest+1)*int64(time.Second))
	}
	return nil
}
