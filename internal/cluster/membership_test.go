package cluster

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestCleanStopLeavesAtOnce: a broker that stops cleanly leaves its peers'
// lists with its last heartbeat, not after forget_after; it stays
// remembered (its leases outlive its gateway).
func TestCleanStopLeavesAtOnce(t *testing.T) {
	url := startServer(t, nil)
	a := startNode(t, "a", url, func(*Node) {})
	b := startNode(t, "b", url, func(*Node) {})
	waitFor(t, "b hears a", func() bool { return b.Reachable("a") })
	a.Close()
	waitFor(t, "a leaves b's list", func() bool { return !b.Known("a") })
	if len(b.Peers()) != 0 || !b.Remembered("a") {
		t.Fatalf("after a stopped cleanly b lists %+v and remembers a: %v; want an empty list, a remembered", b.Peers(), b.Remembered("a"))
	}
}

// TestCleanStopLeavesForGood: the leaving heartbeat is a broker's last,
// so no ordinary one lists it again after it (until forget_after). Each
// broker here beats every millisecond, so an ordinary heartbeat is always
// about to go as it stops.
func TestCleanStopLeavesForGood(t *testing.T) {
	url := startServer(t, nil)
	b := startNode(t, "b", url, func(*Node) {})
	for i := range 20 {
		id := fmt.Sprintf("a%d", i)
		a := startNode(t, id, url, func(a *Node) { a.every = time.Millisecond })
		waitFor(t, "b hears "+id, func() bool { return b.Reachable(id) })
		a.Close()
		// What a sent reached the server before Close returned (its
		// flush), so b's own heartbeat, sent now and heard on the same
		// subscription, is heard after all of it.
		since := time.Now().UnixNano()
		b.BeatNow()
		waitFor(t, "b hears itself", func() bool { return b.selfSeen.Load() > since })
		if b.Known(id) {
			t.Fatalf("%s stopped cleanly and is on b's list again: %+v", id, b.Peers())
		}
	}
}

// TestSilentPeerForgotten: a broker unreachable for forget_after leaves
// the list (and so unreachable_brokers) and the record; until then it is
// listed unreachable.
func TestSilentPeerForgotten(t *testing.T) {
	url := startServer(t, nil)
	a := startNode(t, "a", url, func(*Node) {})
	b := startNode(t, "b", url, func(b *Node) { b.forgetAfter = time.Second })
	waitFor(t, "b hears a", func() bool { return b.Reachable("a") })
	a.nc.Load().Close() // a crash: no last heartbeat
	waitFor(t, "a unreachable", func() bool { return !b.Reachable("a") })
	if ps := b.Peers(); len(ps) != 1 || ps[0].ID != "a" || ps[0].Reachable {
		t.Fatalf("a silent for less than forget_after: b lists %+v, want a unreachable", ps)
	}
	waitFor(t, "a forgotten", func() bool { return !b.Known("a") && !b.Remembered("a") })
}

// TestProtocolRange: peers speaking Protocol-1 and Protocol are routed to;
// one speaking another is listed, never reachable.
func TestProtocolRange(t *testing.T) {
	url := startServer(t, nil)
	b := startNode(t, "b", url, func(*Node) {})
	for id, p := range map[string]int{"old": Protocol - 1, "same": Protocol, "next": Protocol + 1, "ancient": Protocol - 2} {
		startNode(t, id, url, func(n *Node) { n.protocol = p })
	}
	waitFor(t, "b hears all four", func() bool { return len(b.Peers()) == 4 && b.Reachable("same") && b.Reachable("old") })
	for _, p := range b.Peers() {
		routed := p.ID == "old" || p.ID == "same"
		if p.Compatible != routed || p.Reachable != routed || b.Reachable(p.ID) != routed {
			t.Errorf("peer %s (protocol %d): compatible %v reachable %v; want both %v", p.ID, p.Protocol, p.Compatible, p.Reachable, routed)
		}
	}
}

// TestDrainingIsHeard: a draining broker's heartbeats say so and offer no
// free slot; undrained, they offer it again.
func TestDrainingIsHeard(t *testing.T) {
	url := startServer(t, nil)
	a := startNode(t, "a", url, func(a *Node) {
		a.free = func() int { return 2 }
		a.load = func() Load { return Load{SlotsInUse: 1, MaxConcurrent: 3} }
		a.binaries = func() []string { return []string{"echo"} }
	})
	b := startNode(t, "b", url, func(*Node) {})
	offerable := func() bool { p, ok := b.Peer("a"); return ok && p.Offerable("echo") }
	waitFor(t, "a offerable", offerable)
	a.SetDraining(true)
	waitFor(t, "a draining", func() bool { p, _ := b.Peer("a"); return p.Draining })
	if p, _ := b.Peer("a"); p.Free != 0 || p.Offerable("echo") || !p.Reachable || p.Load.MaxConcurrent != 3 || !a.Self().Draining {
		t.Fatalf("draining a as b sees it: %+v; want reachable, no free slot, not offerable", p)
	}
	a.SetDraining(false)
	waitFor(t, "a offerable again", offerable)
}

// TestRecordSurvivesRestart: a broker heard before a restart is remembered
// after it (not known until heard again); one last seen longer than
// forget_after ago is not; an unreadable record is replaced.
func TestRecordSurvivesRestart(t *testing.T) {
	url := startServer(t, nil)
	dir := t.TempDir()
	path := filepath.Join(dir, MembersFile)
	startNode(t, "a", url, func(*Node) {})
	b := startNode(t, "b", url, func(b *Node) { b.recordPath = path })
	waitFor(t, "b hears a", func() bool { return b.Reachable("a") })
	b.Close()
	if st, err := os.Stat(path); err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("record after a clean stop: %v, %v; want a 0600 file", st, err)
	}
	fresh := func(forget time.Duration) *Node {
		n := newNode("b", []byte("handler-test-secret-0123456789abcdef"), b.log)
		t.Cleanup(n.cancel)
		n.recordPath, n.forgetAfter = path, forget
		n.loadRecord(time.Now())
		return n
	}
	if n := fresh(time.Hour); !n.Remembered("a") || n.Known("a") {
		t.Fatalf("restarted: a remembered %v known %v; want remembered, not known", n.Remembered("a"), n.Known("a"))
	}
	old, _ := json.Marshal(recordFile{Brokers: map[string]*recorded{"a": {Advertise: "a:1", LastSeen: time.Now().Add(-2 * time.Hour)}}})
	if err := os.WriteFile(path, old, 0o600); err != nil {
		t.Fatal(err)
	}
	if n := fresh(time.Hour); n.Remembered("a") {
		t.Fatal("a last seen 2h ago is remembered with forget_after 1h")
	}
	if err := os.WriteFile(path, []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	if n := fresh(time.Hour); n.Remembered("a") || len(n.record) != 0 {
		t.Fatal("an unreadable record was taken")
	}
}

// FuzzMembersRecord: the membership record's loader never panics, and
// what it accepts names only broker ids.
func FuzzMembersRecord(f *testing.F) {
	f.Add([]byte(`{"brokers":{"a":{"advertise_addr":"a:1","last_seen":"2026-01-01T00:00:00Z"}}}`))
	f.Add([]byte(`{"brokers":{"a.b":{}}}`))
	f.Add([]byte(`{"brokers":{"a":null}}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		rec, err := decodeRecord(data)
		if err != nil {
			return
		}
		for id, r := range rec {
			if id == "" || r == nil {
				t.Fatalf("accepted %q: %v", id, r)
			}
		}
	})
}
