package e2e

import (
	"encoding/json"
	"fmt"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// streamer is one lease's client, checking that what it sends comes back in
// order with seq never skipping.
type streamer struct {
	b     *Broker
	claim *brokerclient.Claim
	conn  *brokerclient.Conn
	next  int          // the next echo number to send
	trips atomic.Int64 // round trips completed
}

// roundTrips sends n echo frames and reads n back, in order.
func (s *streamer) roundTrips(n int) error {
	first := s.next
	for i := 0; i < n; i++ {
		if err := s.conn.Send(echoPayload{Type: "echo", N: s.next}); err != nil {
			return err
		}
		s.next++
	}
	_ = s.conn.Underlying().SetReadDeadline(time.Now().Add(30 * time.Second))
	prev := s.conn.LastSeq
	for want := first; want < s.next; {
		f, err := s.conn.Next()
		if err != nil {
			return fmt.Errorf("lease %s waiting for echo %d: %w", s.claim.LeaseID, want, err)
		}
		if f.Seq != 0 && prev != 0 && f.Seq != prev+1 {
			return fmt.Errorf("lease %s: seq jumped %d → %d", s.claim.LeaseID, prev, f.Seq)
		}
		prev = f.Seq
		var p echoPayload
		if json.Unmarshal(f.Payload, &p) != nil || p.Type != "echo" {
			continue // ready/session-id-report frames of a redialed instance
		}
		if p.N != want {
			return fmt.Errorf("lease %s: echo %d arrived, want %d", s.claim.LeaseID, p.N, want)
		}
		want++
		s.trips.Add(1)
	}
	return nil
}

// TestChaosRestartsKillNothing: 20 streaming leases survive kill -9 of the
// gateway (clients resume with a gap notice) and kill -9 of spawnd (no client
// stream even notices), and releasing them all leaves nothing behind.
func TestChaosRestartsKillNothing(t *testing.T) {
	const n = 20
	b := startBroker(t, Options{StateDir: true, YAML: "max_concurrent: 0\nrelease_grace: 2s\n"})
	streamers := make([]*streamer, n)
	for i := range streamers {
		c := b.claim(brokerclient.ClaimRequest{})
		streamers[i] = &streamer{b: b, claim: c, conn: b.dial(c, brokerclient.DialOptions{})}
		if err := streamers[i].roundTrips(5); err != nil {
			t.Fatal(err)
		}
	}
	pids := b.Instances()
	if len(pids) != n {
		t.Fatalf("%d instances for %d leases", len(pids), n)
	}

	// 1. kill -9 the gateway: every lease is restored and reattached; each
	// client reconnects with its from_seq and is told its stream restarted.
	b.KillGateway(syscall.SIGKILL)
	b.StartGateway()
	ids := make([]string, n)
	for i, s := range streamers {
		ids[i] = s.claim.LeaseID
	}
	b.waitStates(ids, "active", 30*time.Second)
	for _, s := range streamers {
		from := s.conn.LastSeq
		s.conn = b.dial(s.claim, brokerclient.DialOptions{FromSeq: &from})
		_ = s.conn.Underlying().SetReadDeadline(time.Now().Add(10 * time.Second))
		_, data, err := s.conn.Underlying().ReadMessage()
		if err != nil || !strings.Contains(string(data), `"reason":"restarted"`) {
			t.Fatalf("lease %s: first frame after the gateway restart = %s %v", s.claim.LeaseID, data, err)
		}
		s.conn.LastSeq = 0 // the old numbering is void
		if err := s.roundTrips(5); err != nil {
			t.Fatal(err)
		}
	}

	// 2. kill -9 spawnd while every client streams: instances live on, the new
	// spawnd re-adopts them, and no client stream is interrupted.
	stop := make(chan struct{})
	errs := make(chan error, n)
	var wg sync.WaitGroup
	for _, s := range streamers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				if err := s.roundTrips(1); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	following := regexp.MustCompile(`msg="following nexus-spawnd's instance exits"`)
	before := b.GatewayLog.count(following)
	b.KillSpawnd(syscall.SIGKILL)
	b.StartSpawnd()
	// The gateway has reattached, re-listed and re-subscribed.
	b.GatewayLog.wait(t, regexp.MustCompile(fmt.Sprintf(`(?s)(msg="following nexus-spawnd's instance exits".*){%d}`, before+1)), 30*time.Second)
	// Every stream keeps making progress after the new spawnd is up.
	base := make([]int64, n)
	for i, s := range streamers {
		base[i] = s.trips.Load()
	}
	for i, s := range streamers {
		eventually(t, 30*time.Second, func() string { return "lease " + s.claim.LeaseID + " streaming after the spawnd restart" },
			func() bool { return s.trips.Load() >= base[i]+3 })
	}
	close(stop)
	wg.Wait()
	close(errs)
	for id, st := range b.leaseStates() {
		if st != "active" {
			t.Errorf("lease %s is %s after the spawnd restart", id, st)
		}
	}
	if n := len(b.leaseStates()); n != len(streamers) {
		t.Errorf("%d leases after the spawnd restart, want %d", n, len(streamers))
	}
	for err := range errs {
		t.Errorf("a client stream was interrupted by the spawnd restart: %v", err)
	}
	if t.Failed() {
		t.FailNow()
	}
	if after := b.Instances(); len(after) != n {
		t.Fatalf("instances after the spawnd restart: %d, want %d", len(after), n)
	}

	// 3. Release everything: nothing left, no slot held.
	for _, s := range streamers {
		if status, body := b.do("POST", "/release/"+s.claim.LeaseID, ""); status != 200 {
			t.Fatalf("release %s = %d %s", s.claim.LeaseID, status, body)
		}
	}
	b.waitNoInstances(30 * time.Second)
	if _, inUse := b.slots(); inUse != 0 {
		t.Fatalf("slots_in_use = %d", inUse)
	}
}
