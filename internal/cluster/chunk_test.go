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

// chunk is part i of count of message id, signed by n.
func (n *Node) chunk(subject, id string, i, count int, data string) *nats.Msg {
	part := id + " " + strconv.Itoa(i) + " " + strconv.Itoa(count)
	m := &nats.Msg{Subject: subject, Data: []byte(data), Header: nats.Header{}}
	m.Header.Set(partHeader, part)
	n.sign(m, part)
	return m
}

// TestChunksReassembleInOrderOrFail: a chunked message is whole once its
// last chunk arrives; a chunk out of place or one signed without the
// secret fails it; one whose chunks stop coming fails the request waiting
// for it within partialFor, never hangs.
func TestChunksReassembleInOrderOrFail(t *testing.T) {
	n := bareNode()
	subj := n.inbox + ".1"
	for i, want := range []bool{false, false, true} {
		data, done, err := n.receive(n.chunk(subj, "x", i, 3, strconv.Itoa(i)))
		if err != nil || done != want || (done && string(data) != "012") {
			t.Fatalf("chunk %d: %q done %v, %v", i, data, done, err)
		}
	}
	if _, _, err := n.receive(n.chunk(subj, "y", 0, 3, "0")); err != nil {
		t.Fatal(err)
	}
	if _, _, err := n.receive(n.chunk(subj, "y", 2, 3, "2")); !errors.Is(err, ErrIncomplete) {
		t.Fatalf("a chunk after a missing one: %v, want ErrIncomplete", err)
	}
	if _, _, err := n.receive(n.chunk(subj, "z", 1, 3, "1")); !errors.Is(err, ErrIncomplete) {
		t.Fatalf("a chunk without its first: %v, want ErrIncomplete", err)
	}
	forged := n.chunk(subj, "w", 0, 2, "0")
	forged.Data = []byte("1")
	if _, _, err := n.receive(forged); err == nil || n.Refused(RefusedSignature) != 1 {
		t.Fatalf("a chunk that does not match its signature: %v, %d refused", err, n.Refused(RefusedSignature))
	}

	ch := make(chan result, 1)
	n.waiting[subj] = ch
	if _, _, err := n.receive(n.chunk(subj, "v", 0, 2, "0")); err != nil {
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

// FuzzReceive: any chunk header, signed, is reassembled or refused without
// panicking, and the assembler's bookkeeping stays within its bounds.
func FuzzReceive(f *testing.F) {
	f.Add("abc 0 2", "abc 1 2", "xy")
	f.Add("abc 1 2", "abc 0 2", "")
	f.Add("a -1 3", "a 99999999999999999999 3", "z")
	f.Add("a 0 2 extra", " ", "z")
	f.Fuzz(func(t *testing.T, first, second, data string) {
		n := bareNode()
		for _, part := range []string{first, second} {
			m := &nats.Msg{Subject: "nexus.broker.b.a.send", Reply: "_INBOX.peer.1", Data: []byte(data), Header: nats.Header{}}
			m.Header.Set(partHeader, part)
			n.sign(m, part)
			got, done, err := n.receive(m)
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
