package e2e

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

const natsPasswordEnv = "NEXUS_NATS_PASSWORD"

// brokerPermissions are the NATS permissions docs/cluster.md grants broker
// id: its own request subjects and its own inbox, nobody else's.
func brokerPermissions(id string) *natsserver.Permissions {
	return &natsserver.Permissions{
		Publish:   &natsserver.SubjectPermission{Allow: []string{"nexus.broker.hb", "nexus.broker.b.*.*", "_INBOX.>"}},
		Subscribe: &natsserver.SubjectPermission{Allow: []string{"nexus.broker.hb", "nexus.broker.b." + id + ".*", "_INBOX." + id + ".>"}},
	}
}

// permittedNATS is a nats-server whose account has one user per broker id
// (named after it, with the permissions above) and a user "spy" allowed
// everything: another client of the same account, without the cluster
// secret.
func permittedNATS(t *testing.T, ids ...string) *natsserver.Server {
	t.Helper()
	return startNATS(t, 0, func(o *natsserver.Options) {
		o.Users = []*natsserver.User{{Username: "spy", Password: "spy-pw"}}
		for _, id := range ids {
			o.Users = append(o.Users, &natsserver.User{Username: id, Password: "pw-" + id, Permissions: brokerPermissions(id)})
		}
	})
}

// permittedMember joins as the NATS user of the broker's id, its password
// in the environment (cluster.user, cluster.password_env).
func permittedMember(ns *natsserver.Server) member {
	return func(id string) (string, []string) {
		return clusterYAML(id, ns.ClientURL()) + "  user: " + id + "\n  password_env: " + natsPasswordEnv + "\n", []string{natsPasswordEnv + "=pw-" + id}
	}
}

// wire is everything a NATS client sees of a message: subject, reply
// subject, headers and data.
func wire(m *nats.Msg) []byte {
	var b bytes.Buffer
	b.WriteString(m.Subject + " " + m.Reply + " ")
	for k, vs := range m.Header {
		b.WriteString(k + ": " + strings.Join(vs, ",") + " ")
	}
	b.Write(m.Data)
	return b.Bytes()
}

