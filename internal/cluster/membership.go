package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
)

// opLive asks whether a broker answers for an id: a booting broker asks
// it of its own id before it subscribes to its subjects.
const opLive = "live"

// Peer is one broker as the heartbeats show it.
type Peer struct {
	ID        string
	Advertise string
	Reachable bool
	// Free is how many claims it would take without queueing, and
	// Binaries the registry entries it spawns, as its last heartbeat said.
	Free     int
	Binaries []string
}

// Serves reports whether p spawns binary ("" is the default entry, which
// every broker has).
func (p Peer) Serves(binary string) bool {
	return binary == "" || slices.Contains(p.Binaries, binary)
}

type peer struct {
	advertise string
	lastSeen  time.Time
	free      int
	binaries  []string
}

// twin is the last heartbeat heard with this broker's id from another
// process.
type twin struct {
	advertise string
	at        time.Time
}

type heartbeat struct {
	Advertise string `json:"advertise"`
	// Free is how many claims the broker would take now without queueing.
	Free int `json:"free,omitempty"`
	// Instance is random for each start of a broker.
	Instance string `json:"instance"`
	// Binaries are the registry entries the broker spawns.
	Binaries []string `json:"binaries,omitempty"`
}

// liveAnswer is a broker answering for its id.
type liveAnswer struct {
	Advertise string `json:"advertise"`
	Instance  string `json:"instance"`
}

func (n *Node) live(context.Context, string, json.RawMessage) (any, error) {
	return liveAnswer{Advertise: n.advertise, Instance: n.instance}, nil
}

// probe asks whether a broker answers for this broker's id. One that
// does refuses the boot, naming its advertise_addr. NATS saying nobody
// subscribes is the expected answer; no answer at all (a frozen process
// holding the subscription) is logged and the boot goes on: the
// heartbeats tell twins apart from then on.
func (n *Node) probe(nc *nats.Conn) error {
	var a liveAnswer
	err := n.call(nc, n.ctx, CallTimeout, n.id, opLive, nil, &a)
	switch {
	case err == nil:
		return bootError{fmt.Errorf("cluster: broker_id %q is live: the broker at advertise_addr %s answers for it; give this broker a broker_id of its own (or stop that one first)", n.id, a.Advertise)}
	case errors.Is(err, ErrNoResponders):
		return nil
	default:
		n.log.Warn("cluster: could not tell whether another broker uses this broker_id; joining", "broker_id", n.id, "error", err)
		return nil
	}
}

// twinErr names another process heartbeating with this broker's id within
// the last missedBeats intervals.
func (n *Node) twinErr() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.twin.at.IsZero() || time.Since(n.twin.at) >= missedBeats*n.every {
		return nil
	}
	return fmt.Errorf("cluster: another broker heartbeats with this broker's id %q, from advertise_addr %s; give each broker a broker_id of its own", n.id, n.twin.advertise)
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
		hb := heartbeat{Advertise: n.advertise, Instance: n.instance}
		if n.free != nil {
			hb.Free = n.free()
		}
		if n.binaries != nil {
			hb.Binaries = n.binaries()
		}
		if data, err := n.stampBody(hb, time.Time{}); err == nil {
			_ = n.publish(nc, forHeartbeat, n.prefix+"."+opHeartbeat, "", data) // fails while disconnected; failures count in ReconnectErrHandler
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
	data, done, err := n.receive(forHeartbeat, msg)
	if err != nil || !done {
		return
	}
	e, err := n.open(data)
	if err != nil {
		return
	}
	var hb heartbeat
	if json.Unmarshal(e.Body, &hb) != nil {
		return
	}
	if e.From == n.id {
		n.heardSelf(hb)
		return
	}
	n.mu.Lock()
	p := n.peers[e.From]
	if p == nil {
		p = &peer{}
		n.peers[e.From] = p
		n.log.Info("cluster: peer joined", "peer", e.From, "advertise", hb.Advertise)
	}
	p.advertise, p.lastSeen, p.free, p.binaries = hb.Advertise, time.Now(), hb.Free, hb.Binaries
	n.mu.Unlock()
	if hb.Free > 0 && n.peerFree != nil {
		n.peerFree(e.From)
	}
}

// heardSelf is a heartbeat naming this broker's id: its own, back through
// NATS (the link works), or another process's (two brokers, one id).
func (n *Node) heardSelf(hb heartbeat) {
	if hb.Instance == n.instance {
		n.selfSeen.Store(time.Now().UnixNano())
		return
	}
	n.mu.Lock()
	first := n.twin.at.IsZero() || time.Since(n.twin.at) >= missedBeats*n.every
	n.twin = twin{advertise: hb.Advertise, at: time.Now()}
	n.mu.Unlock()
	if first {
		n.log.Error("cluster: another broker heartbeats with this broker's id; GET /readyz is 503 while it does", "broker_id", n.id, "its_advertise_addr", hb.Advertise)
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

func (n *Node) view(id string, p *peer) Peer {
	return Peer{ID: id, Advertise: p.advertise, Reachable: n.current(p), Free: p.free, Binaries: p.binaries}
}

// Peer is broker id as its heartbeats show it; ok is false for a broker
// never heard.
func (n *Node) Peer(id string) (_ Peer, ok bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	p := n.peers[id]
	if p == nil {
		return Peer{}, false
	}
	return n.view(id, p), true
}

// Peers lists every broker heard from but this one, sorted by id.
func (n *Node) Peers() []Peer {
	n.mu.Lock()
	defer n.mu.Unlock()
	out := make([]Peer, 0, len(n.peers))
	for id, p := range n.peers {
		out = append(out, n.view(id, p))
	}
	slices.SortFunc(out, func(a, b Peer) int { return strings.Compare(a.ID, b.ID) })
	return out
}
