package e2e

import (
	"context"
	"encoding/json"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// resumeAs claims with token, resuming session, and returns the answer.
func (b *Broker) resumeAs(token, session string) (int, string) {
	b.t.Helper()
	body, _ := json.Marshal(map[string]string{"config": "engine:\n  name: example\n", "session_id": session})
	return b.doAs(token, http.MethodPost, "/claim", string(body))
}

// ownedSession is a session alice created and released.
func ownedSession(t *testing.T, b *Broker) string {
	t.Helper()
	c := b.claimAs(tokAlice)
	if c.SessionID == "" {
		t.Fatal("alice's claim reported no session id")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := b.as(tokAlice).Release(ctx, c.LeaseID); err != nil {
		t.Fatal(err)
	}
	return c.SessionID
}

// assertUnknownSession checks that bob's resumes of alice's session and of
// an id nobody created get the same 404, spawn nothing (instances counts
// them), and are logged by case without naming the owner.
func assertUnknownSession(t *testing.T, b *Broker, session string, instances func() int) {
	t.Helper()
	const want = `{"error":"unknown session"}` + "\n"
	before := b.metrics()[`nexus_broker_claims_total{outcome="rejected"}`]
	live := instances()
	for _, id := range []string{session, "feedfacefeedface"} {
		if code, body := b.resumeAs(tokBob, id); code != http.StatusNotFound || body != want {
			t.Errorf("bob resuming %s = %d %q, want 404 %q", id, code, body, want)
		}
	}
	if n := instances(); n != live {
		t.Errorf("%d instances after bob's refused resumes, %d before: want none spawned", n, live)
	}
	if got := b.metrics()[`nexus_broker_claims_total{outcome="rejected"}`] - before; got != 2 {
		t.Errorf("claims_total{outcome=rejected} grew by %v, want 2", got)
	}
	other := b.GatewayLog.wait(t, regexp.MustCompile(`msg="resume refused: the session belongs to another principal".*\n`), 10*time.Second)
	none := b.GatewayLog.wait(t, regexp.MustCompile(`msg="resume refused: no owner is recorded for the session[^"]*".*\n`), 10*time.Second)
	for _, line := range append(other, none...) {
		if strings.Contains(line, "alice") || !strings.Contains(line, "principal=bob") {
			t.Errorf("refusal line %q names the owner, or not the caller", line)
		}
	}
}

// TestCrossPrincipalResumeIsUnknown: with auth: alone, bob resuming alice's
// session gets exactly what an id nobody created gets, before anything is
// spawned; alice resumes her own.
func TestCrossPrincipalResumeIsUnknown(t *testing.T) {
	b := startAuthBroker(t, "", Options{StateDir: true})
	session := ownedSession(t, b)
	assertUnknownSession(t, b, session, func() int { return len(b.Instances()) })
	if code, body := b.resumeAs(tokAlice, session); code != http.StatusOK {
		t.Fatalf("alice resuming her own session = %d %s", code, body)
	}
}

// TestResumeWithoutAuthIsUnchanged: without auth: no owner is checked; an
// id nobody created is spawned and fails as the spec says (502).
func TestResumeWithoutAuthIsUnchanged(t *testing.T) {
	b := startBroker(t, Options{StateDir: true})
	if e := b.claimErr(brokerclient.ClaimRequest{SessionID: "feedfacefeedface"}); e.Status != http.StatusBadGateway {
		t.Fatalf("resume of an unknown id without auth = %d %q, want the spec's 502", e.Status, e.Message)
	}
}