// TestClusterSealedTrafficTellsASpyNothing acts as a NATS client of the
// brokers' account that does not hold the cluster secret, subscribed to
// every subject, while brokers that each hold only their own permissions
// spill a claim, mint a ticket through a non-owner, relay a stream opened
// with that ticket through a third broker, and release through a
// non-owner. No subject, header or body it sees holds the ticket, the
// bearer token, the principal, the claim's config or a frame's payload;
// sending every captured request again, verbatim or to its own inbox, or
// every captured answer again, gets it no answer and changes nothing: each
// is refused, counted, by the broker it reaches.
func TestClusterSealedTrafficTellsASpyNothing(t *testing.T) {
	ids := []string{"a", "b", "c"}
	ns := permittedNATS(t, ids...)
	bs := startMembers(t, permittedMember(ns), Options{YAML: clusterAuthYAML + "max_concurrent: 1\nqueue_wait_timeout: 1s\n", Token: "alice-token"}, ids...)
	s := newSpyAs(t, ns, []nats.Option{nats.UserInfo("spy", "spy-pw")}, ">")
	a := bs["a"]

	const configCanary = "config-canary-7f3e"
	const frameCanary = "frame-canary-91ab"
	a.claim(brokerclient.ClaimRequest{})
	spilled := a.claim(brokerclient.ClaimRequest{Config: "engine:\n  name: example\n# " + configCanary + "\n"})
	owner := spilled.LeaseID[strings.LastIndexByte(spilled.LeaseID, '-')+1:]
	third := map[string]string{"b": "c", "c": "b"}[owner]
	if third == "" {
		t.Fatalf("the claim on a full A is owned by %q, want b or c", owner)
	}
	st, body := a.do("POST", "/ticket/"+spilled.LeaseID, "")
	var tk struct{ Ticket string }
	if st != 200 || json.Unmarshal([]byte(body), &tk) != nil || tk.Ticket == "" {
		t.Fatalf("ticket through A = %d %s", st, body)
	}
	conn := dialVia(t, bs[third], spilled.LeaseID, brokerclient.DialOptions{Ticket: tk.Ticket})
	if got := say(t, conn, frameCanary); got != "echo #1: "+frameCanary {
		t.Fatalf("through %s with the ticket: %q", third, got)
	}
	conn.Close()
	if st, body := a.do("POST", "/release/"+spilled.LeaseID, ""); st != 200 {
		t.Fatalf("release through A = %d %s", st, body)
	}

	s.mu.Lock()
	seen := append([]*nats.Msg(nil), s.seen...)
	s.mu.Unlock()
	var requests, replies []*nats.Msg
	ops := map[string]bool{}
	for _, m := range seen {
		w := wire(m)
		for _, secret := range []string{tk.Ticket, "alice-token", "alice", configCanary, frameCanary, spilled.LeaseID} {
			if bytes.Contains(w, []byte(secret)) {
				t.Fatalf("the spy read %q in a message on %s (reply %q)", secret, m.Subject, m.Reply)
			}
		}
		switch {
		case strings.HasPrefix(m.Subject, "nexus.broker.b."):
			requests = append(requests, m)
			ops[m.Subject[strings.LastIndexByte(m.Subject, '.')+1:]] = true
		case strings.HasPrefix(m.Subject, "_INBOX.") && len(m.Data) > 0:
			replies = append(replies, m)
		}
	}
	for _, op := range []string{"claim", "ticket", "attach", "send", "read", "release"} {
		if !ops[op] {
			t.Fatalf("the spy saw no %s request (saw %v): the test did not cross the cluster as meant", op, ops)
		}
	}

	total := func(reason string) float64 {
		n := 0.0
		for _, b := range bs {
			n += b.metrics()[`nexus_broker_cluster_messages_refused_total{reason="`+reason+`"}`]
		}
		return n
	}
	instances := len(bs["a"].Instances()) + len(bs["b"].Instances()) + len(bs["c"].Instances())
	tickets := bs[owner].metrics()["nexus_broker_tickets_outstanding"]
	replays, forged := total("replay"), total("seal")
	mine := "_INBOX.spy.1"
	stolen, err := s.nc.SubscribeSync("_INBOX.spy.>")
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range requests {
		s.replay(m, "")
		s.replay(m, mine)
	}
	for _, m := range replies {
		s.replay(m, "")
	}
	eventually(t, 20*time.Second, func() string { return "every replayed and redirected request, and every replayed answer, refused" }, func() bool {
		return total("replay") >= replays+float64(len(requests)+len(replies)) && total("seal") >= forged+float64(len(requests))
	})
	if m, err := stolen.NextMsg(200 * time.Millisecond); err == nil {
		t.Fatalf("the spy's inbox got an answer: %q", m.Data)
	}
	if n := len(bs["a"].Instances()) + len(bs["b"].Instances()) + len(bs["c"].Instances()); n != instances {
		t.Fatalf("%d instances run after the replays, %d before: a replayed claim spawned", n, instances)
	}
	if n := bs[owner].metrics()["nexus_broker_tickets_outstanding"]; n > tickets {
		t.Fatalf("tickets outstanding on %s went from %v to %v: a replayed ticket request minted one", owner, tickets, n)
	}
}

// TestClusterSecondBrokerWithALiveIDRefusesToBoot: a broker started with
// the id of a live one is refused before its port opens, naming the id and
// the live broker's advertise_addr.
func TestClusterSecondBrokerWithALiveIDRefusesToBoot(t *testing.T) {
	ns, bs := startCluster(t, "", "", "a")
	code, out := bootAgainst(t, ns)
	if code == 0 || !regexp.MustCompile(`broker_id \\?"a\\?" is live: the broker at advertise_addr `+regexp.QuoteMeta(bs["a"].Addr)+` answers for it`).MatchString(out) {
		t.Fatalf("a second broker a: exit %d, output:\n%s", code, out)
	}
	if strings.Contains(out, "nexus-broker listening") {
		t.Fatalf("the port opened before the refusal:\n%s", out)
	}
	if st, _ := bs["a"].get("/readyz"); st != 200 {
		t.Fatalf("the live broker a is unready after the refused twin: %d", st)
	}
}

// pausingProxy is a TCP proxy to upstream that can be frozen: while it
// is, it carries no byte either way (they wait in the kernel's buffers),
// as a proxy under SIGSTOP would.
type pausingProxy struct {
	ln       net.Listener
	upstream string
	mu       sync.Mutex
	cond     *sync.Cond
	frozen   bool
	conns    []net.Conn
}

