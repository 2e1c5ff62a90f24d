package e2e

import (
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// TestClusterResumeGoesToTheSessionsBroker: a session created on B and
// resumed through A, which has free slots, is spawned on B (its host keeps
// the transcript), answers through A, and the transcript continues; a new
// session through A stays on A.
func TestClusterResumeGoesToTheSessionsBroker(t *testing.T) {
	_, bs := startCluster(t, "", "", "a", "b")
	a, b := bs["a"], bs["b"]
	first := b.claim(brokerclient.ClaimRequest{})
	if got := say(t, b.dial(first, brokerclient.DialOptions{}), "hello"); got != "echo #1: hello" {
		t.Fatalf("on B: %q", got)
	}
	if st, body := a.do("POST", "/release/"+first.LeaseID, ""); st != 200 {
		t.Fatalf("release through A = %d %s", st, body)
	}
	resumed := a.claim(brokerclient.ClaimRequest{SessionID: first.SessionID})
	if !strings.HasSuffix(resumed.LeaseID, "-b") || resumed.SessionID != first.SessionID {
		t.Fatalf("the resume through A got lease %q session %q; want a lease of b, session %q", resumed.LeaseID, resumed.SessionID, first.SessionID)
	}
	if n := len(a.Instances()); n != 0 {
		t.Fatalf("A runs %d instances for B's session", n)
	}
	conn := dialVia(t, a, resumed.LeaseID, brokerclient.DialOptions{})
	if got := say(t, conn, "again"); got != "echo #2: again (earlier: hello)" {
		t.Fatalf("the resumed session through A answered %q, want its transcript continued", got)
	}
	a.GatewayLog.wait(t, regexp.MustCompile(`msg="resume routed to the broker holding its session" peer=b session_id=`+first.SessionID), 5*time.Second)
	if fresh := a.claim(brokerclient.ClaimRequest{}); !strings.HasSuffix(fresh.LeaseID, "-a") {
		t.Fatalf("a new session through A went to %q", fresh.LeaseID)
	}
}
