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
	b.GatewayLog.wait(t, regexp.MustCompile(`claim abandoned by its client`), 5*time.Second)
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
