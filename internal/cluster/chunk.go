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
// travels in chunks: each one signed over its subjects, its place
// ("<id> <index> <count>") and its bytes, published back to back, and
// reassembled in order by the receiver before the whole is opened (its
// timestamp and nonce checked) as one message. A chunk out of place, or a
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

// publish sends data to subject, signed, in as many chunks as the server's
// max_payload needs.
func (n *Node) publish(nc *nats.Conn, subject, reply string, data []byte) error {
	if len(data) > MaxMessage {
		return fmt.Errorf("cluster: a %d-byte message exceeds the %d-byte limit of one cluster message", len(data), MaxMessage)
	}
	room := int(nc.MaxPayload()) - headerRoom
	if len(data) <= room {
		msg := &nats.Msg{Subject: subject, Reply: reply, Data: data}
		n.sign(msg, "")
		return nc.PublishMsg(msg)
	}
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return err
	}
	id, count := hex.EncodeToString(b[:]), (len(data)+room-1)/room
	for i := range count {
		part := id + " " + strconv.Itoa(i) + " " + strconv.Itoa(count)
		msg := &nats.Msg{Subject: subject, Reply: reply, Data: data[i*room : min(len(data), (i+1)*room)], Header: nats.Header{}}
		msg.Header.Set(partHeader, part)
		n.sign(msg, part)
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

// receive verifies msg's signature and returns its data: at once for a
// whole message; for a chunk, done is false until the last one. A broken
// chunked message is ErrIncomplete; one whose chunks stop coming is
// reported to incomplete after partialFor.
func (n *Node) receive(msg *nats.Msg) (data []byte, done bool, err error) {
	part := msg.Header.Get(partHeader)
	if err := n.verify(msg, part); err != nil {
		return nil, false, n.count(err)
	}
	if part == "" {
		return msg.Data, true, nil
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
	p := a.parts[key]
	switch {
	case p == nil && i == 0:
		p = &assembly{count: count}
		p.timer = time.AfterFunc(partialFor, func() {
			a.mu.Lock()
			gone := a.parts[key] == p
			if gone {
				a.drop(key, p)
			}
			a.mu.Unlock()
			if gone {
				n.incomplete(msg.Subject, msg.Reply, fmt.Errorf("%w: chunk %d of %d did not arrive within %s", ErrIncomplete, p.next+1, count, partialFor))
			}
		})
		a.parts[key] = p
	case p == nil:
		return nil, false, fmt.Errorf("%w: chunk %d of %d arrived without those before it", ErrIncomplete, i+1, count)
	case i != p.next || count != p.count:
		a.drop(key, p)
		return nil, false, fmt.Errorf("%w: chunk %d of %d arrived where chunk %d was due", ErrIncomplete, i+1, count, p.next+1)
	}
	if len(p.data)+len(msg.Data) > MaxMessage || a.pending+len(msg.Data) > maxPending {
		a.drop(key, p)
		return nil, false, fmt.Errorf("%w: too large to reassemble now (%d bytes pending)", ErrIncomplete, a.pending)
	}
	p.data = append(p.data, msg.Data...)
	a.pending += len(msg.Data)
	p.next++
	if p.next < p.count {
		return nil, false, nil
	}
	a.drop(key, p)
	return p.data, true, nil
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
		n.deliver(subject, result{err: err})
		return
	}
	n.log.Warn("cluster: request incomplete", "subject", subject, "error", err)
	n.respond(reply, envelope{Error: err.Error()})
}
