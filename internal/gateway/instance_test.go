package gateway

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/config"
	"github.com/nexus-broker/nexus-broker/internal/spawnproof"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// FuzzRegister feeds the instance register path arbitrary first messages
// and mid-stream frames: registerOf either refuses a message with a close
// reason or returns a register frame that survives re-encoding unchanged,
// and statusState reports a state only for a JSON payload of type status
// carrying it.
func FuzzRegister(f *testing.F) {
	for _, seed := range []string{
		`{"version":1,"lease_id":"L","signal":"register","secret":"s"}`,
		`{"version":2,"lease_id":"L","signal":"register"}`,
		`{"version":1,"lease_id":"L","signal":"ready"}`,
		`{"version":1,"lease_id":"L","signal":"io","payload":{"type":"status","state":"thinking","turn_id":"t"}}`,
		`{"version":1,"signal":"io","payload":{"type":"stream.delta","content":"\"status\""}}`,
		`{"type":"status","state":"idle"}`,
		`{"type":"status","type":"echo","state":"x"}`,
		`not json`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		fr, refuse, err := registerOf(data)
		switch {
		case err != nil && refuse == "":
			t.Fatalf("an undecodable message (%v) was not refused", err)
		case refuse == "" && fr.Signal != brokerframe.SignalRegister:
			t.Fatalf("a %q frame was taken as register", fr.Signal)
		case refuse == "":
			again, err := brokerframe.Encode(fr)
			if err != nil {
				break // Encode stamps the version; a skewed one is refused later, by admitInstance
			}
			back, refuse, err := registerOf(again)
			if refuse != "" || err != nil || back.LeaseID != fr.LeaseID || back.Secret != fr.Secret {
				t.Fatalf("a register frame re-encoded reads back as %+v (%q, %v), was %+v", back, refuse, err, fr)
			}
		}
		for _, payload := range []json.RawMessage{fr.Payload, data} {
			state, ok := statusState(payload)
			if !ok {
				if state != "" {
					t.Fatalf("no status, yet state %q", state)
				}
				continue
			}
			var p struct{ Type, State string }
			if json.Unmarshal(payload, &p) != nil || p.Type != brokerframe.IOStatus || p.State != state {
				t.Fatalf("statusState(%q) = %q, but the payload reads as %+v", payload, state, p)
			}
		}
	})
}

// TestAdmitInstanceRefusesLiveAndUnknownAlike: a register frame is checked
// against the lease's verifier without spawnd; a wrong secret for a live
// lease and a lease id nobody holds are refused by the same work (the same
// allocations), the right secret admits, and a frame for a lease whose
// Spawn has not answered waits for it (refused once the wait ends, admitted
// once it answers).
func TestAdmitInstanceRefusesLiveAndUnknownAlike(t *testing.T) {
	g := New(Options{Config: config.Default(), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	secret := strings.Repeat("ab", 32)
	live := g.newLease("live-lease", "", "nexus", time.Now())
	live.prove(spawnproof.Of(secret))
	pending := g.newLease("next-lease", "", "nexus", time.Now())
	g.leases[live.id], g.leases[pending.id] = live, pending
	frame := func(id, secret string) brokerframe.Frame {
		return brokerframe.Frame{Version: brokerframe.Version, LeaseID: id, Signal: brokerframe.SignalRegister, Secret: secret}
	}
	ctx := context.Background()
	wrong, unknown := frame(live.id, strings.Repeat("0", 64)), frame("dead-lease", strings.Repeat("0", 64))
	for _, c := range []struct {
		name string
		f    brokerframe.Frame
		want refusal
	}{
		{"wrong secret", wrong, refusedWrongSecret},
		{"unknown lease", unknown, refusedUnknownLease},
		{"no secret", frame(live.id, ""), refusedNoSecret},
	} {
		if l, why := g.admitInstance(ctx, c.f); l != nil || why != c.want {
			t.Errorf("%s: admitInstance = %v, %v; want refusal %v", c.name, l, why, c.want)
		}
	}
	if l, _ := g.admitInstance(ctx, frame(live.id, secret)); l != live {
		t.Fatal("the lease's own secret was refused")
	}
	if a, b := testing.AllocsPerRun(200, func() { g.admitInstance(ctx, wrong) }), testing.AllocsPerRun(200, func() { g.admitInstance(ctx, unknown) }); a != b {
		t.Errorf("a wrong secret allocates %v, an unknown lease %v: the two are told apart", a, b)
	}

	ended, cancel := context.WithCancel(ctx)
	cancel()
	if l, why := g.admitInstance(ended, frame(pending.id, secret)); l != nil || why != refusedSpawnPending {
		t.Errorf("before its Spawn answered: %v, %v; want refusal %v", l, why, refusedSpawnPending)
	}
	admitted := make(chan *lease)
	go func() {
		l, _ := g.admitInstance(ctx, frame(pending.id, secret))
		admitted <- l
	}()
	pending.prove(spawnproof.Of(secret))
	if l := <-admitted; l != pending {
		t.Fatal("a frame that came before its lease's Spawn answered was not admitted once it did")
	}
}
