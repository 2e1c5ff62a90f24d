package cluster

import (
	"strings"
	"testing"
	"time"
)

func TestLeaseIDNamesItsOwner(t *testing.T) {
	id, err := NewLeaseID("broker-1")
	if err != nil {
		t.Fatal(err)
	}
	if got := Owner(id); got != "broker-1" {
		t.Fatalf("Owner(%q) = %q, want broker-1", id, got)
	}
	for _, single := range []string{"0123456789abcdef0123456789abcdef", "", "x", "0123456789abcdef0123456789abcdeX-b", "0123456789abcdef0123456789abcdef-"} {
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
		if o := Owner(id); o != "" && !strings.HasSuffix(id, "-"+o) {
			t.Fatalf("Owner(%q) = %q, not the id's suffix", id, o)
		}
	})
}
