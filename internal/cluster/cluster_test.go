package cluster

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/config/core"
)

func TestLeaseIDNamesItsOwner(t *testing.T) {
	id, err := NewLeaseID("broker-1")
	if err != nil {
		t.Fatal(err)
	}
	if got := Owner(id); got != "broker-1" {
		t.Fatalf("Owner(%q) = %q, want broker-1", id, got)
	}
	for _, single := range []string{"0123456789abcdef0123456789abcdef", "", "x", "0123456789abcdef0123456789abcdeX-b", "0123456789abcdef0123456789abcdef-",
		"0123456789abcdef0123456789abcdef-a b", "0123456789abcdef0123456789abcdef-" + strings.Repeat("b", 65)} {
		if got := Owner(single); got != "" {
			t.Errorf("Owner(%q) = %q, want none", single, got)
		}
	}
}

// TestBackoffIsCappedAndJittered: never below the floor, never above the
// cap, and not the same for every broker.
func TestBackoffIsCappedAndJittered(t *testing.T) {
	seen := map[time.Duration]bool{}
	for attempt := 1; attempt < 100; attempt++ {
		d := Backoff(attempt)
		if d < backoffMin || d > backoffCap {
			t.Fatalf("Backoff(%d) = %s, outside [%s, %s]", attempt, d, backoffMin, backoffCap)
		}
		if attempt > 10 {
			seen[d] = true
		}
	}
	if len(seen) < 10 {
		t.Fatalf("capped delays are not jittered: %v", seen)
	}
}

func FuzzOwner(f *testing.F) {
	f.Add("0123456789abcdef0123456789abcdef-a")
	f.Add(strings.Repeat("f", 40))
	f.Fuzz(func(t *testing.T, id string) {
		if o := Owner(id); o != "" && (!strings.HasSuffix(id, "-"+o) || !core.IsToken(o, core.MaxBrokerIDLen)) {
			t.Fatalf("Owner(%q) = %q, not the id's suffix or not a broker id", id, o)
		}
	})
}

// TestReplayGuardRefusesASeenNonce: a nonce is admitted once; one sealed
// before the guard started is stale; a full guard forgets its oldest
// second and refuses what was sealed in it rather than let it through.
func TestReplayGuardRefusesASeenNonce(t *testing.T) {
	start := time.Now()
	g := newReplayGuard(start)
	reason := func(err error) string {
		var r *refusal
		if errors.As(err, &r) {
			return r.reason
		}
		return fmt.Sprint(err)
	}
	nonce := [nonceLen]byte{1}
	at := start.Add(time.Millisecond).UnixNano()
	if err := g.admit(at, nonce, start); err != nil {
		t.Fatalf("first admit: %v", err)
	}
	if got := reason(g.admit(at, nonce, start)); got != RefusedReplay {
		t.Fatalf("the same nonce again: %s, want %s", got, RefusedReplay)
	}
	if got := reason(g.admit(start.Add(-time.Second).UnixNano(), [nonceLen]byte{2}, start)); got != RefusedStale {
		t.Fatalf("sealed before the guard started: %s, want %s", got, RefusedStale)
	}
	// Fill the guard past its bound with later seconds: the first second
	// is forgotten, and its nonce refused as stale, never admitted again.
	later := start.Add(2 * time.Second)
	for i := range maxNonces {
		var n [nonceLen]byte
		binary.BigEndian.PutUint64(n[:], uint64(i)+100)
		if err := g.admit(later.UnixNano(), n, later); err != nil {
			t.Fatalf("admit %d: %v", i, err)
		}
	}
	if g.n > maxNonces {
		t.Fatalf("the guard holds %d nonces, bound %d", g.n, maxNonces)
	}
	if got := reason(g.admit(at, nonce, later)); got != RefusedStale {
		t.Fatalf("a forgotten nonce again: %s, want %s", got, RefusedStale)
	}
	// A second gone out of the skew window is swept.
	if err := g.admit(later.Add(maxSkew+2*time.Second).UnixNano(), [nonceLen]byte{3}, later.Add(maxSkew+2*time.Second)); err != nil || g.n != 1 {
		t.Fatalf("after the window: %v, %d nonces kept, want 1", err, g.n)
	}
}
