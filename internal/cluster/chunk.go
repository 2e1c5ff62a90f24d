package cluster

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
)

// A message larger than the NATS server's max_payload (read at connect)
// travels in chunks: each one sealed on its own, bound to its subjects
// and its place ("<id> <index> <count>", the random id and the place in
// the clear Nexus-Part header), published back to back, and reassembled
// in order by the receiver before the whole is opened (its timestamp and
// nonce checked) as one message. A chunk out of place, or a
// message whose chunks stop coming, fails that request at once.

const (
	partHeader = "Nexus-Part"
	// MaxMessage bounds one cluster message, chunked or not: a client's
	// largest WebSocket message, base64 in its envelope, fits.
	MaxMessage = 32 << 20
	// maxPending bounds the bytes of chunked messages being reassembled.
	maxPending = 64 << 20
	// headerRoom is what a message's headers take of max_payload.
	headerRoom = 256
	// MinPayload is the smallest max_payload cluster mode works with.
	MinPayload = 1 << 10
	// partialFor is how long a chunked message may take to arrive whole:
	// its chunks are published back to back.
	partialFor = time.Second
)

// ErrIncomplete is a chunked message some chunk of which never arrived.
var ErrIncomplete = errors.New("incomplete message")

// publish sends data to subject, sealed for p, in as many chunks as the
// server's max_payload needs.
func (n *Node) publish(nc *nats.Conn, p purpose, subject, reply string, data []byte) error {
	if len(data) > MaxMessage {
		return fmt.Errorf("cluster: a %d-byte message exceeds the %d-byte limit of one cluster message", len(data), MaxMessage)
	}
	room := int(nc.MaxPayload()) - headerRoom - sealOverhead
	if len(data) <= room {
		sealed, err := n.keys.seal(p, subject, reply, "", data)
		if err != nil {
			return err
		}
		return nc.PublishMsg(&nats.Msg{Subject: subject, Reply: reply, Data: sealed})
	}
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return err
	}
	id, count := hex.EncodeToString(b[:]), (len(data)+room-1)/room
	for i := range count {
		part := id + " " + strconv.Itoa(i) + " " + strconv.Itoa(count)
		sealed, err := n.keys.seal(p, subject, reply, part, data[i*room:min(len(data), (i+1)*room)])
		if err != nil {
			return err
		}
		msg := &nats.Msg{Subject: subject, Reply: reply, Data: sealed, Header: nats.Header{}}
		msg.Header.Set(partHeader, part)
		if err := nc.PublishMsg(msg); err != nil {
			return err
		}
	}
	return nil
}

// assembly is one chunked message being received.
type assembly struct {
	next, count int
	data        []byte
	timer       *time.Timer
}

// assembler holds the chunked messages being received, by subject, reply
// subject and id.
type assembler struct {
	mu      sync.Mutex
	parts   map[string]*assembly
	pending int
}

// receive unseals msg, sealed for p, and returns its data: at once for a
// whole message; for a chunk, done is false until the last one. A broken
// chunked message is ErrIncomplete; one whose chunks stop coming is
// reported to incomplete after partialFor.
func (n *Node) receive(p purpose, msg *nats.Msg) (data []byte, done bool, err error) {
	part := msg.Header.Get(partHeader)
	plain, err := n.keys.open(p, msg.Subject, msg.Reply, part, msg.Data)
	if err != nil {
		return nil, false, n.count(err)
	}
	if part == "" {
		return plain, true, nil
	}
	f := strings.Fields(part)
	if len(f) != 3 {
		return nil, false, fmt.Errorf("%w: chunk header %q", ErrIncomplete, part)
	}
	i, err1 := strconv.Atoi(f[1])
	count, err2 := strconv.Atoi(f[2])
	if err1 != nil || err2 != nil || i < 0 || count < 2 || i >= count {
		return nil, false, fmt.Errorf("%w: chunk header %q", ErrIncomplete, part)
	}
	key := msg.Subject + " " + msg.Reply + " " + f[0]
	a := &n.parts
	a.mu.Lock()
	defer a.mu.Unlock()
	as := a.parts[key]
	switch {
	case as == nil && i == 0:
		as = &assembly{count: count}
		as.timer = time.AfterFunc(partialFor, func() {
			a.mu.Lock()
			gone := a.parts[key] == as
			if gone {
				a.drop(key, as)
			}
			a.mu.Unlock()
			if gone {
				n.incomplete(msg.Subject, msg.Reply, fmt.Errorf("%w: chunk %d of %d did not arrive within %s", ErrIncomplete, as.next+1, count, partialFor))
			}
		})
		a.parts[key] = as
	case as == nil:
		return nil, false, fmt.Errorf("%w: chunk %d of %d arrived without those before it", ErrIncomplete, i+1, count)
	case i != as.next || count != as.count:
		a.drop(key, as)
		return nil, false, fmt.Errorf("%w: chunk %d of %d arrived where chunk %d was due", ErrIncomplete, i+1, count, as.next+1)
	}
	if len(as.data)+len(plain) > MaxMessage || a.pending+len(plain) > maxPending {
		a.drop(key, as)
		return nil, false, fmt.Errorf("%w: too large to reassemble now (%d bytes pending)", ErrIncomplete, a.pending)
	}
	as.data = append(as.data, plain...)
	a.pending += len(plain)
	as.next++
	if as.next < as.count {
		return nil, false, nil
	}
	a.drop(key, as)
	return as.data, true, nil
}

// drop forgets an assembly; a.mu is held.
func (a *assembler) drop(key string, p *assembly) {
	p.timer.Stop()
	a.pending -= len(p.data)
	delete(a.parts, key)
}

// incomplete fails the request a broken chunked message was part of: the
// answer to a request of ours, or the request a peer sent (answered with
// the error, so its sender need not wait out its deadline).
func (n *Node) incomplete(subject, reply string, err error) {
	if strings.HasPrefix(subject, n.inbox+".") {
		n.deliver(subject, "", result{err: err})
		return
	}
	n.quiet.Warn(subject, "cluster: request incomplete", "subject", subject, "error", err)
	n.respond(reply, envelope{Error: err.Error()})
}
