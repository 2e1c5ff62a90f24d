package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/echo"
	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
	"github.com/nexus-broker/nexus-broker/pkg/sessionid"
)

// hostileSessionIDs are ids that would reach an instance's argv, the journal
// and the index as flags, paths or forged lines.
var hostileSessionIDs = []string{"-h", "a/b", "../..", "a\nb", strings.Repeat("a", sessionid.MaxLen+1)}

// startLiarBroker starts a broker with a state_dir whose entry liar reports
// the bytes of the returned file as its session id; nexus and each of
// honest are plain nexus-echo entries.
func startLiarBroker(t *testing.T, liar string, honest ...string) (*Broker, string) {
	reported := filepath.Join(t.TempDir(), "reported-session")
	entries := "binaries:\n"
	for _, name := range append(honest, "nexus") {
		entries += fmt.Sprintf("  %s:\n    path: %q\n", name, bin("nexus-echo"))
	}
	entries += fmt.Sprintf("  %s:\n    path: %q\n    env:\n      %s: %q\n", liar, bin("nexus-echo"), echo.EnvReportSessionFrom, reported)
	return startBroker(t, Options{StateDir: true, NoNexusEntry: true, YAML: entries}), reported
}

// TestSessionRebindAcrossEntriesIsRefused is the attack of an instance of
// entry mallory reporting the session id of a session entry alice created:
// refused while alice's lease lives and after (from the index), and the
// victim's resume, omitting binary, still runs as alice.
func TestSessionRebindAcrossEntriesIsRefused(t *testing.T) {
	b, stolen := startLiarBroker(t, "mallory", "alice")
	victim := b.claim(brokerclient.ClaimRequest{Binary: "alice"})
	if err := os.WriteFile(stolen, []byte(victim.SessionID), 0o644); err != nil {
		t.Fatal(err)
	}
	refused := regexp.MustCompile(`session-id report refused.*belongs to entry \\"alice\\", not \\"mallory\\"`)
	steal := func(when string, want int) {
		t.Helper()
		thief := b.claim(brokerclient.ClaimRequest{Binary: "mallory"})
		if thief.SessionID != "" {
			t.Fatalf("%s: mallory's claim answered session %q, want none", when, thief.SessionID)
		}
		if l, _ := b.lease(thief.LeaseID); l.SessionID != "" {
			t.Fatalf("%s: mallory's lease carries session %q", when, l.SessionID)
		}
		eventually(t, 10*time.Second, func() string { return b.SpawndLog.String() }, func() bool { return b.SpawndLog.count(refused) >= want })
		if status, _ := b.do("POST", "/release/"+thief.LeaseID, ""); status != 200 {
			t.Fatal("release")
		}
	}
	steal("victim's lease live", 1)
	if status, _ := b.do("POST", "/release/"+victim.LeaseID, ""); status != 200 {
		t.Fatal("release")
	}
	steal("victim's lease released", 2)

	resumed := b.claim(brokerclient.ClaimRequest{SessionID: victim.SessionID})
	if got := b.leaseBinary(resumed.LeaseID); got != "alice" {
		t.Fatalf("the victim's resume ran as %q, want alice", got)
	}
}

// TestSessionRebindWithoutStateDir: with neither state_dir nor auth:, a
// claim answers with its session id ahead of spawnd's Record (the gateway
// checked that no lease of its own holds it); an instance of mallory then
// reporting the id of alice's live session takes the ordinary path and is
// refused by spawnd, its claim answering no session id and why; and
// alice's lease keeps its session (docs/architecture.md, "A session id
// answered ahead").
func TestSessionRebindWithoutStateDir(t *testing.T) {
	reported := filepath.Join(t.TempDir(), "reported-session")
	entries := fmt.Sprintf("binaries:\n  nexus:\n    path: %[1]q\n  alice:\n    path: %[1]q\n  mallory:\n    path: %[1]q\n    env:\n      %[2]s: %[3]q\n",
		bin("nexus-echo"), echo.EnvReportSessionFrom, reported)
	b := startBroker(t, Options{NoNexusEntry: true, YAML: entries})
	victim := b.claim(brokerclient.ClaimRequest{Binary: "alice"})
	if victim.SessionID == "" {
		t.Fatal("alice's claim answered no session id")
	}
	if err := os.WriteFile(reported, []byte(victim.SessionID), 0o644); err != nil {
		t.Fatal(err)
	}
	thief := b.claim(brokerclient.ClaimRequest{Binary: "mallory"})
	if want := `belongs to entry "alice", not "mallory"`; thief.SessionID != "" || !strings.Contains(thief.SessionError, want) {
		t.Fatalf("mallory's claim: session_id %q, session_error %q; want none, and one containing %q", thief.SessionID, thief.SessionError, want)
	}
	if l, _ := b.lease(victim.LeaseID); l.SessionID != victim.SessionID {
		t.Fatalf("alice's lease carries %q after the attempt, want %q", l.SessionID, victim.SessionID)
	}
}

