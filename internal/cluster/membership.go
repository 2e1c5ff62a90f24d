package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
)

// opLive asks whether a broker answers for an id: a booting broker asks
// it of its own id before it subscribes to its subjects.
const opLive = "live"

// Protocol is the version of the cluster wire this broker speaks, sent
// with each heartbeat. A broker routes to peers speaking Protocol-1 up to
// Protocol (so a rolling upgrade of one version at a time keeps serving)
// and lists any other without routing to it. A heartbeat that states no
// version is 0: the sealed wire before the version was stated, which is
// the one of version 1.
const Protocol = 1

// Compatible reports whether a peer speaking protocol is routed to.
func Compatible(protocol int) bool { return protocol >= Protocol-1 && protocol <= Protocol }

// Load is a broker's slots and queue, as its heartbeat says.
type Load struct {
	SlotsInUse    int `json:"slots_in_use"`
	MaxConcurrent int `json:"max_concurrent"`
	QueueDepth    int `json:"queue_depth"`
}

// Peer is one broker as the heartbeats show it.
type Peer struct {
	ID        string
	Advertise string
	// Reachable is a current heartbeat of a compatible protocol: the peer
	// is routed to.
	Reachable bool
	// Free is how many claims it would take without queueing, and
	// Binaries the registry entries it spawns, as its last heartbeat said.
	Free     int
	Binaries []string
	Load     Load
	// Draining is a peer taking no new claims or offers (its leases
	// keep working).
	Draining bool
	// Protocol and Version are the cluster wire it speaks and its build;
	// Compatible is whether that protocol is routed to.
	Protocol   int
	Compatible bool
	Version    string
	// LastHeartbeat is when its last heartbeat arrived (zero for this
	// broker's own view).
	LastHeartbeat time.Time
}

// Serves reports whether p spawns binary ("" is the default entry, which
// every broker has).
func (p Peer) Serves(binary string) bool {
	return binary == "" || slices.Contains(p.Binaries, binary)
}

// Offerable reports whether a claim for binary may be offered to p: it is
// routed to, not draining, spawns binary and had a free slot.
func (p Peer) Offerable(binary string) bool {
	return p.Reachable && !p.Draining && p.Free > 0 && p.Serves(binary)
}

type peer struct {
	hb       heartbeat
	lastSeen time.Time
}

// members is the membership as heartbeats tell it, and as it was kept
// across restarts (the record, saved in MembersFile).
type members struct {
	// mu guards peers, twin and the record.
	mu sync.Mutex
	// peers is the list: brokers heard, less those that left or stayed
	// silent for forgetAfter.
	peers map[string]*peer
	twin  twin // another process heartbeating with this broker's id
	// forgetAfter is cluster.forget_after.
	forgetAfter time.Duration
	// record holds every broker heard, here or before a restart, that has
	// not been silent for forgetAfter: a broker that left stays in it, so
	// its leases (which outlive its gateway) are 503 while it is away,
	// never 404.
	record     map[string]*recorded
	recordPath string
	// recordDirty is a record change not yet saved; recordSaved when it
	// last was.
	recordDirty bool
	recordSaved time.Time
}

// twin is the last heartbeat heard with this broker's id from another
// process.
type twin struct {
	advertise string
	at        time.Time
}

