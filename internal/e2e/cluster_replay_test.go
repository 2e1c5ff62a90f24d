package e2e

import (
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// spy is a NATS client that is not a broker (it has no cluster secret),
// with permission to see everything: it records every message on the
// subjects it watches.
type spy struct {
	t  *testing.T
	nc *nats.Conn
	mu sync.Mutex
	// seen is every message, in arrival order.
	seen []*nats.Msg
}

func newSpy(t *testing.T, ns *natsserver.Server, subjects ...string) *spy {
	t.Helper()
	return newSpyAs(t, ns, nil, subjects...)
}

// newSpyAs is newSpy connecting with opts (a NATS user of its own).
func newSpyAs(t *testing.T, ns *natsserver.Server, opts []nats.Option, subjects ...string) *spy {
	t.Helper()
	nc, err := nats.Connect(ns.ClientURL(), opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	s := &spy{t: t, nc: nc}
	for _, subj := range subjects {
		if _, err := nc.Subscribe(subj, func(m *nats.Msg) {
			s.mu.Lock()
			s.seen = append(s.seen, m)
			s.mu.Unlock()
		}); err != nil {
			t.Fatal(err)
		}
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	return s
}

// last is the latest captured request whose subject ends in suffix.
func (s *spy) last(suffix string) *nats.Msg {
	s.t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := len(s.seen) - 1; i >= 0; i-- {
		if strings.HasSuffix(s.seen[i].Subject, suffix) {
			return s.seen[i]
		}
	}
	s.t.Fatalf("no request on *%s was captured", suffix)
	return nil
}

// on counts the captured messages sent to subject.
func (s *spy) on(subject string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, m := range s.seen {
		if m.Subject == subject {
			n++
		}
	}
	return n
}

// replay publishes a captured message again, byte for byte, to reply
// ("" keeps the captured reply subject).
func (s *spy) replay(m *nats.Msg, reply string) {
	s.t.Helper()
	again := nats.NewMsg(m.Subject)
	again.Reply, again.Data, again.Header = m.Reply, m.Data, m.Header
	if reply != "" {
		again.Reply = reply
	}
	if err := s.nc.PublishMsg(again); err != nil {
		s.t.Fatal(err)
	}
}

// TestClusterRefusesReplayedRequests acts as a NATS client that is not a
// broker: it captures the sealed requests B sends A for A's lease (a client
// frame, a ticket, a release) and sends them again, verbatim and with its
// own reply subject. Nothing happens twice, nothing answers the attacker,
// and A counts and names every refusal.
func TestClusterRefusesReplayedRequests(t *testing.T) {
	ns, bs := startCluster(t, clusterAuthYAML, "alice-token", "a", "b")
	a, b := bs["a"], bs["b"]
	s := newSpy(t, ns, "nexus.broker.b.a.>", "_INBOX.>")
	refused := func(reason string) float64 {
		return a.metrics()[`nexus_broker_cluster_messages_refused_total{reason="`+reason+`"}`]
	}
	mine := nats.NewInbox()
	stolen, err := s.nc.SubscribeSync(mine)
	if err != nil {
		t.Fatal(err)
	}
	// replayAll sends each captured request again, verbatim (the answer
	// would go to B, which asked once) and redirected to the attacker, and
	// waits for A to refuse them all.
	replayAll := func(ms ...*nats.Msg) {
		t.Helper()
		replays, forged := refused("replay"), refused("seal")
		for _, m := range ms {
			s.replay(m, "")
			s.replay(m, mine)
		}
		eventually(t, 10*time.Second, func() string { return "A refusing every replayed and redirected request" }, func() bool {
			return refused("replay") >= replays+float64(len(ms)) && refused("seal") >= forged+float64(len(ms))
		})
		if err := s.nc.Flush(); err != nil {
			t.Fatal(err)
		}
		for _, m := range ms {
			if n := s.on(m.Reply); n != 1 {
				t.Fatalf("%s was answered %d times, want once", m.Subject, n)
			}
			op := m.Subject[strings.LastIndexByte(m.Subject, '.')+1:]
			a.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="cluster: request refused" subject=nexus\.broker\.b\.a\.`+op+` error="replayed`), 5*time.Second)
		}
	}

	id := a.claim(brokerclient.ClaimRequest{}).LeaseID
	conn := dialVia(t, b, id, brokerclient.DialOptions{Token: "alice-token"})
	if got := say(t, conn, "first"); got != "echo #1: first" {
		t.Fatalf("through B: %q", got)
	}
	send := s.last(".a.send")
	if st, body := b.do("POST", "/ticket/"+id, ""); st != 200 {
		t.Fatalf("ticket through B = %d %s", st, body)
	}
	ticket := s.last(".a.ticket")
	outstanding := a.metrics()["nexus_broker_tickets_outstanding"]
	replayAll(send, ticket)
	// The replayed client frame was not delivered: the next answer is the
	// instance's second turn, and it answers the new text.
	if got := say(t, conn, "second"); !strings.HasPrefix(got, "echo #2: second") {
		t.Fatalf("after the replayed frame the lease answered %q, want echo #2: second", got)
	}
	if n := a.metrics()["nexus_broker_tickets_outstanding"]; n > outstanding {
		t.Fatalf("tickets outstanding on A went from %v to %v: a replayed ticket request minted one", outstanding, n)
	}

	other := a.claim(brokerclient.ClaimRequest{}).LeaseID
	if st, body := b.do("POST", "/release/"+id, ""); st != 200 {
		t.Fatalf("release through B = %d %s", st, body)
	}
	replayAll(s.last(".a.release"))
	if st := a.leaseStates()[other]; st != "active" {
		t.Fatalf("A's other lease is %q after the replayed release, want active", st)
	}
	if m, err := stolen.NextMsg(100 * time.Millisecond); err == nil {
		t.Fatalf("the attacker's reply subject got an answer: %s", m.Data)
	}
	if strings.Contains(a.GatewayLog.String(), clusterSecret) {
		t.Fatal("the cluster secret is in A's log")
	}
}
