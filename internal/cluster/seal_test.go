package cluster

import (
	"bytes"
	"errors"
	"testing"
	"time"
)

// TestSealHidesAndBinds: a sealed message holds none of its plaintext,
// opens only for its own purpose, subject, reply subject and chunk
// header, only under the same secret, and not at all once a byte changes.
func TestSealHidesAndBinds(t *testing.T) {
	n := bareNode()
	plain := []byte(`{"ticket":"tk-0123456789","principal":{"id":"alice"}}`)
	sealed, err := n.keys.seal(forRequest, "nexus.broker.b.a.ticket", "_INBOX.b.x.1", "", plain)
	if err != nil {
		t.Fatal(err)
	}
	for _, secret := range [][]byte{[]byte("tk-0123456789"), []byte("alice"), []byte("ticket")} {
		if bytes.Contains(sealed, secret) {
			t.Fatalf("the sealed message shows %q", secret)
		}
	}
	if got, err := n.keys.open(forRequest, "nexus.broker.b.a.ticket", "_INBOX.b.x.1", "", sealed); err != nil || !bytes.Equal(got, plain) {
		t.Fatalf("open: %q, %v", got, err)
	}
	other := newSealer([]byte("another-secret-0123456789abcdefgh"))
	for name, open := range map[string]func() ([]byte, error){
		"as a reply": func() ([]byte, error) {
			return n.keys.open(forReply, "nexus.broker.b.a.ticket", "_INBOX.b.x.1", "", sealed)
		},
		"as a heartbeat": func() ([]byte, error) {
			return n.keys.open(forHeartbeat, "nexus.broker.b.a.ticket", "_INBOX.b.x.1", "", sealed)
		},
		"to another subject": func() ([]byte, error) {
			return n.keys.open(forRequest, "nexus.broker.b.a.release", "_INBOX.b.x.1", "", sealed)
		},
		"with another reply": func() ([]byte, error) {
			return n.keys.open(forRequest, "nexus.broker.b.a.ticket", "_INBOX.spy.1", "", sealed)
		},
		"as a chunk": func() ([]byte, error) {
			return n.keys.open(forRequest, "nexus.broker.b.a.ticket", "_INBOX.b.x.1", "x 0 2", sealed)
		},
		"under another key": func() ([]byte, error) {
			return other.open(forRequest, "nexus.broker.b.a.ticket", "_INBOX.b.x.1", "", sealed)
		},
		"of the old protocol": func() ([]byte, error) {
			return n.keys.open(forRequest, "nexus.broker.b.a.ticket", "_INBOX.b.x.1", "", plain)
		},
	} {
		var r *refusal
		if got, err := open(); !errors.As(err, &r) || r.reason != RefusedSeal {
			t.Errorf("opened %s: %q, %v; want a %s refusal", name, got, err, RefusedSeal)
		}
	}
	for i := range sealed {
		c := bytes.Clone(sealed)
		c[i] ^= 0x40
		if _, err := n.keys.open(forRequest, "nexus.broker.b.a.ticket", "_INBOX.b.x.1", "", c); err == nil {
			t.Fatalf("byte %d changed and the message still opened", i)
		}
	}
}

// TestOpenRefusesStaleAndReplayedEnvelopes: an envelope opens once; again
// it is a replay; one stamped outside the skew window is stale.
func TestOpenRefusesStaleAndReplayedEnvelopes(t *testing.T) {
	n := bareNode()
	plain, err := n.stampBody("hello", time.Time{})
	if err != nil {
		t.Fatal(err)
	}
	if e, err := n.open(plain); err != nil || e.From != "a" || string(e.Body) != `"hello"` {
		t.Fatalf("first open: %+v, %v", e, err)
	}
	if _, err := n.open(plain); n.Refused(RefusedReplay) != 1 {
		t.Fatalf("the same envelope again: %v, %d replays refused", err, n.Refused(RefusedReplay))
	}
	old := []byte(`{"from":"b","at":1,"nonce":"00112233445566778899aabbccddeeff"}`)
	if _, err := n.open(old); n.Refused(RefusedStale) != 1 {
		t.Fatalf("an envelope of 1970: %v, %d stale refused", err, n.Refused(RefusedStale))
	}
}

// FuzzOpenSealed: whatever bytes arrive as a message, with whatever chunk
// header, unsealing and opening them never panics and never accepts
// anything but what a holder of the secret sealed for that very subject,
// reply subject and header.
func FuzzOpenSealed(f *testing.F) {
	n := bareNode()
	valid, err := n.stampBody(map[string]string{"lease": "x"}, time.Now().Add(time.Second))
	if err != nil {
		f.Fatal(err)
	}
	m := n.sealedPart(forRequest, "nexus.broker.b.a.release", "_INBOX.b.x.1", "", string(valid))
	f.Add(m.Data, "")
	f.Add(valid, "")
	f.Add([]byte{sealVersion}, "a 0 2")
	f.Add(bytes.Repeat([]byte{sealVersion}, sealOverhead), "")
	f.Fuzz(func(t *testing.T, data []byte, part string) {
		n := bareNode()
		msg := n.sealedPart(forRequest, "nexus.broker.b.a.release", "_INBOX.b.x.1", part, "")
		msg.Data = data
		got, done, err := n.receive(forRequest, msg)
		if err == nil && done {
			if _, err := n.open(got); err == nil && !bytes.Equal(data, m.Data) {
				t.Fatalf("bytes nobody sealed opened: %q", data)
			}
		}
		n.parts.mu.Lock()
		defer n.parts.mu.Unlock()
		for k, p := range n.parts.parts {
			n.parts.drop(k, p)
		}
	})
}