type heartbeat struct {
	Advertise string `json:"advertise"`
	// Free is how many claims the broker would take now without queueing:
	// 0 while it drains.
	Free int `json:"free,omitempty"`
	// Instance is random for each start of a broker.
	Instance string `json:"instance"`
	// Binaries are the registry entries the broker spawns.
	Binaries []string `json:"binaries,omitempty"`
	Load     Load     `json:"load"`
	Draining bool     `json:"draining,omitempty"`
	// Leaving is the last heartbeat of a broker that stops cleanly.
	Leaving  bool   `json:"leaving,omitempty"`
	Protocol int    `json:"protocol"`
	Version  string `json:"version,omitempty"`
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

// SetDraining starts (true) or ends a drain: the heartbeats say so, and
// report no free slot while it lasts.
func (n *Node) SetDraining(on bool) {
	n.draining.Store(on)
	n.BeatNow()
}

// heartbeat is what this broker's heartbeat says now; leaving for its
// last one.
func (n *Node) heartbeat(leaving bool) heartbeat {
	hb := heartbeat{Advertise: n.advertise, Instance: n.instance, Draining: n.draining.Load(), Leaving: leaving, Protocol: n.protocol, Version: Version}
	if n.free != nil && !hb.Draining {
		hb.Free = n.free()
	}
	if n.binaries != nil {
		hb.Binaries = n.binaries()
	}
	if n.load != nil {
		hb.Load = n.load()
	}
	return hb
}

func (n *Node) beat(nc *nats.Conn) {
	defer n.wg.Done()
	t := time.NewTicker(n.every)
	defer t.Stop()
	for {
		if data, err := n.stampBody(n.heartbeat(false), time.Time{}); err == nil {
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
		n.sweep(time.Now())
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
	if hb.Leaving {
		n.left(e.From, hb)
		return
	}
	now := time.Now()
	n.mu.Lock()
	p := n.peers[e.From]
	if p == nil {
		p = &peer{}
		n.peers[e.From] = p
		n.log.Info("cluster: peer joined", "peer", e.From, "advertise", hb.Advertise, "protocol", hb.Protocol, "version", hb.Version)
		if !Compatible(hb.Protocol) {
			n.log.Warn("cluster: a peer speaks a protocol this broker does not route to; upgrade the brokers one version at a time", "peer", e.From,
				"its_protocol", hb.Protocol, "routed_protocols", fmt.Sprintf("%d..%d", Protocol-1, Protocol))
		}
	}
	p.hb, p.lastSeen = hb, now
	n.remember(e.From, hb.Advertise, now)
	n.mu.Unlock()
	if hb.Free > 0 && !hb.Draining && Compatible(hb.Protocol) && n.peerFree != nil {
		n.peerFree(e.From)
	}
}

// left takes a peer's last heartbeat: it leaves the list at once. It
// stays in the record: its leases outlive its gateway.
func (n *Node) left(id string, hb heartbeat) {
	n.mu.Lock()
	p := n.peers[id]
	gone := p != nil && p.hb.Instance == hb.Instance // not a new start's list entry
	if gone {
		delete(n.peers, id)
	}
	n.mu.Unlock()
	if gone {
		n.log.Info("cluster: peer left", "peer", id, "advertise", hb.Advertise)
	}
}

// sweep drops the peers silent for forgetAfter from the list and the
// record, and saves the record when it changed (or, so that the time each
// broker was last seen survives a crash, once every recordRefresh).
func (n *Node) sweep(now time.Time) {
	n.mu.Lock()
	for id, p := range n.peers {
		if now.Sub(p.lastSeen) >= n.forgetAfter {
			delete(n.peers, id)
			n.log.Info("cluster: peer forgotten: silent for cluster.forget_after", "peer", id, "advertise", p.hb.Advertise,
				"last_heartbeat", p.lastSeen.UTC().Format(time.RFC3339), "forget_after", n.forgetAfter)
		}
	}
	n.forget(now)
	save := n.recordDirty || now.Sub(n.recordSaved) >= recordRefresh
	n.mu.Unlock()
	if save {
		n.saveRecord(now)
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

// Known reports whether id is this broker or a broker on the list.
func (n *Node) Known(id string) bool {
	if id == n.id {
		return true
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.peers[id] != nil
}

// Remembered reports whether id is this broker, or a broker heard since
// this one started or before (the record kept in MembersFile) and not
// silent since for cluster.forget_after: NATS saying nobody subscribes
// to its subjects is then an outage, not an unknown broker.
func (n *Node) Remembered(id string) bool {
	if id == n.id {
		return true
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.peers[id] != nil || n.record[id] != nil
}

// Reachable reports whether peer id's heartbeat is current and its
// protocol one this broker routes to.
func (n *Node) Reachable(id string) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	p := n.peers[id]
	return p != nil && n.current(p) && Compatible(p.hb.Protocol)
}

func (n *Node) current(p *peer) bool {
	return time.Since(p.lastSeen) < missedBeats*n.every && n.nc.Load() != nil && n.nc.Load().IsConnected()
}

func view(id string, hb heartbeat) Peer {
	return Peer{ID: id, Advertise: hb.Advertise, Free: hb.Free, Binaries: hb.Binaries, Load: hb.Load, Draining: hb.Draining,
		Protocol: hb.Protocol, Compatible: Compatible(hb.Protocol), Version: hb.Version}
}

func (n *Node) view(id string, p *peer) Peer {
	v := view(id, p.hb)
	v.Reachable, v.LastHeartbeat = v.Compatible && n.current(p), p.lastSeen
	return v
}

// Self is this broker as its next heartbeat will show it; LastHeartbeat
// is when its own last came back through NATS.
func (n *Node) Self() Peer {
	v := view(n.id, n.heartbeat(false))
	v.Reachable = n.Ready() == nil
	if at := n.selfSeen.Load(); at != 0 {
		v.LastHeartbeat = time.Unix(0, at)
	}
	return v
}

// Peer is broker id as its heartbeats show it; ok is false for a broker
// not on the list.
func (n *Node) Peer(id string) (_ Peer, ok bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	p := n.peers[id]
	if p == nil {
		return Peer{}, false
	}
	return n.view(id, p), true
}

// Peers lists every broker on the list but this one, sorted by id.
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
