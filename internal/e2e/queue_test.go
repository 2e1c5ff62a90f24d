package e2e

import (
	"context"
	"os"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

func TestAQueuedClaimWhoseClientHangsUpLeavesAtOnce(t *testing.T) {
	b := startBroker(t, Options{YAML: "max_concurrent: 1\nqueue_wait_timeout: 1m\n"})
	b.claim(brokerclient.ClaimRequest{})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := b.Client.Claim(ctx, brokerclient.ClaimRequest{Config: "a: 1"})
		done <- err
	}()
	b.waitQueueDepth(1, 10*time.Second)
	cancel()
	<-done
	start := time.Now()
	b.waitQueueDepth(0, 5*time.Second)
	if d := time.Since(start); d > 500*time.Millisecond {
		t.Fatalf("the abandoned claim left the queue after %s", d)
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`level=INFO msg="claim cancelled while queued for capacity" error="client went away while queued for capacity"`), 5*time.Second)
	if v := b.metrics()[`nexus_broker_claims_total{outcome="cancelled"}`]; v != 1 {
		t.Fatalf("claims_total{cancelled} = %v", v)
	}
}

func TestReloadRaisingMaxConcurrentAdmitsAParkedClaim(t *testing.T) {
	b := startBroker(t, Options{YAML: "max_concurrent: 1\nqueue_wait_timeout: 1m\n"})
	b.claim(brokerclient.ClaimRequest{})
	done := make(chan error, 1)
	go func() {
		_, err := b.Client.Claim(context.Background(), brokerclient.ClaimRequest{Config: "a: 1"})
		done <- err
	}()
	b.waitQueueDepth(1, 10*time.Second)
	cfg, _ := os.ReadFile(b.ConfigPath)
	raised := strings.Replace(string(cfg), "max_concurrent: 1\n", "max_concurrent: 2\n", 1)
	if err := os.WriteFile(b.ConfigPath, []byte(raised), 0o600); err != nil {
		t.Fatal(err)
	}
	_ = b.gateway.cmd.Process.Signal(syscall.SIGHUP)
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("the parked claim failed: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("raising max_concurrent did not admit the parked claim")
	}
	// Lowering it evicts nothing.
	lowered := strings.Replace(raised, "max_concurrent: 2\n", "max_concurrent: 1\n", 1)
	if err := os.WriteFile(b.ConfigPath, []byte(lowered), 0o600); err != nil {
		t.Fatal(err)
	}
	_ = b.gateway.cmd.Process.Signal(syscall.SIGHUP)
	b.GatewayLog.wait(t, regexp.MustCompile(`(?s)(msg="config reload applied".*){2}`), 10*time.Second)
	if n := len(b.leaseStates()); n != 2 {
		t.Fatalf("%d leases after lowering max_concurrent, want both kept", n)
	}
	if _, inUse := b.slots(); inUse != 2 {
		t.Fatalf("slots_in_use = %d", inUse)
	}
}

// The three capacity refusals are all 503 and three different bodies and
// claims_total outcomes: no capacity (waiting switched off), capacity
// queue full (never allowed to wait, answered at once) and capacity wait
// timed out (waited its queue_wait_timeout); the claim log line tells
// them apart too.
func TestTheThreeCapacityRefusalsAreDistinct(t *testing.T) {
	bs := startBrokersTogether(t,
		Options{YAML: "max_concurrent: 1\nqueue_wait_timeout: 0s\n"},
		Options{YAML: "max_concurrent: 1\nmax_queue_depth: 1\nqueue_wait_timeout: 2s\n"})
	noWait, queued := bs[0], bs[1]

	noWait.claim(brokerclient.ClaimRequest{})
	code, body := noWait.do("POST", "/claim", `{"config":"a: 1"}`)
	wantAnswer(t, "a claim at capacity with queue_wait_timeout 0s", code, body, 503, `{"error":"no capacity"}`+"\n")

	queued.claim(brokerclient.ClaimRequest{})
	type answer struct {
		code int
		body string
	}
	parked := make(chan answer, 1)
	go func() {
		code, body := queued.do("POST", "/claim", `{"config":"a: 1"}`)
		parked <- answer{code, body}
	}()
	queued.waitQueueDepth(1, 10*time.Second)
	start := time.Now()
	code, body = queued.do("POST", "/claim", `{"config":"a: 1"}`)
	wantAnswer(t, "a claim behind a queue max_queue_depth deep", code, body, 503, `{"error":"capacity queue full"}`+"\n")
	if d := time.Since(start); d > time.Second {
		t.Errorf("capacity queue full took %s: it must be refused without waiting", d)
	}
	a := <-parked
	wantAnswer(t, "a claim that waited its queue_wait_timeout", a.code, a.body, 503, `{"error":"capacity wait timed out"}`+"\n")

	for _, c := range []struct {
		b       *Broker
		outcome string
		text    string
	}{{noWait, "no_capacity", "no capacity"}, {queued, "queue_full", "capacity queue full"}, {queued, "queue_timeout", "capacity wait timed out"}} {
		if v := c.b.metrics()[`nexus_broker_claims_total{outcome="`+c.outcome+`"}`]; v != 1 {
			t.Errorf("claims_total{outcome=%q} = %v, want 1", c.outcome, v)
		}
		c.b.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="claim failed" status=503 reason="`+c.text+`"`), time.Second)
	}
}
