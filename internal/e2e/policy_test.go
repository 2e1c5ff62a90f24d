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

// within checks that an event at got happened no earlier than deadline
// (less a little clock slack) and within one second after it.
func within(t *testing.T, what string, deadline, got time.Time) {
	t.Helper()
	if d := got.Sub(deadline); d < -50*time.Millisecond || d > time.Second {
		t.Fatalf("%s released %s from its deadline, want within [0, 1s]", what, d)
	}
}

// startSlowTurn sends an input of eight words (eight deltas, each
// NEXUS_ECHO_SLOW_TURN apart) and returns when the instance said it is
// thinking: when the turn clock started.
func startSlowTurn(t *testing.T, conn *brokerclient.Conn) time.Time {
	t.Helper()
	if err := conn.Send(brokerframe.IO{Type: "input", Content: "a b c d e f g h"}); err != nil {
		t.Fatal(err)
	}
	_ = conn.Underlying().SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := conn.Next(); err != nil { // status thinking
		t.Fatal(err)
	}
	return time.Now()
}

func TestIdleLeaseIsReleasedAtItsDeadline(t *testing.T) {
	b := policyBroker(t, "idle_timeout: 1s\n", "0s")
	claim := b.claim(brokerclient.ClaimRequest{})
	activated := time.Now()
	at, reason := b.waitDraining(claim.LeaseID, 10*time.Second)
	if reason != "idle" {
		t.Fatalf("reason = %q", reason)
	}
	within(t, "idle lease", activated.Add(time.Second), at)
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="releasing lease by policy" lease_id=`+claim.LeaseID+` reason=idle`), time.Second)
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
	at, reason := b.waitDraining(claim.LeaseID, 10*time.Second)
	if reason != "idle" {
		t.Fatalf("reason = %q", reason)
	}
	// Settling restarted the idle clock.
	within(t, "settled lease", settled.Add(time.Second), at)
}

func TestATurnPastMaxTurnDurationIsReleasedAsTurnTimeout(t *testing.T) {
	b := policyBroker(t, "idle_timeout: 1s\nmax_turn_duration: 1500ms\n", "1s")
	claim := b.claim(brokerclient.ClaimRequest{})
	started := startSlowTurn(t, b.dial(claim, brokerclient.DialOptions{}))
	at, reason := b.waitDraining(claim.LeaseID, 10*time.Second)
	if reason != "turn timeout" {
		t.Fatalf("reason = %q", reason)
	}
	within(t, "wedged turn", started.Add(1500*time.Millisecond), at)
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="releasing lease by policy" lease_id=`+claim.LeaseID+` reason="turn timeout"`), time.Second)
}

func TestIdleTimeoutZeroDisablesBoth(t *testing.T) {
	b := policyBroker(t, "idle_timeout: 0s\nmax_turn_duration: 100ms\n", "300ms")
	claim := b.claim(brokerclient.ClaimRequest{})
	conn := b.dial(claim, brokerclient.DialOptions{})
	if got := say(t, conn, "x y z"); got != "echo #1: x y z" {
		t.Fatalf("turn cut short with idle_timeout 0: %q", got)
	}
	if b.GatewayLog.count(regexp.MustCompile(`releasing lease by policy`)) != 0 {
		t.Fatal("a policy release happened with idle_timeout: 0")
	}
}