func startProxy(t *testing.T, upstream string) *pausingProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &pausingProxy{ln: ln, upstream: upstream}
	p.cond = sync.NewCond(&p.mu)
	go p.serve()
	t.Cleanup(func() {
		p.freeze(false)
		ln.Close()
		p.mu.Lock()
		defer p.mu.Unlock()
		for _, c := range p.conns {
			c.Close()
		}
	})
	return p
}

func (p *pausingProxy) url() string { return "nats://" + p.ln.Addr().String() }

func (p *pausingProxy) freeze(on bool) {
	p.mu.Lock()
	p.frozen = on
	p.mu.Unlock()
	p.cond.Broadcast()
}

func (p *pausingProxy) serve() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		u, err := net.Dial("tcp", p.upstream)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, u)
		p.mu.Unlock()
		go p.pipe(u, c)
		go p.pipe(c, u)
	}
}

// pipe copies src to dst, holding each read while the proxy is frozen.
func (p *pausingProxy) pipe(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		p.mu.Lock()
		for p.frozen {
			p.cond.Wait()
		}
		p.mu.Unlock()
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			if tc, ok := dst.(*net.TCPConn); ok && errors.Is(err, io.EOF) {
				_ = tc.CloseWrite()
			} else {
				dst.Close()
			}
			return
		}
	}
}

// TestClusterFrozenLinkIsUnreadyAndLateReleaseIsDropped: B's link to NATS
// frozen (a proxy that stops carrying bytes, TCP still up) makes B's
// /readyz 503 within 3 s while A, which stops hearing B, stays ready; a
// release of A's lease sent through B during the freeze is answered 503,
// and when the link thaws and the buffered request reaches A after its
// deadline, A drops it: the lease is still active.
func TestClusterFrozenLinkIsUnreadyAndLateReleaseIsDropped(t *testing.T) {
	ns := startNATS(t, 0, nil)
	proxy := startProxy(t, ns.Addr().String())
	join := func(id string) (string, []string) {
		url := ns.ClientURL()
		if id == "b" {
			url = proxy.url()
		}
		return clusterYAMLEvery(id, url, "500ms"), nil
	}
	bs := startMembers(t, join, Options{}, "a", "b")
	a, b := bs["a"], bs["b"]
	id := a.claim(brokerclient.ClaimRequest{}).LeaseID
	if st, body := b.get("/readyz"); st != 200 {
		t.Fatalf("B before the freeze: /readyz %d %s", st, body)
	}

	proxy.freeze(true)
	frozenAt := time.Now()
	released := make(chan string, 1)
	go func() {
		st, body := b.do("POST", "/release/"+id, "")
		released <- fmt.Sprintf("%d %s", st, strings.TrimSpace(body))
	}()
	eventually(t, 3*time.Second, func() string { _, body := b.get("/readyz"); return "B's /readyz 503 with its link frozen: " + body }, func() bool {
		st, body := b.get("/readyz")
		return st == 503 && strings.Contains(body, "cluster:")
	})
	t.Logf("B unready %s after the freeze", time.Since(frozenAt).Round(time.Millisecond))
	if st, body := a.get("/readyz"); st != 200 {
		t.Fatalf("A, which only stopped hearing B, is unready: %d %s", st, body)
	}
	if got := <-released; got != `503 {"error":"lease owner unavailable"}` {
		t.Fatalf("the release through B during the freeze answered %s, want 503 lease owner unavailable", got)
	}

	proxy.freeze(false)
	eventually(t, 20*time.Second, func() string { return "A dropping B's late release" }, func() bool {
		return a.metrics()[`nexus_broker_cluster_messages_refused_total{reason="late"}`] >= 1
	})
	a.GatewayLog.wait(t, regexp.MustCompile(`cluster: request refused" subject=nexus\.broker\.b\.a\.release error="late: `), 5*time.Second)
	eventually(t, 20*time.Second, func() string { return "B ready again" }, func() bool { st, _ := b.get("/readyz"); return st == 200 })
	if st := a.leaseStates()[id]; st != "active" {
		t.Fatalf("A's lease is %q after the thaw, want active: the release answered 503 was carried out", st)
	}
}

