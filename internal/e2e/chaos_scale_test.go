package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// ChaosLeasesEnv is how many streaming leases TestChaosAtScale runs; unset,
// the test is skipped (make chaos sets it from LEASES, default 200).
const ChaosLeasesEnv = "NEXUS_CHAOS_LEASES"

// chaosFleet is the streaming leases of one chaos run.
type chaosFleet struct {
	t  *testing.T
	b  *Broker
	ss []*streamer
}

// open claims and dials n leases, 16 at a time, and makes one round trip on
// each.
func (f *chaosFleet) open(n int) {
	f.ss = make([]*streamer, n)
	errs := make(chan error, n)
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	for i := range f.ss {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			c, err := f.b.Client.Claim(ctx, brokerclient.ClaimRequest{Config: "engine:\n  name: example\n"})
			if err != nil {
				errs <- fmt.Errorf("claim %d: %w", i, err)
				return
			}
			s := &streamer{b: f.b, claim: c}
			if s.conn, err = brokerclient.Dial(ctx, c.WSURL, brokerclient.DialOptions{}); err != nil {
				errs <- fmt.Errorf("dial %s: %w", c.LeaseID, err)
				return
			}
			f.ss[i] = s
			errs <- s.roundTrips(1)
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			f.t.Fatal(err)
		}
	}
	f.t.Cleanup(func() {
		for _, s := range f.ss {
			s.conn.Close()
		}
	})
}

// stream keeps every lease making round trips until the returned stop is
// called; stop reports how many round trips failed (frames lost).
func (f *chaosFleet) stream() (stop func() int) {
	done := make(chan struct{})
	var failed sync.Map
	var wg sync.WaitGroup
	for _, s := range f.ss {
		wg.Go(func() {
			for {
				select {
				case <-done:
					return
				default:
				}
				if err := s.roundTrips(1); err != nil {
					failed.Store(s.claim.LeaseID, err)
					return
				}
			}
		})
	}
	return func() int {
		close(done)
		wg.Wait()
		n := 0
		failed.Range(func(id, err any) bool {
			if n++; n <= 3 {
				f.t.Logf("lease %s: %v", id, err)
			}
			return true
		})
		return n
	}
}

// progressed waits until every lease made k more round trips than at base.
func (f *chaosFleet) progressed(base []int64, k int64, within time.Duration) {
	for i, s := range f.ss {
		eventually(f.t, within, func() string { return "lease " + s.claim.LeaseID + " streaming" },
			func() bool { return s.trips.Load() >= base[i]+k })
	}
}

func (f *chaosFleet) trips() []int64 {
	out := make([]int64, len(f.ss))
	for i, s := range f.ss {
		out[i] = s.trips.Load()
	}
	return out
}

// resume redials every lease with its from_seq after a gateway restart and
// makes a round trip on each; it reports the leases whose stream did not
// resume.
func (f *chaosFleet) resume() int {
	lost := 0
	for _, s := range f.ss {
		from := s.conn.LastSeq
		s.conn.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		conn, err := brokerclient.Dial(ctx, s.claim.WSURL, brokerclient.DialOptions{FromSeq: &from})
		cancel()
		if err == nil {
			s.conn = conn
			s.conn.LastSeq = 0 // a restarted gateway numbers afresh (its stream-gap says so)
			err = s.roundTrips(1)
		}
		if err != nil {
			if lost++; lost <= 3 {
				f.t.Logf("lease %s did not resume: %v", s.claim.LeaseID, err)
			}
		}
	}
	return lost
}

// lost counts the leases no longer active and the instances no longer
// running.
func (f *chaosFleet) lost() (leases, instances int) {
	st := f.b.leaseStates()
	for _, s := range f.ss {
		if st[s.claim.LeaseID] != "active" {
			leases++
		}
	}
	return leases, max(len(f.ss)-len(f.b.Instances()), 0)
}

func (f *chaosFleet) ids() []string {
	out := make([]string, len(f.ss))
	for i, s := range f.ss {
		out[i] = s.claim.LeaseID
	}
	return out
}

// report prints one scenario's line and fails the test on any loss.
func (f *chaosFleet) report(scenario string, frames int, took string) {
	leases, instances := f.lost()
	fmt.Printf("chaos %-24s leases=%d leases_lost=%d instances_lost=%d frames_lost=%d %s\n",
		scenario, len(f.ss), leases, instances, frames, took)
	if leases+instances+frames > 0 {
		f.t.Errorf("%s lost %d leases, %d instances, %d frames", scenario, leases, instances, frames)
	}
}

