package e2e

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// leasesView is GET /leases as a test reads it.
type leasesView struct {
	MaxConcurrent int         `json:"max_concurrent"`
	SlotsInUse    int         `json:"slots_in_use"`
	QueueDepth    int         `json:"queue_depth"`
	Leases        []leaseView `json:"leases"`
}

type leaseView struct {
	LeaseID   string `json:"lease_id"`
	SessionID string `json:"session_id"`
	PID       int64  `json:"pid"`
	State     string `json:"state"`
	Binary    string `json:"binary"`
	Reason    string `json:"reason"`
	Pool      string `json:"pool"`
}

// leases reads GET /leases.
func (b *Broker) leases() leasesView {
	b.t.Helper()
	var v leasesView
	if _, body := b.get("/leases"); json.Unmarshal([]byte(body), &v) != nil {
		b.t.Fatalf("GET /leases is not JSON: %s", body)
	}
	return v
}

// lease finds one lease in GET /leases.
func (b *Broker) lease(id string) (leaseView, bool) {
	for _, l := range b.leases().Leases {
		if l.LeaseID == id {
			return l, true
		}
	}
	return leaseView{}, false
}

// eventually polls cond until it holds, failing the test with what after
// within. It is for states that have no event a test can wait on (a gauge in
// GET /leases, a process gone from /proc); each poll is an HTTP request or a
// /proc scan, so the short pause between them only keeps the loop from
// spinning.
func eventually(t testing.TB, within time.Duration, what func() string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not within %s: %s", within, what())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// slots reads max_concurrent and slots_in_use.
func (b *Broker) slots() (max, inUse int) {
	v := b.leases()
	return v.MaxConcurrent, v.SlotsInUse
}

// leaseStates returns lease_id → state.
func (b *Broker) leaseStates() map[string]string {
	out := map[string]string{}
	for _, l := range b.leases().Leases {
		out[l.LeaseID] = l.State
	}
	return out
}

// waitStates waits until every lease in ids is in state.
func (b *Broker) waitStates(ids []string, state string, within time.Duration) {
	b.t.Helper()
	eventually(b.t, within, func() string { return "leases all " + state + ": " + toJSON(b.leaseStates()) }, func() bool {
		st := b.leaseStates()
		for _, id := range ids {
			if st[id] != state {
				return false
			}
		}
		return true
	})
}

// waitQueueDepth waits until want claims are parked in the capacity queue.
func (b *Broker) waitQueueDepth(want int, within time.Duration) {
	b.t.Helper()
	eventually(b.t, within, func() string { return "queue_depth " + toJSON(want) + ", is " + toJSON(b.leases().QueueDepth) },
		func() bool { return b.leases().QueueDepth == want })
}

// waitDraining waits until the lease is draining and returns when that was
// first seen and its reason.
func (b *Broker) waitDraining(id string, within time.Duration) (seen time.Time, reason string) {
	b.t.Helper()
	eventually(b.t, within, func() string { return "lease " + id + " draining" }, func() bool {
		l, ok := b.lease(id)
		seen, reason = time.Now(), l.Reason
		return ok && l.State == "draining"
	})
	return seen, reason
}

// waitNoInstances waits until no instance of this broker is alive.
func (b *Broker) waitNoInstances(within time.Duration) {
	b.t.Helper()
	eventually(b.t, within, func() string { return "no instance alive, have " + toJSON(b.Instances()) },
		func() bool { return len(b.Instances()) == 0 })
}

func toJSON(v any) string {
	data, _ := json.Marshal(v)
	return string(data)
}

// GET /leases lists oldest first (created_at, then lease_id), not in the
// order of the random ids.
func TestLeasesAreListedOldestFirst(t *testing.T) {
	b := startBroker(t, Options{})
	var claimed []string
	for i := 0; i < 6; i++ { // random ids fall in claim order once in 720
		claimed = append(claimed, b.claim(brokerclient.ClaimRequest{}).LeaseID)
	}
	var v struct {
		Leases []struct {
			LeaseID   string    `json:"lease_id"`
			CreatedAt time.Time `json:"created_at"`
		} `json:"leases"`
	}
	if _, body := b.get("/leases"); json.Unmarshal([]byte(body), &v) != nil || len(v.Leases) != len(claimed) {
		t.Fatalf("GET /leases = %s", body)
	}
	for i, l := range v.Leases {
		if l.LeaseID != claimed[i] {
			t.Fatalf("GET /leases lists %v, want the claim order %v", v.Leases, claimed)
		}
		if i > 0 && l.CreatedAt.Before(v.Leases[i-1].CreatedAt) {
			t.Fatalf("created_at goes backwards: %v", v.Leases)
		}
	}
}
