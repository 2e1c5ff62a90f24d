package cluster

import (
	"crypto/cipher"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"golang.org/x/crypto/chacha20poly1305"
	"golang.org/x/crypto/hkdf"
)

// Why a sealed-message check refused a message: the values of
// nexus_broker_cluster_messages_refused_total.
const (
	RefusedSeal   = "seal"   // not sealed with the cluster secret, or sealed for other subjects or another purpose
	RefusedStale  = "stale"  // sealed outside the skew window, or before this broker could remember it
	RefusedReplay = "replay" // its nonce was seen before: a captured message sent again
	RefusedLate   = "late"   // a request that arrived after its caller's deadline: the caller has given up on it
)

// RefusedReasons lists every refusal reason, in exposition order.
var RefusedReasons = []string{RefusedSeal, RefusedStale, RefusedReplay, RefusedLate}

const (
	// nonceLen is a message's replay nonce, in bytes: random, never reused.
	nonceLen = 16
	// maxNonces bounds the replay cache. Past it the oldest second of
	// nonces is forgotten and messages sealed in it are refused from then
	// on, so the cache never grows and never lets a replay through.
	maxNonces = 1 << 17
	// sealVersion starts every sealed message (and its additional data):
	// the signed-but-clear protocol before it had none, so brokers of the
	// two refuse each other.
	sealVersion = 2
	// sealOverhead is what sealing adds to a message's bytes.
	sealOverhead = 1 + chacha20poly1305.NonceSizeX + chacha20poly1305.Overhead
)

// purpose is what a sealed message is for; each has a key of its own,
// so a message sealed as one (a reply, say) never opens as another.
type purpose int

const (
	forRequest purpose = iota
	forReply
	forHeartbeat
	purposes
)

// purposeLabels are the HKDF labels of each purpose's key.
var purposeLabels = [purposes]string{
	"nexus-broker cluster v2: request",
	"nexus-broker cluster v2: reply",
	"nexus-broker cluster v2: heartbeat",
}

// sealer seals and opens messages with XChaCha20-Poly1305, under keys
// derived from the cluster secret by HKDF-SHA256, one per purpose. The
// additional data is the message's subject, reply subject and chunk
// header, so a sealed message is bound to where it goes and where its
// answer goes.
type sealer struct {
	aead [purposes]cipher.AEAD
}

func newSealer(secret []byte) *sealer {
	s := &sealer{}
	for p, label := range purposeLabels {
		key := make([]byte, chacha20poly1305.KeySize)
		if _, err := io.ReadFull(hkdf.New(sha256.New, secret, nil, []byte(label)), key); err != nil {
			panic(err) // HKDF-SHA256 yields far more than 32 bytes
		}
		a, err := chacha20poly1305.NewX(key)
		if err != nil {
			panic(err) // the key has the right size
		}
		s.aead[p] = a
	}
	return s
}

func additional(subject, reply, part string) []byte {
	ad := make([]byte, 0, 3+len(subject)+len(reply)+len(part))
	ad = append(ad, sealVersion)
	for _, s := range []string{subject, reply, part} {
		ad = append(ad, s...)
		ad = append(ad, 0)
	}
	return ad
}

// seal is plain sealed for p, to subject with reply and chunk header part:
// the version, a random nonce, the ciphertext.
func (s *sealer) seal(p purpose, subject, reply, part string, plain []byte) ([]byte, error) {
	out := make([]byte, 1+chacha20poly1305.NonceSizeX, sealOverhead+len(plain))
	out[0] = sealVersion
	if _, err := rand.Read(out[1:]); err != nil {
		return nil, err
	}
	return s.aead[p].Seal(out, out[1:], plain, additional(subject, reply, part)), nil
}

var errNotSealed = errors.New("not sealed with the cluster secret for this subject")

// open is the plaintext of a message sealed for p to subject, reply and
// part; anything else is a RefusedSeal refusal.
func (s *sealer) open(p purpose, subject, reply, part string, data []byte) ([]byte, error) {
	if len(data) < sealOverhead || data[0] != sealVersion {
		return nil, &refusal{RefusedSeal, errNotSealed}
	}
	nonce, ct := data[1:1+chacha20poly1305.NonceSizeX], data[1+chacha20poly1305.NonceSizeX:]
	plain, err := s.aead[p].Open(nil, nonce, ct, additional(subject, reply, part))
	if err != nil {
		return nil, &refusal{RefusedSeal, errNotSealed}
	}
	return plain, nil
}

