package spawnd

import (
	"context"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// withGrace is defaultYAML with another release_grace.
func withGrace(grace string) string {
	return strings.Replace(defaultYAML, "release_grace: 10s", "release_grace: "+grace, 1)
}

func (h *harness) terminate(id, reason string, skipGrace bool) (*spawnpb.ExitEvent, error) {
	resp, err := h.client.Terminate(h.ctx(), &spawnpb.TerminateRequest{LeaseId: id, Reason: reason, SkipGrace: skipGrace})
	return resp.GetExit(), err
}

func TestTerminateRefusesLeasesItDoesNotHold(t *testing.T) {
	h := newHarness(t, defaultYAML)
	stream := h.watch()
	if _, err := h.terminate("lease-never", strings.Repeat("r", maxReasonLen+1), false); status.Code(err) != codes.InvalidArgument {
		t.Errorf("Terminate with an oversize reason = %v, want InvalidArgument", err)
	}
	if _, err := h.terminate("lease-never", "manual release", false); status.Code(err) != codes.NotFound {
		t.Errorf("Terminate of a lease never spawned = %v, want NotFound", err)
	}
	h.spawn("lease-done", "exit3")
	h.nextExit(stream)
	if _, err := h.terminate("lease-done", "manual release", false); status.Code(err) != codes.NotFound {
		t.Errorf("Terminate of an exited lease = %v, want NotFound", err)
	}
}

// TestTerminateWaitsOutTheGrace: an instance that exits on its own within
// release_grace (as it would on the gateway's shutdown frame) gets no signal.
func TestTerminateWaitsOutTheGrace(t *testing.T) {
	h := newHarness(t, withGrace("1h"))
	_, f := h.spawn("lease-polite", "notify")
	done := make(chan *spawnpb.ExitEvent, 1)
	go func() {
		ev, err := h.terminate("lease-polite", "manual release", false)
		if err != nil {
			t.Errorf("Terminate: %v", err)
		}
		done <- ev
	}()
	h.logs.await(t, "terminating instance", "lease_id", "lease-polite", "reason", "manual release")
	f.send("exit 0")
	ev := <-done
	want := &spawnpb.ExitEvent{LeaseId: "lease-polite", Pid: int64(f.report.PID), ExitCode: 0, Terminated: true}
	if !proto.Equal(ev, want) {
		t.Errorf("exit = %v, want %v", ev, want)
	}
	if got := h.logs.find("instance did not exit within release_grace; sending SIGTERM to its process group"); len(got) != 0 {
		t.Errorf("spawnd escalated although the instance exited within release_grace: %v", got)
	}
}

// TestTerminateSendsSIGTERMAfterTheGrace: release_grace is honoured, then the
// group gets SIGTERM, which the instance handles.
func TestTerminateSendsSIGTERMAfterTheGrace(t *testing.T) {
	const grace = 300 * time.Millisecond
	h := newHarness(t, withGrace(grace.String()))
	_, f := h.spawn("lease-term", "notify")
	type heard struct {
		line string
		err  error
		at   time.Time
	}
	began := time.Now()
	said := make(chan heard, 1)
	go func() {
		line, err := f.readLine()
		said <- heard{line, err, time.Now()}
	}()
	ev, err := h.terminate("lease-term", "idle", false)
	if err != nil {
		t.Fatal(err)
	}
	if got := <-said; got.line != "sigterm" {
		t.Errorf("the instance said %q (%v), want it to report SIGTERM", got.line, got.err)
	} else if got.at.Sub(began) < grace {
		t.Errorf("SIGTERM arrived %s after Terminate, before release_grace %s ran out", got.at.Sub(began), grace)
	}
	if ev.ExitCode != 0 || !ev.Terminated {
		t.Errorf("exit = %v, want code 0, terminated", ev)
	}
	h.logs.await(t, "instance did not exit within release_grace; sending SIGTERM to its process group", "lease_id", "lease-term", "reason", "idle")
}

// TestTerminateSkipGrace starts at SIGTERM: with a release_grace of an hour,
// Terminate only returns in time if the grace was skipped.
func TestTerminateSkipGrace(t *testing.T) {
	h := newHarness(t, withGrace("1h"))
	h.spawn("lease-restored", "nexus")
	ev, err := h.terminate("lease-restored", "reattach timeout", true)
	if err != nil {
		t.Fatal(err)
	}
	if ev.Signal != "SIGTERM" || ev.ExitCode != -1 || !ev.Terminated {
		t.Errorf("exit = %v, want killed by SIGTERM, terminated", ev)
	}
	h.logs.await(t, "release_grace skipped: no socket could have asked the instance to stop; sending SIGTERM to its process group",
		"lease_id", "lease-restored", "reason", "reattach timeout")
}

// TestTerminateEscalatesToSIGKILL: an instance ignoring SIGTERM, and a
// grandchild ignoring it too, are both SIGKILLed termGrace later.
func TestTerminateEscalatesToSIGKILL(t *testing.T) {
	const grace = 50 * time.Millisecond
	h := newHarness(t, withGrace(grace.String()))
	_, f := h.spawn("lease-stubborn", "ignore")
	grandchild := pidfdOf(t, f.report.Grandchild)
	began := time.Now()
	ev, err := h.terminate("lease-stubborn", "turn timeout", false)
	if err != nil {
		t.Fatal(err)
	}
	if took := time.Since(began); took < grace+termGrace {
		t.Errorf("Terminate returned after %s, before release_grace + termGrace (%s)", took, grace+termGrace)
	}
	if ev.Signal != "SIGKILL" || ev.ExitCode != -1 || !ev.Terminated {
		t.Errorf("exit = %v, want killed by SIGKILL, terminated", ev)
	}
	awaitGone(t, grandchild)
	h.logs.await(t, "instance did not exit after SIGTERM; sending SIGKILL to its process group", "lease_id", "lease-stubborn")
}

// TestConcurrentTerminatesCollapse: one escalation, one exit for all callers.
func TestConcurrentTerminatesCollapse(t *testing.T) {
	h := newHarness(t, withGrace("100ms"))
	_, f := h.spawn("lease-popular", "notify")
	const callers = 8
	exits := make([]*spawnpb.ExitEvent, callers)
	var wg sync.WaitGroup
	for i := range callers {
		wg.Go(func() {
			ev, err := h.terminate("lease-popular", "manual release", false)
			if err != nil {
				t.Errorf("Terminate %d: %v", i, err)
			}
			exits[i] = ev
		})
	}
	wg.Wait()
	for i, ev := range exits {
		if !proto.Equal(ev, exits[0]) || !ev.Terminated {
			t.Errorf("caller %d got %v, caller 0 got %v", i, ev, exits[0])
		}
	}
	f.expectLine("sigterm")
	if got := h.logs.find("terminating instance", "lease_id", "lease-popular"); len(got) != 1 {
		t.Errorf("%d escalations began, want 1", len(got))
	}
}

// TestTerminateOutlivesItsCaller: a gateway that gives up half-way still
// gets its instance torn down.
func TestTerminateOutlivesItsCaller(t *testing.T) {
	h := newHarness(t, withGrace("100ms"))
	stream := h.watch()
	h.spawn("lease-orphaned", "nexus")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errs := make(chan error, 1)
	go func() {
		_, err := h.client.Terminate(ctx, &spawnpb.TerminateRequest{LeaseId: "lease-orphaned", Reason: "manual release"})
		errs <- err
	}()
	h.logs.await(t, "terminating instance", "lease_id", "lease-orphaned")
	cancel()
	if err := <-errs; status.Code(err) != codes.Canceled {
		t.Errorf("Terminate with a cancelled caller = %v, want Canceled", err)
	}
	if ev := h.nextExit(stream); ev.LeaseId != "lease-orphaned" || ev.Signal != "SIGTERM" || !ev.Terminated {
		t.Errorf("exit = %v, want lease-orphaned killed by SIGTERM, terminated", ev)
	}
}

// TestTerminateNoWaitFixesTheReasonBeforeTheExit: the gateway begins a
// graceful teardown with no_wait before its shutdown frame goes, so an
// instance that obeys at once is journaled with the teardown's reason, not
// as a crash; a waiting Terminate after the exit finds nothing left.
func TestTerminateNoWaitFixesTheReasonBeforeTheExit(t *testing.T) {
	h := newHarness(t, withGrace("1h"))
	stream := h.watch()
	_, f := h.spawn("lease-prompt", "notify")
	resp, err := h.client.Terminate(h.ctx(), &spawnpb.TerminateRequest{LeaseId: "lease-prompt", Reason: "idle", NoWait: true})
	if err != nil || resp.GetExit() != nil {
		t.Fatalf("Terminate with no_wait = %v, %v; want an empty answer at once", resp, err)
	}
	f.send("exit 0")
	if ev := h.nextExit(stream); !ev.Terminated || ev.ExitCode != 0 {
		t.Errorf("exit = %v, want status 0, terminated", ev)
	}
	if _, err := h.terminate("lease-prompt", "idle", false); status.Code(err) != codes.NotFound {
		t.Errorf("waiting Terminate after the exit = %v, want NotFound", err)
	}
	_, recs := journalLines(t, filepath.Join(h.stateDir, journalFile))
	if got := linesOf(recs, "lease-prompt"); got[len(got)-1].Kind != kindEnded || got[len(got)-1].Reason != "idle" {
		t.Errorf("last journal record = %+v, want ended for idle", got[len(got)-1])
	}
}

// TestAnExitNobodyAskedForIsACrash: status 0 or not, an instance that goes
// before any Terminate is journaled as crashed, as the gateway reports it.
func TestAnExitNobodyAskedForIsACrash(t *testing.T) {
	h := newHarness(t, defaultYAML)
	stream := h.watch()
	_, f := h.spawn("lease-quit", "notify")
	f.send("exit 0")
	h.nextExit(stream)
	_, recs := journalLines(t, filepath.Join(h.stateDir, journalFile))
	if got := linesOf(recs, "lease-quit"); got[len(got)-1].Kind != kindEnded || got[len(got)-1].Reason != reasonCrashed {
		t.Errorf("last journal record = %+v, want ended as crashed", got[len(got)-1])
	}
}