// TestClusterLeaseWorksThroughABrokerThatHasNotHeardItsOwner: B starts
// after A's only heartbeat (the interval is an hour), so B has never heard
// of A; A's lease still streams, mints a ticket and releases through B, at
// once: B asks A's subjects directly. A lease id naming a broker nobody
// runs stays an ordinary 404.
func TestClusterLeaseWorksThroughABrokerThatHasNotHeardItsOwner(t *testing.T) {
	ns := startNATS(t, 0, nil)
	join := func(id string) (string, []string) { return clusterYAMLEvery(id, ns.ClientURL(), "1h"), nil }
	a := startMembers(t, join, Options{}, "a")["a"]
	id := a.claim(brokerclient.ClaimRequest{}).LeaseID
	b := startMembers(t, join, Options{}, "b")["b"]
	if n := b.metrics()["nexus_broker_cluster_peers_reachable"]; n != 0 {
		t.Fatalf("B hears %v peers; the test needs it to have heard none", n)
	}
	if got := say(t, dialVia(t, b, id, brokerclient.DialOptions{}), "unheard"); got != "echo #1: unheard" {
		t.Fatalf("A's lease through B, which never heard A: %q", got)
	}
	if st, body := b.do("POST", "/ticket/"+id, ""); st != 200 {
		t.Fatalf("ticket through B = %d %s", st, body)
	}
	if st, body := b.do("POST", "/release/0123456789abcdef0123456789abcdef-zz", ""); st != 404 || strings.TrimSpace(body) != `{"error":"unknown lease"}` {
		t.Fatalf("release of a lease of a broker nobody runs = %d %s", st, body)
	}
	if st, body := b.do("POST", "/release/"+id, ""); st != 200 {
		t.Fatalf("release through B = %d %s", st, body)
	}
}

// TestClusterRefusedSubscriptionRefusesTheBoot: a broker whose NATS user
// may not subscribe to its own request subjects (here: broker b's
// permissions) does not run ready but deaf: its boot is refused, naming
// the subject.
func TestClusterRefusedSubscriptionRefusesTheBoot(t *testing.T) {
	ns := permittedNATS(t, "b")
	code, out := bootAs(t, func(id string) (string, []string) {
		return clusterYAML(id, ns.ClientURL()) + "  user: b\n  password_env: " + natsPasswordEnv + "\n", []string{natsPasswordEnv + "=pw-b"}
	})
	if code == 0 || !strings.Contains(out, "NATS refuses this broker's subscription to _INBOX.a.") || strings.Contains(out, "nexus-broker listening") {
		t.Fatalf("broker a with b's NATS permissions: exit %d, output:\n%s", code, out)
	}
}

// TestClusterClaimGoesToAPeerThatSpawnsItsBinary: in a cluster where only
// B has the entry "other", a claim for it on A (which has a free slot) is
// spawned by B and answers through A, never a 400; with B full it is a
// 503, never a 400; an entry no broker has stays A's 400 listing A's.
func TestClusterClaimGoesToAPeerThatSpawnsItsBinary(t *testing.T) {
	ns := startNATS(t, 0, nil)
	join := func(id string) (string, []string) {
		entries := fmt.Sprintf("binaries:\n  nexus:\n    path: %q\n", bin("nexus-echo"))
		if id == "b" {
			entries = fmt.Sprintf("max_concurrent: 1\n%s  other:\n    path: %q\n", entries, bin("nexus-echo"))
		}
		return entries + clusterYAML(id, ns.ClientURL()), nil
	}
	bs := startMembers(t, join, Options{NoNexusEntry: true}, "a", "b")
	a, b := bs["a"], bs["b"]
	eventually(t, 10*time.Second, func() string { return "A hearing B's binaries" }, func() bool {
		st, _ := a.do("POST", "/claim", `{"config":"engine:\n  name: example\n","binary":"other"}`)
		return st != 400
	})
	if n := len(b.Instances()); n != 1 {
		t.Fatalf("B runs %d instances after the claim for its entry through A, want 1", n)
	}
	lease := b.leases().Leases[0].LeaseID
	if got := say(t, dialVia(t, a, lease, brokerclient.DialOptions{}), "other"); got != "echo #1: other" {
		t.Fatalf("B's lease through A: %q", got)
	}
	st, body := a.do("POST", "/claim", `{"config":"engine:\n  name: example\n","binary":"other"}`)
	if st != 503 || !strings.Contains(body, `no broker that spawns binary \"other\" has a free slot`) {
		t.Fatalf("a claim for B's entry with B full = %d %s, want 503", st, body)
	}
	st, body = a.do("POST", "/claim", `{"config":"engine:\n  name: example\n","binary":"nobody"}`)
	if st != 400 || !strings.Contains(body, `unknown binary \"nobody\"; this broker spawns: nexus`) {
		t.Fatalf("a claim for an entry no broker has = %d %s, want 400", st, body)
	}
}
