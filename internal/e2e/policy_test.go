package e2e

import (
	"fmt"
	"regexp"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

func policyBroker(t *testing.T, yaml, slowTurn string) *Broker {
	return startBroker(t, Options{NoNexusEntry: true, YAML: yaml + fmt.Sprintf(`release_grace: 3s
binaries:
  nexus:
    path: %q
    env: {NEXUS_ECHO_IGNORE_SHUTDOWN: "1", NEXUS_ECHO_SLOW_TURN: %q}
`, bin("nexus-echo"), slowTurn)})
}

// span is when something happened as the test can see it: after earliest
// (the test's request left) and before latest (its answer arrived). The
// broker stamps the event somewhere in between, so a deadline derived from
// it is bracketed the same way.
type span struct{ earliest, latest time.Time }

// around runs do and returns the span it took.
func around(do func()) span {
	s := span{earliest: time.Now()}
	do()
	s.latest = time.Now()
	return s
}

// at is a span of one instant, for events the test stamps itself.
func at(t time.Time) span { return span{t, t} }

// within checks that an event at got came no sooner than after from the
// earliest moment its clock could have started (less a little clock slack),
// and no later than one second past after from the latest.
func within(t *testing.T, what string, started span, after time.Duration, got time.Time) {
	t.Helper()
	if early := got.Sub(started.earliest.Add(after)); early < -50*time.Millisecond {
		t.Fatalf("%s released %s before its earliest possible deadline", what, -early)
	}
	if late := got.Sub(started.latest.Add(after)); late > time.Second {
		t.Fatalf("%s released %s after its deadline, want within 1s", what, late)
	}
}

// startSlowTurn sends an input of eight words (eight deltas, each
// NEXUS_ECHO_SLOW_TURN apart) and returns the span from sending it to the
// instance saying it is thinking: when the turn clock started.
func startSlowTurn(t *testing.T, conn *brokerclient.Conn) span {
	t.Helper()
	sent := time.Now()
	if err := conn.Send(brokerframe.IO{Type: "input", Content: "a b c d e f g h"}); err != nil {
		t.Fatal(err)
	}
	_ = conn.Underlying().SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := conn.Next(); err != nil { // status thinking
		t.Fatal(err)
	}
	return span{sent, time.Now()}
}

func TestIdleLeaseIsReleasedAtItsDeadline(t *testing.T) {
	b := policyBroker(t, "idle_timeout: 1s\n", "0s")
	var claim *brokerclient.Claim
	activated := around(func() { claim = b.claim(brokerclient.ClaimRequest{}) })
	drained, reason := b.waitDraining(claim.LeaseID, 10*time.Second)
	if reason != "idle" {
		t.Fatalf("reason = %q", reason)
	}
	within(t, "idle lease", activated, time.Second, drained)
	b.GatewayLog.wait(t, regexp.MustCompile(`level=INFO msg="releasing idle lease" lease_id=`+claim.LeaseID+` idle_timeout=1s reason=idle`), time.Second)
	b.waitNoInstances(15 * time.Second)
}

func TestATurnInFlightIsExemptFromIdle(t *testing.T) {
	b := policyBroker(t, "idle_timeout: 1s\nmax_turn_duration: 30s\n", "400ms")
	claim := b.claim(brokerclient.ClaimRequest{})
	conn := b.dial(claim, brokerclient.DialOptions{})
	// About seven deltas 400ms apart: a turn well past idle_timeout.
	start := time.Now()
	if got := say(t, conn, "one two three four"); got != "echo #1: one two three four" {
		t.Fatalf("the turn was cut short: %q", got)
	}
	settled := time.Now()
	if settled.Sub(start) < 1500*time.Millisecond {
		t.Fatalf("the turn took %s; it must outlast idle_timeout to test the exemption", settled.Sub(start))
	}
	drained, reason := b.waitDraining(claim.LeaseID, 10*time.Second)
	if reason != "idle" {
		t.Fatalf("reason = %q", reason)
	}
	// Settling restarted the idle clock.
	within(t, "settled lease", at(settled), time.Second, drained)
}

func TestATurnPastMaxTurnDurationIsReleasedAsTurnTimeout(t *testing.T) {
	b := policyBroker(t, "idle_timeout: 1s\nmax_turn_duration: 1500ms\n", "1s")
	claim := b.claim(brokerclient.ClaimRequest{})
	started := startSlowTurn(t, b.dial(claim, brokerclient.DialOptions{}))
	drained, reason := b.waitDraining(claim.LeaseID, 10*time.Second)
	if reason != "turn timeout" {
		t.Fatalf("reason = %q", reason)
	}
	within(t, "wedged turn", started, 1500*time.Millisecond, drained)
	b.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="releasing a lease whose turn outlived max_turn_duration\. The instance never reported its turn finished — it is wedged, a tool never returned, or this workload legitimately takes longer than the configured bound" lease_id=`+claim.LeaseID+` max_turn_duration=1.5s reason="turn timeout"`), time.Second)
}

func TestIdleTimeoutZeroDisablesBoth(t *testing.T) {
	b := policyBroker(t, "idle_timeout: 0s\nmax_turn_duration: 100ms\n", "300ms")
	claim := b.claim(brokerclient.ClaimRequest{})
	conn := b.dial(claim, brokerclient.DialOptions{})
	if got := say(t, conn, "x y z"); got != "echo #1: x y z" {
		t.Fatalf("turn cut short with idle_timeout 0: %q", got)
	}
	if b.GatewayLog.count(regexp.MustCompile(`releasing idle lease|outlived max_turn_duration`)) != 0 {
		t.Fatal("a policy release happened with idle_timeout: 0")
	}
}

// Every work state, the wire contract's (thinking, working, streaming, tool,
// waiting) and a stock nexus's (tool_running, cancelling), exempts its lease
// from idle_timeout; any other state is ignored, so a turn that only ever
// reports one is reaped as idle mid-turn.
func TestEveryWorkStateOfTheManualExemptsATurnFromIdle(t *testing.T) {
	live := []string{"thinking", "working", "streaming", "tool", "tool_running", "waiting", "cancelling"}
	const ignored = "pondering"
	states := append(live, ignored)
	yaml := fmt.Sprintf("idle_timeout: 1s\nmax_turn_duration: 30s\nrelease_grace: 3s\nbinaries:\n  nexus:\n    path: %q\n", bin("nexus-echo"))
	for _, s := range states {
		// The ignored one outlives its release, so GET /leases shows why.
		yaml += fmt.Sprintf("  %s:\n    path: %q\n    env: {NEXUS_ECHO_IGNORE_SHUTDOWN: \"%t\", NEXUS_ECHO_SLOW_TURN: 700ms, NEXUS_ECHO_WORK_STATE: %q}\n",
			s, bin("nexus-echo"), s == ignored, s)
	}
	b := startBroker(t, Options{NoNexusEntry: true, YAML: yaml})
	// Every turn runs at once: six deltas 700ms apart, four times idle_timeout.
	conns := map[string]*brokerclient.Conn{}
	for _, s := range states {
		conns[s] = b.dial(b.claim(brokerclient.ClaimRequest{Binary: s}), brokerclient.DialOptions{})
		if err := conns[s].Send(brokerframe.IO{Type: brokerframe.IOInput, Content: "one two three four"}); err != nil {
			t.Fatal(err)
		}
	}
	if _, reason := b.waitDraining(conns[ignored].LeaseID, 10*time.Second); reason != "idle" {
		t.Errorf("a turn reporting only %q was released for %q, want idle", ignored, reason)
	}
	for _, s := range live {
		conn := conns[s]
		_ = conn.Underlying().SetReadDeadline(time.Now().Add(30 * time.Second))
		if got, err := conn.Answer(); err != nil || got != "echo #1: one two three four" {
			t.Errorf("a turn reporting %q was cut short: %q, %v", s, got, err)
			continue
		}
		if l, ok := b.lease(conn.LeaseID); !ok || l.State != "active" {
			t.Errorf("a turn reporting %q was reaped mid-turn: %+v", s, l)
		}
	}
}
