package cluster

import (
	"errors"
	"io"
	"log/slog"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
)

// bareNode is a Node without a connection, enough to receive messages.
func bareNode() *Node {
	return newNode("a", []byte("0123456789abcdef0123456789abcdef"), slog.New(slog.NewTextHandler(io.Discard, nil)))
}

// chunk is part i of count of message id, sealed by n as a reply.
func (n *Node) chunk(subject, id string, i, count int, data string) *nats.Msg {
	part := id + " " + strconv.Itoa(i) + " " + strconv.Itoa(count)
	return n.sealedPart(forReply, subject, "", part, data)
}

// sealedPart is data sealed by n for p, with chunk header part.
func (n *Node) sealedPart(p purpose, subject, reply, part, data string) *nats.Msg {
	sealed, err := n.keys.seal(p, subject, reply, part, []byte(data))
	if err != nil {
		panic(err)
	}
	m := &nats.Msg{Subject: subject, Reply: reply, Data: sealed, Header: nats.Header{}}
	m.Header.Set(partHeader, part)
	return m
}

// TestChunksReassembleInOrderOrFail: a chunked message is whole once its
// last chunk arrives; a chunk out of place or one sealed without the
// secret fails it; one whose chunks stop coming fails the request waiting
// for it within partialFor, never hangs.
func TestChunksReassembleInOrderOrFail(t *testing.T) {
	n := bareNode()
	subj := n.inbox + ".1"
	for i, want := range []bool{false, false, true} {
		data, done, err := n.receive(forReply, n.chunk(subj, "x", i, 3, strconv.Itoa(i)))
		if err != nil || done != want || (done && string(data) != "012") {
			t.Fatalf("chunk %d: %q done %v, %v", i, data, done, err)
		}
	}
	if _, _, err := n.receive(forReply, n.chunk(subj, "y", 0, 3, "0")); err != nil {
		t.Fatal(err)
	}
	if _, _, err := n.receive(forReply, n.chunk(subj, "y", 2, 3, "2")); !errors.Is(err, ErrIncomplete) {
		t.Fatalf("a chunk after a missing one: %v, want ErrIncomplete", err)
	}
	if _, _, err := n.receive(forReply, n.chunk(subj, "z", 1, 3, "1")); !errors.Is(err, ErrIncomplete) {
		t.Fatalf("a chunk without its first: %v, want ErrIncomplete", err)
	}
	forged := n.chunk(subj, "w", 0, 2, "0")
	forged.Data[len(forged.Data)-1] ^= 1
	if _, _, err := n.receive(forReply, forged); err == nil || n.Refused(RefusedSeal) != 1 {
		t.Fatalf("a chunk that does not match its seal: %v, %d refused", err, n.Refused(RefusedSeal))
	}
	if _, _, err := n.receive(forRequest, n.chunk(subj, "u", 0, 2, "0")); err == nil || n.Refused(RefusedSeal) != 2 {
		t.Fatalf("a chunk sealed as a reply taken as a request: %v, %d refused", err, n.Refused(RefusedSeal))
	}

	ch := make(chan result, 1)
	n.waiting[subj] = waiter{to: "b", ch: ch}
	if _, _, err := n.receive(forReply, n.chunk(subj, "v", 0, 2, "0")); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-ch:
		if !errors.Is(r.err, ErrIncomplete) {
			t.Fatalf("a stalled answer: %v, want ErrIncomplete", r.err)
		}
	case <-time.After(10 * partialFor):
		t.Fatal("a stalled chunked answer left its request waiting")
	}
	n.parts.mu.Lock()
	defer n.parts.mu.Unlock()
	if len(n.parts.parts) != 0 || n.parts.pending != 0 {
		t.Fatalf("%d assemblies, %d bytes pending after every message ended", len(n.parts.parts), n.parts.pending)
	}
}

// FuzzReceive: any chunk header, sealed, is reassembled or refused without
// panicking, and the assembler's bookkeeping stays within its bounds.
func FuzzReceive(f *testing.F) {
	f.Add("abc 0 2", "abc 1 2", "xy")
	f.Add("abc 1 2", "abc 0 2", "")
	f.Add("a -1 3", "a 99999999999999999999 3", "z")
	f.Add("a 0 2 extra", " ", "z")
	f.Fuzz(func(t *testing.T, first, second, data string) {
		n := bareNode()
		for _, part := range []string{first, second} {
			m := n.sealedPart(forRequest, "nexus.broker.b.a.send", "_INBOX.peer.1", part, data)
			got, done, err := n.receive(forRequest, m)
			if done && err != nil || done && len(got) > 2*len(data) {
				t.Fatalf("part %q: %d bytes, done %v, %v", part, len(got), done, err)
			}
		}
		n.parts.mu.Lock()
		defer n.parts.mu.Unlock()
		if n.parts.pending < 0 || n.parts.pending > maxPending || len(n.parts.parts) > 2 {
			t.Fatalf("pending %d bytes in %d assemblies", n.parts.pending, len(n.parts.parts))
		}
		for k, p := range n.parts.parts {
			n.parts.drop(k, p)
		}
	})
}
