package e2e

import (
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// claimErr claims and returns the refusal, failing the test on success.
func (b *Broker) claimErr(req brokerclient.ClaimRequest) *brokerclient.APIError {
	b.t.Helper()
	if req.Config == "" {
		req.Config = "a: 1\n"
	}
	c, err := b.Client.Claim(context.Background(), req)
	var ae *brokerclient.APIError
	if !errors.As(err, &ae) {
		b.t.Fatalf("claim %+v = %+v, %v; want a refusal", req, c, err)
	}
	return ae
}

// leaseBinary is GET /leases' binary for one lease.
func (b *Broker) leaseBinary(id string) string {
	b.t.Helper()
	l, ok := b.lease(id)
	if !ok {
		b.t.Fatalf("lease %s not in GET /leases", id)
	}
	return l.Binary
}

func TestResumeReusesTheBinaryThatCreatedTheSession(t *testing.T) {
	entries := fmt.Sprintf("binaries:\n  nexus:\n    path: %[1]q\n  vision:\n    path: %[1]q\n  archive:\n    path: %[1]q\n", bin("nexus-echo"))
	b := startBroker(t, Options{StateDir: true, NoNexusEntry: true, YAML: entries})
	first := b.claim(brokerclient.ClaimRequest{Binary: "vision"})
	session := first.SessionID
	if status, _ := b.do("POST", "/release/"+first.LeaseID, ""); status != 200 {
		t.Fatal("release")
	}

	// Omitted binary on a resume means the recorded entry, not nexus.
	again := b.claim(brokerclient.ClaimRequest{SessionID: session})
	if got := b.leaseBinary(again.LeaseID); got != "vision" {
		t.Fatalf("resume without binary spawned %q, want the recorded vision", got)
	}
	// While that lease lives, a mismatch is refused from the live lease.
	mismatch := fmt.Sprintf("session %q was created by binary \"vision\" but this claim requests \"nexus\"; resume it with \"vision\", or omit `binary` to inherit it, or start a new session", session)
	if e := b.claimErr(brokerclient.ClaimRequest{SessionID: session, Binary: "nexus"}); e.Status != 409 || e.Message != mismatch {
		t.Fatalf("mismatch = %d %q\nwant 409 %q", e.Status, e.Message, mismatch)
	}
	if status, _ := b.do("POST", "/release/"+again.LeaseID, ""); status != 200 {
		t.Fatal("release")
	}
	// From the durable index, and across a gateway restart.
	b.KillGateway(syscall.SIGKILL)
	b.StartGateway()
	if e := b.claimErr(brokerclient.ClaimRequest{SessionID: session, Binary: "nexus"}); e.Status != 409 || e.Message != mismatch {
		t.Fatalf("mismatch after restart = %d %q", e.Status, e.Message)
	}
	// An unknown name is still the 400 that lists the entries.
	if e := b.claimErr(brokerclient.ClaimRequest{SessionID: session, Binary: "visoin"}); e.Status != 400 || e.Message != `unknown binary "visoin"; this broker spawns: archive, nexus, vision` {
		t.Fatalf("typo on a bound session = %d %q", e.Status, e.Message)
	}
	// A session with no record is no opinion: the claim proceeds (and fails
	// only because no such session exists on disk).
	if e := b.claimErr(brokerclient.ClaimRequest{SessionID: "feedfacefeedface", Binary: "archive"}); e.Status != 502 {
		t.Fatalf("unrecorded session = %d %q, want it to proceed to the instance (502)", e.Status, e.Message)
	}

	// Remove vision by SIGHUP: a resume inheriting it is a 409 naming it.
	cfg, _ := os.ReadFile(b.ConfigPath)
	without := strings.Replace(string(cfg), fmt.Sprintf("  vision:\n    path: %q\n", bin("nexus-echo")), "", 1)
	if err := os.WriteFile(b.ConfigPath, []byte(without), 0o600); err != nil {
		t.Fatal(err)
	}
	_ = b.gateway.cmd.Process.Signal(syscall.SIGHUP)
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="config reload applied"`), 10*time.Second)
	gone := fmt.Sprintf("session %q was created by binary \"vision\", which this broker no longer offers; restore that entry, or start a new session. This broker spawns: archive, nexus", session)
	if e := b.claimErr(brokerclient.ClaimRequest{SessionID: session}); e.Status != 409 || e.Message != gone {
		t.Fatalf("entry gone = %d %q\nwant 409 %q", e.Status, e.Message, gone)
	}
	// None of those refusals allocated anything.
	b.waitNoInstances(10 * time.Second)
	if _, inUse := b.slots(); inUse != 0 {
		t.Fatalf("slots_in_use = %d after refusals", inUse)
	}
}