// TestClaimSaysWhySessionReportWasRefused: a claim whose instance's
// session-id report was refused (by spawnd: another entry's session; by
// the rule: a hostile id) answers 200 without session_id and with
// session_error saying why; an honest claim carries no session_error.
func TestClaimSaysWhySessionReportWasRefused(t *testing.T) {
	b, reported := startLiarBroker(t, "mallory", "alice")
	status, body := b.do("POST", "/claim", `{"config":"engine:\n  name: x\n","binary":"alice"}`)
	var victim brokerclient.Claim
	if err := json.Unmarshal([]byte(body), &victim); status != 200 || err != nil || victim.SessionID == "" || strings.Contains(body, "session_error") {
		t.Fatalf("honest claim = %d %s, want 200 with session_id and no session_error", status, body)
	}
	for _, tc := range []struct{ report, why string }{
		{victim.SessionID, `belongs to entry "alice", not "mallory"`},
		{"../..", sessionid.Rule},
	} {
		if err := os.WriteFile(reported, []byte(tc.report), 0o644); err != nil {
			t.Fatal(err)
		}
		c := b.claim(brokerclient.ClaimRequest{Binary: "mallory"})
		if c.SessionID != "" || !strings.Contains(c.SessionError, tc.why) {
			t.Errorf("claim whose instance reported %q: session_id %q, session_error %q; want none and one containing %q", tc.report, c.SessionID, c.SessionError, tc.why)
		}
		if status, _ := b.do("POST", "/release/"+c.LeaseID, ""); status != 200 {
			t.Fatal("release")
		}
	}
}

// TestHostileSessionIDsAreRefused: at the claim, a 400 naming the rule
// before anything is allocated; in an instance's report, a WARN, and the
// lease runs on with no session id.
func TestHostileSessionIDsAreRefused(t *testing.T) {
	b, reported := startLiarBroker(t, "liar")
	for _, id := range hostileSessionIDs {
		e := b.claimErr(brokerclient.ClaimRequest{SessionID: id})
		if e.Status != 400 || !strings.HasPrefix(e.Message, "invalid session_id: ") || !strings.Contains(e.Message, sessionid.Rule) {
			t.Errorf("claim resuming %q = %d %q, want 400 naming the rule", id, e.Status, e.Message)
		}
	}
	if _, inUse := b.slots(); inUse != 0 || len(b.Instances()) != 0 {
		t.Fatalf("refused claims allocated: %d slots, instances %v", inUse, b.Instances())
	}
	warn := regexp.MustCompile(`session-id report refused; the lease keeps running`)
	for i, id := range hostileSessionIDs {
		if err := os.WriteFile(reported, []byte(id), 0o644); err != nil {
			t.Fatal(err)
		}
		c := b.claim(brokerclient.ClaimRequest{Binary: "liar"})
		if c.SessionID != "" {
			t.Errorf("claim whose instance reported %q answered session %q, want none", id, c.SessionID)
		}
		if l, ok := b.lease(c.LeaseID); !ok || l.State != "active" || l.SessionID != "" {
			t.Errorf("lease after reporting %q = %+v, want active with no session id", id, l)
		}
		if n := b.GatewayLog.count(warn); n != i+1 {
			t.Errorf("%d refusal WARNs after %d hostile reports", n, i+1)
		}
		if status, _ := b.do("POST", "/release/"+c.LeaseID, ""); status != 200 {
			t.Fatal("release")
		}
	}
	index, _ := os.ReadFile(filepath.Join(b.Dir, "state", "session-binaries.jsonl"))
	journal, _ := os.ReadFile(filepath.Join(b.Dir, "state", "leases.jsonl"))
	for _, id := range hostileSessionIDs {
		for name, data := range map[string][]byte{"index": index, "journal": journal} {
			if strings.Contains(string(data), fmt.Sprintf("%q", id)) {
				t.Errorf("%s holds the hostile id %q", name, id)
			}
		}
	}
}

