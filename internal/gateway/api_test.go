package gateway

import (
	"io"
	"log/slog"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/auth"
	"github.com/nexus-broker/nexus-broker/internal/config"
	"github.com/nexus-broker/nexus-broker/internal/config/core"
	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/streamlog"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// closes records what the core told an attached Client.
type closes struct{ finished, displaced, away int }

func (c *closes) Finish(int, string) { c.finished++ }
func (c *closes) Displace()          { c.displaced++ }
func (c *closes) GoAway()            { c.away++ }

// TestAttachFollowsTheStreamFromItsCursor: a client attached through the
// API reads the frames the lease's stream gets after its cursor, is
// displaced by a newer attachment, and a lease that is not the caller's is
// not attached at all.
func TestAttachFollowsTheStreamFromItsCursor(t *testing.T) {
	g := bareGateway()
	l := g.newLease("L", "alice", core.ReservedEntry, time.Now())
	g.leases[l.id] = l
	r := httptest.NewRequest("GET", "/lease/L", nil)

	if a := g.Attach(r, "L", auth.Principal{ID: "mallory"}, -1, &closes{}, credentialAnonymous); a != nil {
		t.Fatal("another principal's lease was attached")
	}
	first := &closes{}
	a := g.Attach(r, "L", auth.Principal{ID: "alice"}, -1, first, credentialAnonymous)
	if a == nil || a.Lease().ID() != "L" {
		t.Fatalf("alice's lease was not attached: %v", a)
	}
	if _, _, _, wake := a.Read(nil, 8); wake == nil || a.Pending() {
		t.Fatal("an empty stream did not say how to wait for its first frame")
	}
	for range 2 {
		if _, err := l.log.Append(brokerframe.Frame{Signal: brokerframe.SignalIO, LeaseID: "L", Payload: []byte(`{"type":"echo"}`)}); err != nil {
			t.Fatal(err)
		}
	}
	if !a.Pending() {
		t.Fatal("two frames appended and none pending")
	}
	frames, evicted, _, _ := a.Read(nil, 8)
	if len(frames) != 2 || evicted != nil || frames[1].Seq != 2 {
		t.Fatalf("read %d frames (evicted notice %q), want seqs 1 and 2", len(frames), evicted)
	}
	a.Advance(frames[1].Seq)
	if a.Seq() != 2 || a.Pending() {
		t.Fatalf("cursor at %d (pending %v) after reading through 2", a.Seq(), a.Pending())
	}

	second := &closes{}
	if g.Attach(r, "L", auth.Principal{ID: "alice"}, 0, second, credentialAnonymous) == nil {
		t.Fatal("the newer attachment was refused")
	}
	if first.displaced != 1 || second.displaced != 0 {
		t.Fatalf("displaced: first %d, second %d; want the first once", first.displaced, second.displaced)
	}
	a.Detach()
	if l.client == nil {
		t.Fatal("detaching the displaced attachment detached the newer one")
	}
}

// TestAttachmentTellsOnlyAResumedClientOfEvictedFrames: frames evicted
// before an attached client read them are skipped for every client, and
// only one that resumed (fromSeq >= 0) gets the gap notice, counted, as WS
// /lease/{id} tells only a resuming client.
func TestAttachmentTellsOnlyAResumedClientOfEvictedFrames(t *testing.T) {
	for _, fromSeq := range []int64{-1, 0} {
		cfg := config.Default()
		cfg.ClientReplayBufferBytes = 256
		g := New(Options{Config: cfg, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
		l := g.newLease("L", "alice", core.ReservedEntry, time.Now())
		g.leases[l.id] = l
		a := g.Attach(httptest.NewRequest("GET", "/lease/L", nil), "L", auth.Principal{ID: "alice"}, fromSeq, &closes{}, credentialAnonymous)
		if a == nil {
			t.Fatal("not attached")
		}
		// Past the attached client's send window, which the bound never
		// evicts.
		for range streamlog.SendWindow + 20 {
			if _, err := l.log.Append(brokerframe.Frame{Signal: brokerframe.SignalIO, LeaseID: "L", Payload: []byte(`{"type":"echo"}`)}); err != nil {
				t.Fatal(err)
			}
		}
		_, evicted, through, _ := a.Read(nil, 8)
		if through == 0 {
			t.Fatalf("from_seq %d: %d frames through a 256-byte buffer and none evicted", fromSeq, streamlog.SendWindow+20)
		}
		if resumed := fromSeq >= 0; (evicted != nil) != resumed || g.m.ReplayGaps.Get(brokerframe.GapEvicted) != map[bool]uint64{true: 1}[resumed] {
			t.Errorf("from_seq %d: gap notice %q, %d counted; want one only for a resumed client", fromSeq, evicted, g.m.ReplayGaps.Get(brokerframe.GapEvicted))
		}
	}
}