// TestChaosAtScale is make chaos: LEASES streaming leases through kill -9 of
// spawnd, of the gateway and of both, a SIGSTOPped spawnd, and a state_dir
// whose disk fills, each printing what was lost (all zero) and how long
// reattaching or re-adopting took. Frames lost are round trips that failed:
// while spawnd is killed or stopped every stream keeps running; a gateway
// killed takes its in-memory stream with it by design, so there the streams
// pause for the kill and each must resume (with from_seq) afterwards.
func TestChaosAtScale(t *testing.T) {
	n, err := strconv.Atoi(os.Getenv(ChaosLeasesEnv))
	if err != nil || n <= 0 {
		t.Skipf("%s is not set: make chaos runs this test", ChaosLeasesEnv)
	}
	dir := t.TempDir()
	state := filepath.Join(dir, "state")
	// The journal's disk: a tmpfs ample for the run until the last case
	// fills it.
	smallTmpfs(t, state, "256m")
	b := startBroker(t, Options{Dir: dir, StateDir: true, YAML: "max_concurrent: 0\nrelease_grace: 2s\n"})
	f := &chaosFleet{t: t, b: b}
	start := time.Now()
	f.open(n)
	fmt.Printf("chaos %d streaming leases up in %v\n", n, time.Since(start).Round(time.Millisecond))
	following := regexp.MustCompile(`msg="following nexus-spawnd's instance exits"`)

	// 1. kill -9 spawnd while every lease streams.
	stop := f.stream()
	before := b.GatewayLog.count(following)
	b.KillSpawnd(syscall.SIGKILL)
	start = time.Now()
	b.StartSpawnd()
	b.GatewayLog.wait(t, regexp.MustCompile(fmt.Sprintf(`(?s)(msg="following nexus-spawnd's instance exits".*){%d}`, before+1)), 2*time.Minute)
	readopted := time.Since(start)
	f.progressed(f.trips(), 2, 2*time.Minute)
	f.report("kill-9-spawnd", stop(), "readopted_in="+readopted.Round(time.Millisecond).String())

	// 2. spawnd SIGSTOPped for 5 s while every lease streams.
	stop = f.stream()
	if err := b.spawnd.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	base := f.trips()
	f.progressed(base, 2, 2*time.Minute) // streams need no spawnd
	time.Sleep(5 * time.Second)          // the fault itself: spawnd does not run for 5 s
	if err := b.spawnd.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	f.progressed(f.trips(), 2, 2*time.Minute)
	f.report("sigstop-spawnd-5s", stop(), "")

	// 3. kill -9 the gateway.
	b.KillGateway(syscall.SIGKILL)
	start = time.Now()
	b.StartGateway()
	b.waitStates(f.ids(), "active", 2*time.Minute)
	reattached := time.Since(start)
	f.report("kill-9-gateway", f.resume(), "reattached_in="+reattached.Round(time.Millisecond).String())

	// 4. kill -9 of both.
	b.KillGateway(syscall.SIGKILL)
	b.KillSpawnd(syscall.SIGKILL)
	start = time.Now()
	b.StartSpawnd()
	b.StartGateway()
	b.waitStates(f.ids(), "active", 2*time.Minute)
	both := time.Since(start)
	f.report("kill-9-both", f.resume(), "readopted_and_reattached_in="+both.Round(time.Millisecond).String())

	// 5. The journal's disk fills while every lease streams: claims the
	// journal cannot record are refused, never answered and lost; after
	// space returns and both processes are killed and restarted, every
	// lease answered (the fleet's and those claimed meanwhile) is back
	// and no instance runs that no lease holds.
	stop = f.stream()
	fill(t, filepath.Join(state, "filler"))
	answered, refused := 0, 0
	for range 20 {
		code, _, body := b.rawClaim()
		switch code {
		case 200:
			answered++
		case 503:
			refused++
		default:
			t.Errorf("a claim with the journal's disk full answered %d %s", code, body)
		}
	}
	if err := os.Remove(filepath.Join(state, "filler")); err != nil {
		t.Fatal(err)
	}
	frames := stop()
	b.KillGateway(syscall.SIGKILL)
	b.KillSpawnd(syscall.SIGKILL)
	b.StartSpawnd()
	b.StartGateway()
	b.waitStates(f.ids(), "active", 2*time.Minute)
	frames += f.resume()
	leases := len(b.leaseStates())
	instances := len(b.Instances())
	extraLost := max(n+answered-leases, 0)
	orphans := max(instances-leases, 0)
	fmt.Printf("chaos %-24s claims_answered=%d claims_refused=%d answered_leases_lost=%d orphaned_instances=%d\n",
		"full-state-dir", answered, refused, extraLost, orphans)
	if extraLost+orphans > 0 {
		t.Errorf("full state_dir: %d answered leases lost, %d instances orphaned", extraLost, orphans)
	}
	f.report("full-state-dir", frames, "")
}