// TestSessionReportFloodIsBounded: twenty reports of 500 kB each (10 MB a spawnd of old wrote to its journal and again to its index) leave
// spawnd's RSS, the journal and the index where they were.
func TestSessionReportFloodIsBounded(t *testing.T) {
	entries := fmt.Sprintf("binaries:\n  nexus:\n    path: %q\n    env:\n      %s: 20x500000\n", bin("nexus-echo"), echo.EnvReportFlood)
	b := startBroker(t, Options{StateDir: true, NoNexusEntry: true, YAML: entries})
	state := filepath.Join(b.Dir, "state")
	size := func(name string) int64 {
		st, err := os.Stat(filepath.Join(state, name))
		if err != nil {
			return 0
		}
		return st.Size()
	}
	spawnd := b.spawnd.cmd.Process.Pid
	rss := vmRSS(t, spawnd)
	c := b.claim(brokerclient.ClaimRequest{})
	conn := b.dial(c, brokerclient.DialOptions{})
	// The flood follows the handshake; a turn answered after it means the
	// gateway has read every report.
	if got := say(t, conn, "hello"); got == "" {
		t.Fatal("no answer after the flood")
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`session-id report refused.*already reported 4 session ids`), 30*time.Second)
	// One WARN per refused report up to the cap, one for the cap, none after.
	if n := b.GatewayLog.count(regexp.MustCompile(`session-id report refused`)); n != 4 {
		t.Errorf("%d refusal WARNs for one flood of 20, want 4", n)
	}
	const slack = 64 << 10
	if j, x := size("leases.jsonl"), size("session-binaries.jsonl"); j > slack || x > slack {
		t.Errorf("after the flood the journal holds %d bytes and the index %d; want each under %d", j, x, slack)
	}
	if grown := vmRSS(t, spawnd) - rss; grown > 32<<20 {
		t.Errorf("spawnd's RSS grew by %d MiB under the flood", grown>>20)
	}
}

// TestSessionReportOfAnotherPrincipalsSessionIsRefused is the attack of
// bob's instance reporting the session id alice's claim of the same entry
// created: spawnd refuses it, bob's claim is answered without it (saying
// why), and alice's resume of her session is hers, not bob's lease.
func TestSessionReportOfAnotherPrincipalsSessionIsRefused(t *testing.T) {
	reported := filepath.Join(t.TempDir(), "reported-session")
	if err := os.WriteFile(reported, []byte("sess-alices"), 0o644); err != nil {
		t.Fatal(err)
	}
	b := startBroker(t, Options{Token: "tok-ops", StateDir: true, YAML: fmt.Sprintf("  fixed:\n    path: %q\n    env: {%s: %q}\n%s",
		bin("nexus-echo"), echo.EnvReportSessionFrom, reported, poolAuthYAML)})
	alice := &brokerclient.Client{Base: b.Base, Token: "tok-alice"}
	bob := &brokerclient.Client{Base: b.Base, Token: "tok-bob"}
	a, err := alice.Claim(context.Background(), brokerclient.ClaimRequest{Binary: "fixed", Config: poolConfig})
	if err != nil || a.SessionID != "sess-alices" {
		t.Fatalf("alice's claim = %+v %v, want sess-alices", a, err)
	}
	c, err := bob.Claim(context.Background(), brokerclient.ClaimRequest{Binary: "fixed", Config: poolConfig})
	if err != nil || c.SessionID != "" || !strings.Contains(c.SessionError, "belongs to another principal") {
		t.Fatalf("bob's claim = %+v %v, want no session id and a session_error naming another principal", c, err)
	}
	if l, _ := b.lease(c.LeaseID); l.SessionID != "" {
		t.Fatalf("bob's lease carries session %q", l.SessionID)
	}
	b.SpawndLog.wait(t, regexp.MustCompile(`session-id report refused.*lease_id=`+c.LeaseID+`.*belongs to another principal`), 5*time.Second)
}
