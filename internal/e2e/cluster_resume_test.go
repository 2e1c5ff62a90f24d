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

// TestClusterResumeOfALocalSessionWaitsForALocalSlot: a session A holds,
// resumed through a full A while B has room, waits in A's queue and is
// spawned on A when a slot frees there: B's host has no transcript of it.
func TestClusterResumeOfALocalSessionWaitsForALocalSlot(t *testing.T) {
	_, bs := startCluster(t, "max_concurrent: 1\n", "", "a", "b")
	a := bs["a"]
	first := a.claim(brokerclient.ClaimRequest{})
	if got := say(t, a.dial(first, brokerclient.DialOptions{}), "hello"); got != "echo #1: hello" {
		t.Fatalf("on A: %q", got)
	}
	if st, body := a.do("POST", "/release/"+first.LeaseID, ""); st != 200 {
		t.Fatalf("release = %d %s", st, body)
	}
	eventually(t, 20*time.Second, func() string { return "the released instance is still there" }, func() bool { return len(a.Instances()) == 0 })
	filler := a.claim(brokerclient.ClaimRequest{})

	type answer struct {
		claim *brokerclient.Claim
		err   error
	}
	resumed := make(chan answer, 1)
	go func() {
		c, err := a.Client.Claim(ctxT(t), brokerclient.ClaimRequest{SessionID: first.SessionID, Config: "engine:\n  name: example\n"})
		resumed <- answer{c, err}
	}()
	eventually(t, 20*time.Second, func() string { return "the resume never queued on A" }, func() bool {
		return a.metrics()["nexus_broker_queue_depth"] == 1
	})
	if st, body := a.do("POST", "/release/"+filler.LeaseID, ""); st != 200 {
		t.Fatalf("release = %d %s", st, body)
	}
	var got *brokerclient.Claim
	select {
	case ans := <-resumed:
		if ans.err != nil {
			t.Fatalf("the queued resume: %v", ans.err)
		}
		got = ans.claim
	case <-time.After(30 * time.Second):
		t.Fatal("the queued resume was not served after A freed its slot")
	}
	if !strings.HasSuffix(got.LeaseID, "-a") || got.SessionID != first.SessionID {
		t.Fatalf("the resume got lease %q session %q; want a lease of a, session %q", got.LeaseID, got.SessionID, first.SessionID)
	}
	if got := say(t, a.dial(got, brokerclient.DialOptions{}), "again"); got != "echo #2: again (earlier: hello)" {
		t.Fatalf("the resumed session answered %q, want its transcript continued", got)
	}
}

// TestClusterResumeOwnershipIsCheckedOnTheSessionsBroker: Alice's session
// lives on B. Bob resuming it through A is routed to B, where the
// ownership check runs with the principal A relayed (Bob's): refused as
// an unknown session, nothing spawned anywhere, and the refusal logged on
// B naming Bob. Alice's own resume through A works.
func TestClusterResumeOwnershipIsCheckedOnTheSessionsBroker(t *testing.T) {
	_, bs := startCluster(t, clusterAuthYAML, "alice-token", "a", "b")
	a, b := bs["a"], bs["b"]
	first := b.claim(brokerclient.ClaimRequest{})
	if st, body := b.do("POST", "/release/"+first.LeaseID, ""); st != 200 {
		t.Fatalf("release = %d %s", st, body)
	}
	eventually(t, 10*time.Second, func() string { return "B's instance gone" }, func() bool { return len(b.Instances()) == 0 })
	st, body := a.doAs("bob-token", "POST", "/claim", `{"config":"engine:\n  name: example\n","session_id":"`+first.SessionID+`"}`)
	if st != 404 || !strings.Contains(body, "unknown session") {
		t.Fatalf("Bob resuming Alice's session through A: %d %s, want 404 unknown session", st, body)
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="resume refused: the session belongs to another principal" principal=bob session_id=`+first.SessionID), 5*time.Second)
	if na, nb := len(a.Instances()), len(b.Instances()); na+nb != 0 {
		t.Fatalf("after Bob's refused resume A runs %d and B %d instances, want none", na, nb)
	}
	if resumed := a.claim(brokerclient.ClaimRequest{SessionID: first.SessionID}); !strings.HasSuffix(resumed.LeaseID, "-b") {
		t.Fatalf("Alice's resume through A got lease %q, want one of b", resumed.LeaseID)
	}
}
