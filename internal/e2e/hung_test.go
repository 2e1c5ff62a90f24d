package e2e

import (
	"context"
	"errors"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// TestHungSpawndIsNotADeadOne: with spawnd stopped (SIGSTOP) the gateway
// notices within seconds. A claim answers 503 "spawner unavailable" within
// 5 s, counted as spawn_failed; a release answers 200 at once and the lease
// stays draining; /readyz answers 503 naming spawnd while /healthz keeps
// answering ok; an attached client keeps streaming. After SIGCONT the
// released instance is gone within release_grace + 2 s, and nothing the
// refused claim may have left in spawnd survives.
func TestHungSpawndIsNotADeadOne(t *testing.T) {
	const grace = 2 * time.Second
	b := startBroker(t, Options{YAML: "release_grace: 2s\n"})
	keep := b.claim(brokerclient.ClaimRequest{})
	conn := b.dial(keep, brokerclient.DialOptions{})
	if got := say(t, conn, "before"); got != "echo #1: before" {
		t.Fatalf("answer = %q", got)
	}
	gone := b.claim(brokerclient.ClaimRequest{})
	if n := len(b.Instances()); n != 2 {
		t.Fatalf("%d instances, want 2", n)
	}

	spawnd := b.spawnd.cmd.Process
	if err := spawnd.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = spawnd.Signal(syscall.SIGCONT) })

	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := b.Client.Claim(ctx, brokerclient.ClaimRequest{Config: "engine:\n  name: example\n"})
	var ae *brokerclient.APIError
	if !errors.As(err, &ae) || ae.Status != 503 || ae.Message != "spawner unavailable" {
		t.Fatalf("claim with spawnd stopped = %v, want 503 spawner unavailable", err)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("the claim took %s to be refused, want within 5s", took)
	}
	if m := b.metrics(); m[`nexus_broker_claims_total{outcome="spawn_failed"}`] != 1 {
		t.Errorf(`claims_total{outcome="spawn_failed"} = %v, want 1`, m[`nexus_broker_claims_total{outcome="spawn_failed"}`])
	}
	if code, body := b.get("/readyz"); code != 503 || !strings.Contains(body, "nexus-spawnd") {
		t.Errorf("GET /readyz with spawnd stopped = %d %s, want 503 naming nexus-spawnd", code, body)
	}
	if code, body := b.get("/healthz"); code != 200 || !strings.Contains(body, `"ok"`) {
		t.Errorf("GET /healthz with spawnd stopped = %d %s, want the spec's 200 ok", code, body)
	}

	start = time.Now()
	if code, body := b.do("POST", "/release/"+gone.LeaseID, ""); code != 200 || !strings.Contains(body, `"released"`) {
		t.Fatalf("release with spawnd stopped = %d %s", code, body)
	}
	if took := time.Since(start); took > time.Second {
		t.Errorf("the release took %s to answer, want at once", took)
	}
	if l, ok := b.lease(gone.LeaseID); !ok || l.State != "draining" {
		t.Errorf("the released lease with spawnd stopped: %+v %v, want draining", l, ok)
	}
	if got := say(t, conn, "during"); got != "echo #2: during (earlier: before)" {
		t.Errorf("the attached client with spawnd stopped got %q", got)
	}

	if err := spawnd.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	resumed := time.Now()
	eventually(t, grace+2*time.Second, func() string { return "instances left:" + fmtInts(b.Instances()) },
		func() bool { return len(b.Instances()) == 1 })
	t.Logf("released instance gone %s after SIGCONT", time.Since(resumed))
	eventually(t, 15*time.Second, func() string { _, body := b.get("/readyz"); return body }, func() bool { code, _ := b.get("/readyz"); return code == 200 })
	eventually(t, 10*time.Second, func() string { return "the released lease is still listed" }, func() bool { _, ok := b.lease(gone.LeaseID); return !ok })
	if got := say(t, conn, "after"); !strings.HasPrefix(got, "echo #3: after") {
		t.Errorf("the attached client after SIGCONT got %q", got)
	}
}

func fmtInts(xs []int) string {
	var sb strings.Builder
	for _, x := range xs {
		sb.WriteString(" ")
		sb.WriteString(strconv.Itoa(x))
	}
	return sb.String()
}

// TestASIGTERMIsNotHeldBehindAReloadSpawndDoesNotAnswer: a SIGHUP while
// spawnd is down waits up to 30 s for it to come back and judge the file; a
// SIGTERM in that wait stops the gateway at once, and the rejected reload
// says in words that spawnd did not answer, not as a raw RPC status.
func TestASIGTERMIsNotHeldBehindAReloadSpawndDoesNotAnswer(t *testing.T) {
	b := startBroker(t, Options{})
	b.KillSpawnd(syscall.SIGKILL)
	_ = b.gateway.cmd.Process.Signal(syscall.SIGHUP)
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="SIGHUP received, reloading config"`), 10*time.Second)
	_ = b.gateway.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-b.gateway.done:
	case <-time.After(20 * time.Second):
		t.Fatalf("the gateway still runs 20 s after SIGTERM, behind a reload spawnd does not answer:\n%s", b.GatewayLog)
	}
	rejected := b.GatewayLog.wait(t, regexp.MustCompile(`level=ERROR msg="config reload rejected; the configuration already in force is unchanged" path=\S+ error="nexus-spawnd did not answer the reload: [^"]+"`), time.Second)
	if line := rejected[0]; strings.Contains(line, "rpc error:") {
		t.Errorf("the rejection is a raw RPC status: %s", line)
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="nexus-broker stopped"`), time.Second)
}