// envelope is every message's plaintext: who sent it, when, a nonce, the
// caller's deadline (a request), and what.
type envelope struct {
	From  string `json:"from"`
	At    int64  `json:"at"`
	Nonce string `json:"nonce"`
	// Deadline (unix ns) is when the caller of a request gives up on it;
	// the owner drops one that arrives later, so a request answered 503
	// for a timeout is never carried out afterwards.
	Deadline int64           `json:"deadline,omitempty"`
	Body     json.RawMessage `json:"body,omitempty"`
	Error    string          `json:"error,omitempty"`
}

// refusal is a sealed-message check that failed, with its metric reason.
type refusal struct {
	reason string
	err    error
}

func (r *refusal) Error() string { return r.err.Error() }

var errReplayed = errors.New("replayed: its nonce was seen before")

// stamp is e, from this broker, now, with a fresh nonce, JSON-encoded:
// the plaintext publish seals.
func (n *Node) stamp(e envelope) ([]byte, error) {
	var b [nonceLen]byte
	if _, err := rand.Read(b[:]); err != nil {
		return nil, err
	}
	e.From, e.At, e.Nonce = n.id, time.Now().UnixNano(), hex.EncodeToString(b[:])
	return json.Marshal(e)
}

// stampBody is body, JSON-encoded, in a fresh envelope with deadline.
func (n *Node) stampBody(body any, deadline time.Time) ([]byte, error) {
	raw, err := json.Marshal(body)
	if err != nil {
		return nil, err
	}
	e := envelope{Body: raw}
	if !deadline.IsZero() {
		e.Deadline = deadline.UnixNano()
	}
	return n.stamp(e)
}

// count counts err when it is a refusal, and returns it.
func (n *Node) count(err error) error {
	var r *refusal
	if errors.As(err, &r) {
		n.refused[r.reason].Add(1)
	}
	return err
}

// open checks a received message's envelope, once it (or every chunk of
// it) has been unsealed: its freshness and its nonce. A handler's error in
// a reply is a *RemoteError.
func (n *Node) open(plain []byte) (envelope, error) {
	e, err := n.check(plain)
	return e, n.count(err)
}

func (n *Node) check(plain []byte) (envelope, error) {
	var e envelope
	if err := json.Unmarshal(plain, &e); err != nil {
		return e, &refusal{RefusedSeal, fmt.Errorf("sealed but unreadable: %v", err)}
	}
	now := time.Now()
	if d := now.Sub(time.Unix(0, e.At)); d > maxSkew || d < -maxSkew {
		return e, &refusal{RefusedStale, fmt.Errorf("sealed %s away from this broker's clock", d)}
	}
	nonce, err := hex.DecodeString(e.Nonce)
	if err != nil || len(nonce) != nonceLen {
		return e, &refusal{RefusedSeal, errors.New("sealed without a nonce")}
	}
	if err := n.seen.admit(e.At, [nonceLen]byte(nonce), now); err != nil {
		return e, err
	}
	if e.Error != "" {
		return e, &RemoteError{Text: e.Error}
	}
	return e, nil
}

// replayGuard remembers the nonce of every message accepted while its
// timestamp is still within the skew window, so a captured message sent
// again (to the same subjects: the seal covers them) is refused.
// Nonces are kept in buckets by the second of their timestamp, and a
// bucket goes once every message in it is too old to be accepted anyway.
type replayGuard struct {
	mu      sync.Mutex
	buckets map[int64]map[[nonceLen]byte]struct{}
	n       int
	// floor (unix ns): messages sealed earlier are refused. It starts at
	// this broker's start, since the nonces seen before a restart are
	// gone, and rises when the cache is full and forgets a second.
	floor int64
	swept int64 // the second of the last sweep
}

func newReplayGuard(now time.Time) *replayGuard {
	return &replayGuard{buckets: map[int64]map[[nonceLen]byte]struct{}{}, floor: now.UnixNano()}
}

// admit records nonce, refusing one seen before or sealed before floor.
func (g *replayGuard) admit(at int64, nonce [nonceLen]byte, now time.Time) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if at < g.floor {
		return &refusal{RefusedStale, errors.New("sealed before this broker could remember its nonce")}
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
