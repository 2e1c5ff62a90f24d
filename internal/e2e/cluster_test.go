package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/a2aproject/a2a-go/v2/a2a"
	natsserver "github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/nexus-broker/nexus-broker/internal/sockdir"
	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc"
)

// clusterAuthYAML: alice is an operator (the harness reads /metrics as
// her), bob is not.
const clusterAuthYAML = "auth:\n  validators:\n    - type: static\n      tokens:\n        - {token: alice-token, principal: alice, scopes: nexus.broker.admin}\n        - {token: bob-token, principal: bob}\n"

const (
	clusterSecretEnv = "NEXUS_CLUSTER_SECRET"
	clusterSecret    = "e2e-cluster-secret-0123456789abcdef"
)

// startNATS runs an embedded nats-server on loopback port (0: any) until
// the test ends.
func startNATS(t testing.TB, port int, tweak func(*natsserver.Options)) *natsserver.Server {
	t.Helper()
	if port == 0 {
		port = freePort(t)
	}
	o := &natsserver.Options{Host: "127.0.0.1", Port: port, NoLog: true, NoSigs: true}
	if tweak != nil {
		tweak(o)
	}
	s, err := natsserver.NewServer(o)
	if err != nil {
		t.Fatal(err)
	}
	go s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats-server did not become ready")
	}
	t.Cleanup(s.Shutdown)
	return s
}

// clusterYAML is broker id's cluster configuration against natsURL.
func clusterYAML(id, natsURL string) string {
	return clusterYAMLEvery(id, natsURL, "100ms")
}

// clusterYAMLEvery is clusterYAML with its own heartbeat interval; the
// cluster: block stays open for more keys.
func clusterYAMLEvery(id, natsURL, every string) string {
	return fmt.Sprintf("broker_id: %s\ncluster:\n  urls: %s\n  secret_env: %s\n  heartbeat_interval: %s\n", id, natsURL, clusterSecretEnv, every)
}

// member is how broker id joins a cluster: its cluster: block (and top
// keys before it) and what its gateway's environment adds.
type member func(id string) (yaml string, env []string)

// openMember joins the open NATS account at natsURL.
func openMember(natsURL string) member {
	return func(id string) (string, []string) { return clusterYAML(id, natsURL), nil }
}

// startCluster runs an embedded nats-server and one broker pair per id,
// and waits until every broker hears every other.
func startCluster(t testing.TB, extraYAML string, token string, ids ...string) (*natsserver.Server, map[string]*Broker) {
	t.Helper()
	ns := startNATS(t, 0, nil)
	return ns, startClusterOn(t, ns, extraYAML, token, ids...)
}

// startClusterOn is startCluster on a nats-server of the test's own.
func startClusterOn(t testing.TB, ns *natsserver.Server, extraYAML string, token string, ids ...string) map[string]*Broker {
	t.Helper()
	return startMembers(t, openMember(ns.ClientURL()), Options{YAML: extraYAML, Token: token}, ids...)
}

// startMembers starts one broker pair per id, joined as join says, with
// o's YAML, token and binaries, and waits until every broker hears every
// other.
func startMembers(t testing.TB, join member, o Options, ids ...string) map[string]*Broker {
	t.Helper()
	bs := map[string]*Broker{}
	for _, id := range ids {
		yaml, env := join(id)
		bs[id] = startBroker(t, Options{YAML: yaml + o.YAML, StateDir: true, Advertise: true, Token: o.Token, BinDir: o.BinDir, NoNexusEntry: o.NoNexusEntry,
			GatewayEnv: append([]string{clusterSecretEnv + "=" + clusterSecret}, env...)})
	}
	for _, b := range bs {
		b.waitPeers(len(ids) - 1)
	}
	return bs
}

// waitPeers waits for GET /metrics to count n reachable peers.
func (b *Broker) waitPeers(n int) {
	b.t.Helper()
	eventually(b.t, 20*time.Second, func() string { return fmt.Sprintf("peers reachable of %s", b.Base) }, func() bool {
		return b.metrics()["nexus_broker_cluster_peers_reachable"] == float64(n)
	})
}

// wsVia is the lease's WebSocket URL on broker b.
func wsVia(b *Broker, leaseID string) string { return "ws://" + b.Addr + "/lease/" + leaseID }

func dialVia(t *testing.T, b *Broker, leaseID string, o brokerclient.DialOptions) *brokerclient.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := brokerclient.Dial(ctx, wsVia(b, leaseID), o)
	if err != nil {
		t.Fatalf("dial %s: %v", wsVia(b, leaseID), err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// turnFrames sends text and reads frames until its answer settles,
// keeping every frame's encoding by seq.
func turnFrames(t *testing.T, conn *brokerclient.Conn, text string, into map[uint64]string) {
	t.Helper()
	if err := conn.Send(brokerframe.IO{Type: brokerframe.IOInput, Content: text}); err != nil {
		t.Fatal(err)
	}
	_ = conn.Underlying().SetReadDeadline(time.Now().Add(30 * time.Second))
	ended := false
	for {
		_, data, err := conn.Underlying().ReadMessage()
		if err != nil {
			t.Fatalf("reading the answer to %q: %v", text, err)
		}
		f, err := brokerframe.Decode(data)
		if err != nil {
			t.Fatal(err)
		}
		into[f.Seq] = string(data)
		if f.Seq > conn.LastSeq {
			conn.LastSeq = f.Seq
		}
		ended = ended || strings.Contains(string(f.Payload), `"stream.end"`)
		if st, ok := statusOf(f); ok && st == brokerframe.StateIdle && ended {
			return
		}
	}
}

func statusOf(f brokerframe.Frame) (string, bool) {
	var p struct{ Type, State string }
	if f.Signal != brokerframe.SignalIO || json.Unmarshal(f.Payload, &p) != nil || p.Type != brokerframe.IOStatus {
		return "", false
	}
	return p.State, true
}

// deltas joins the stream.delta contents of frames in seq order.
func deltas(frames map[uint64]string, first, last uint64) string {
	var b strings.Builder
	for seq := first; seq <= last; seq++ {
		var p struct{ Type, Content string }
		if f, err := brokerframe.Decode([]byte(frames[seq])); err == nil && json.Unmarshal(f.Payload, &p) == nil && p.Type == "stream.delta" {
			b.WriteString(p.Content)
		}
	}
	return b.String()
}

// TestClusterClaimOnAStreamViaBReleaseViaC: a lease claimed on A is
// streamed whole and in order through B, replayed exactly by A from
// from_seq, released through C.
func TestClusterClaimOnAStreamViaBReleaseViaC(t *testing.T) {
	_, bs := startCluster(t, "", "", "a", "b", "c")
	a, b, c := bs["a"], bs["b"], bs["c"]
	claim := a.claim(brokerclient.ClaimRequest{})
	if !strings.HasSuffix(claim.LeaseID, "-a") || !regexp.MustCompile(`^[0-9a-f]{32}-a$`).MatchString(claim.LeaseID) {
		t.Fatalf("lease id %q does not name its owner a", claim.LeaseID)
	}
	viaB := dialVia(t, b, claim.LeaseID, brokerclient.DialOptions{})
	frames := map[uint64]string{}
	for _, text := range []string{"one", "two", "three"} {
		turnFrames(t, viaB, text, frames)
	}
	first := viaB.LastSeq
	for seq := range frames {
		first = min(first, seq)
	}
	for seq := first; seq <= viaB.LastSeq; seq++ {
		if _, ok := frames[seq]; !ok {
			t.Fatalf("through B the stream has no frame %d of %d..%d", seq, first, viaB.LastSeq)
		}
	}
	if text := deltas(frames, first, viaB.LastSeq); !strings.HasPrefix(text, "echo #1: one") || !strings.Contains(text, "echo #2: two") || !strings.Contains(text, "echo #3: three") {
		t.Fatalf("through B the answers read %q", text)
	}
	viaB.Close()

	zero := uint64(0)
	onA := dialVia(t, a, claim.LeaseID, brokerclient.DialOptions{FromSeq: &zero})
	_ = onA.Underlying().SetReadDeadline(time.Now().Add(20 * time.Second))
	for seq := uint64(1); seq <= viaB.LastSeq; seq++ {
		_, data, err := onA.Underlying().ReadMessage()
		if err != nil {
			t.Fatalf("replay on A: %v", err)
		}
		if seq >= first && string(data) != frames[seq] {
			t.Fatalf("replayed frame %d on A:\n%s\nthrough B it was:\n%s", seq, data, frames[seq])
		}
	}

	if st, body := c.do("POST", "/release/"+claim.LeaseID, ""); st != 200 || strings.TrimSpace(body) != fmt.Sprintf(`{"lease_id":%q,"status":"released"}`, claim.LeaseID) {
		t.Fatalf("release through C = %d %s", st, body)
	}
	if code, text := closeCode(t, onA); code != 1001 || text != "lease closed" {
		t.Fatalf("A's client closed with %d %q, want 1001 lease closed", code, text)
	}
	if st, body := b.do("POST", "/release/"+claim.LeaseID, ""); st != 404 || strings.TrimSpace(body) != `{"error":"unknown lease"}` {
		t.Fatalf("second release through B = %d %s", st, body)
	}
}

// TestClusterLeasesOwnerLossAndReturn: GET /leases on any broker lists
// every broker's leases; C killed with -9 is named unreachable, its leases
// answer 503 through A and B and nothing of it is adopted; C restarted on
// its state_dir serves them again through A.
func TestClusterLeasesOwnerLossAndReturn(t *testing.T) {
	_, bs := startCluster(t, "", "", "a", "b", "c")
	claims := map[string]string{}
	for id, b := range bs {
		claims[id] = b.claim(brokerclient.ClaimRequest{}).LeaseID
	}
	type view struct {
		SlotsInUse int `json:"slots_in_use"`
		Leases     []struct {
			LeaseID string `json:"lease_id"`
		}
		UnreachableBrokers []string `json:"unreachable_brokers"`
	}
	list := func(b *Broker) view {
		st, body := b.get("/leases")
		var v view
		if st != 200 || json.Unmarshal([]byte(body), &v) != nil {
			t.Fatalf("GET /leases = %d %s", st, body)
		}
		return v
	}
	ids := func(v view) string {
		var out []string
		for _, l := range v.Leases {
			out = append(out, l.LeaseID)
		}
		return strings.Join(out, ",")
	}
	for id, b := range bs {
		v := list(b)
		if len(v.Leases) != 3 || v.SlotsInUse != 3 || v.UnreachableBrokers == nil || len(v.UnreachableBrokers) != 0 {
			t.Fatalf("GET /leases on %s: %+v, want all three leases, 3 slots, no unreachable broker", id, v)
		}
	}

	relayed := dialVia(t, bs["a"], claims["c"], brokerclient.DialOptions{})
	c := bs["c"]
	c.KillGateway(syscall.SIGKILL)
	c.KillSpawnd(syscall.SIGKILL)
	if code, text := closeCode(t, relayed); code != 1013 || text != "lease owner unavailable" {
		t.Fatalf("a socket relayed through A to C's lease closed with %d %q when C died, want 1013 lease owner unavailable", code, text)
	}
	for _, id := range []string{"a", "b"} {
		b := bs[id]
		b.waitPeers(1)
		v := list(b)
		if len(v.Leases) != 2 || strings.Contains(ids(v), claims["c"]) || fmt.Sprint(v.UnreachableBrokers) != "[c]" {
			t.Fatalf("GET /leases on %s with C down: leases %s, unreachable %v; want A's and B's, and c", id, ids(v), v.UnreachableBrokers)
		}
		if st, body := b.do("POST", "/release/"+claims["c"], ""); st != 503 || strings.TrimSpace(body) != `{"error":"lease owner unavailable"}` {
			t.Fatalf("release of C's lease through %s = %d %s", id, st, body)
		}
		if st, body := b.do("POST", "/ticket/"+claims["c"], ""); st != 503 || strings.TrimSpace(body) != `{"error":"lease owner unavailable"}` {
			t.Fatalf("ticket for C's lease through %s = %d %s", id, st, body)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, err := brokerclient.Dial(ctx, wsVia(b, claims["c"]), brokerclient.DialOptions{})
		cancel()
		var api *brokerclient.APIError
		if !errors.As(err, &api) || api.Status != 503 || api.Message != "lease owner unavailable" {
			t.Fatalf("WS to C's lease through %s: %v, want 503 lease owner unavailable", id, err)
		}
	}
	// An id naming a broker the cluster never saw is an ordinary unknown lease.
	if st, body := bs["a"].do("POST", "/release/0123456789abcdef0123456789abcdef-zz", ""); st != 404 || strings.TrimSpace(body) != `{"error":"unknown lease"}` {
		t.Fatalf("release of a lease of an unknown broker = %d %s", st, body)
	}

	c.StartSpawnd()
	c.StartGateway(clusterSecretEnv + "=" + clusterSecret)
	bs["a"].waitPeers(2)
	eventually(t, 30*time.Second, func() string { return "C's lease active again" }, func() bool {
		return c.leaseStates()[claims["c"]] == "active"
	})
	conn := dialVia(t, bs["a"], claims["c"], brokerclient.DialOptions{})
	if got := say(t, conn, "back"); !strings.HasSuffix(got, ": back") {
		t.Fatalf("C's lease through A after C's restart answered %q", got)
	}
	if st, body := bs["a"].do("POST", "/release/"+claims["c"], ""); st != 200 {
		t.Fatalf("release of C's lease through A after its restart = %d %s", st, body)
	}
}

// TestClusterOwnershipThroughAnyBroker: another principal's lease is the
// same 404 through a non-owner as on the owner; a ticket minted through one
// broker opens the lease through another, and a newer connection through
// any broker displaces the older one with 4501.
func TestClusterOwnershipThroughAnyBroker(t *testing.T) {
	_, bs := startCluster(t, clusterAuthYAML, "alice-token", "a", "b", "c")
	a, b, c := bs["a"], bs["b"], bs["c"]
	id := a.claim(brokerclient.ClaimRequest{}).LeaseID
	for _, route := range []string{"/release/", "/ticket/"} {
		stA, bodyA := a.doAs("bob-token", "POST", route+id, "")
		stB, bodyB := b.doAs("bob-token", "POST", route+id, "")
		if stA != 404 || stA != stB || bodyA != bodyB {
			t.Fatalf("bob's POST %s on the owner = %d %q, through B = %d %q; want the same 404", route, stA, bodyA, stB, bodyB)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := brokerclient.Dial(ctx, wsVia(b, id), brokerclient.DialOptions{Token: "bob-token"})
	var api *brokerclient.APIError
	if !errors.As(err, &api) || api.Status != 404 || api.Message != "unknown lease" {
		t.Fatalf("bob's WS through B: %v, want 404 unknown lease", err)
	}

	st, body := b.do("POST", "/ticket/"+id, "")
	var tk struct{ Ticket string }
	if st != 200 || json.Unmarshal([]byte(body), &tk) != nil || tk.Ticket == "" {
		t.Fatalf("ticket through B = %d %s", st, body)
	}
	viaC := dialVia(t, c, id, brokerclient.DialOptions{Ticket: tk.Ticket})
	if got := say(t, viaC, "ticketed"); got != "echo #1: ticketed" {
		t.Fatalf("through C with a ticket minted through B: %q", got)
	}
	viaB := dialVia(t, b, id, brokerclient.DialOptions{Token: "alice-token"})
	if code, text := closeCode(t, viaC); code != 4501 || text != "superseded by a newer client connection" {
		t.Fatalf("the displaced connection through C closed with %d %q, want 4501", code, text)
	}
	if got := say(t, viaB, "newest"); !strings.HasPrefix(got, "echo #2: newest") {
		t.Fatalf("through B after displacing C: %q", got)
	}
	onA := dialVia(t, a, id, brokerclient.DialOptions{Token: "alice-token"})
	if code, _ := closeCode(t, viaB); code != 4501 {
		t.Fatalf("the relayed connection through B closed with %d when A's took over, want 4501", code)
	}
	onA.Close()
}

// TestClusterRefusesUnsignedRequests: a NATS client without the cluster
// secret gets no answer from a broker's subjects, and nothing is done.
func TestClusterRefusesUnsignedRequests(t *testing.T) {
	ns, bs := startCluster(t, "", "", "a")
	a := bs["a"]
	id := a.claim(brokerclient.ClaimRequest{}).LeaseID
	nc, err := nats.Connect(ns.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	forged := fmt.Sprintf(`{"from":"x","at":%d,"body":{"lease":%q,"principal":{}}}`, time.Now().UnixNano(), id)
	for _, sig := range []string{"", strings.Repeat("0", 64)} {
		msg := nats.NewMsg("nexus.broker.b.a.release")
		msg.Data = []byte(forged)
		msg.Header = nats.Header{}
		if sig != "" {
			msg.Header.Set("Nexus-Sig", sig)
		}
		if _, err := nc.RequestMsg(msg, time.Second); !errors.Is(err, nats.ErrTimeout) {
			t.Fatalf("a forged release (signature %q) got %v, want no answer", sig, err)
		}
	}
	a.GatewayLog.wait(t, regexp.MustCompile(`cluster: request refused.*not sealed with the cluster secret`), 5*time.Second)
	if a.leaseStates()[id] != "active" {
		t.Fatalf("the lease is %q after forged releases, want active", a.leaseStates()[id])
	}
}

// TestClusterNATSLossIsVisibleAndRecovers: a broker whose NATS goes away
// keeps serving its own leases; after three failed attempts /readyz is 503
// with an ERROR line and the gauge, and it recovers when NATS is back.
func TestClusterNATSLossIsVisibleAndRecovers(t *testing.T) {
	ns, bs := startCluster(t, "", "", "a")
	a := bs["a"]
	port := ns.Addr().(interface{ String() string }).String()
	ns.Shutdown()
	a.GatewayLog.wait(t, regexp.MustCompile(`level=ERROR msg="cluster: NATS unreachable`), 30*time.Second)
	if st, body := a.get("/readyz"); st != 503 || !strings.Contains(body, "NATS unreachable") {
		t.Fatalf("GET /readyz with NATS gone = %d %s", st, body)
	}
	if n := a.metrics()["nexus_broker_cluster_nats_failures"]; n < 3 {
		t.Fatalf("nats failures gauge = %v, want at least 3", n)
	}
	claim := a.claim(brokerclient.ClaimRequest{})
	if got := say(t, a.dial(claim, brokerclient.DialOptions{}), "local"); got != "echo #1: local" {
		t.Fatalf("a local lease without NATS answered %q", got)
	}
	_, p, _ := strings.Cut(port, ":")
	var n int
	fmt.Sscan(p, &n)
	startNATS(t, n, nil)
	eventually(t, 30*time.Second, func() string { return "readyz after NATS came back" }, func() bool {
		st, _ := a.get("/readyz")
		return st == 200
	})
}

// TestClusterAuthErrorRefusesTheBoot: NATS refusing the broker's
// credentials is fatal at boot, named, before the port opens.
func TestClusterAuthErrorRefusesTheBoot(t *testing.T) {
	ns := startNATS(t, 0, func(o *natsserver.Options) { o.Authorization = "nats-token" })
	code, out := bootAgainst(t, ns)
	if code == 0 || !strings.Contains(out, "cluster: connecting to NATS") || !strings.Contains(strings.ToLower(out), "authorization violation") {
		t.Fatalf("nexus-broker against a NATS refusing it: exit %d, output:\n%s", code, out)
	}
	if strings.Contains(out, "nexus-broker listening") {
		t.Fatalf("the port opened before the refusal:\n%s", out)
	}
}

// TestClusterTinyMaxPayloadRefusesTheBoot: a NATS server whose max_payload
// cannot hold a chunk is a configuration error, named at boot.
func TestClusterTinyMaxPayloadRefusesTheBoot(t *testing.T) {
	ns := startNATS(t, 0, func(o *natsserver.Options) { o.MaxPayload = 512 })
	code, out := bootAgainst(t, ns)
	if code == 0 || !strings.Contains(out, "max_payload is 512 bytes; cluster mode needs at least 1024") || strings.Contains(out, "nexus-broker listening") {
		t.Fatalf("nexus-broker against a NATS with a 512-byte max_payload: exit %d, output:\n%s", code, out)
	}
}

// bootAgainst runs a cluster-mode nexus-broker against ns until it exits
// (it is expected to refuse the boot) and returns its exit code and output.
func bootAgainst(t *testing.T, ns *natsserver.Server) (int, string) {
	t.Helper()
	return bootAs(t, openMember(ns.ClientURL()))
}

// bootAs is bootAgainst joining as join says, as broker a.
func bootAs(t *testing.T, join member) (int, string) {
	t.Helper()
	dir := t.TempDir()
	run := filepath.Join(sockdir.New(t, "nxc"), "run")
	yaml := fmt.Sprintf("listen_addr: \"127.0.0.1:%d\"\nadvertise_addr: \"127.0.0.1:1\"\nstate_dir: %q\nspawnd:\n  run_dir: %q\nbinaries:\n  nexus:\n    path: %q\n",
		freePort(t), filepath.Join(dir, "state"), run, bin("nexus-echo"))
	member, env := join("a")
	cfg := writeConfig(t, dir, yaml+member)
	t.Cleanup(func() {
		if ep, err := spawnrpc.ReadEndpoint(run); err == nil {
			_ = syscall.Kill(ep.Pid, syscall.SIGKILL)
		}
	})
	return runToExit(t, append([]string{clusterSecretEnv + "=" + clusterSecret, "TMPDIR=" + privateTmp(t)}, env...), "nexus-broker", "-config", cfg)
}

// TestClusterClaimSpillsToAPeerWithAFreeSlot: with A full, a claim on A is
// spawned by exactly one of B and C and answers through A; with every
// broker full it waits in A's own queue and times out there.
func TestClusterClaimSpillsToAPeerWithAFreeSlot(t *testing.T) {
	_, bs := startCluster(t, "max_concurrent: 1\nqueue_wait_timeout: 1s\n", "", "a", "b", "c")
	a := bs["a"]
	a.claim(brokerclient.ClaimRequest{})
	spilled := a.claim(brokerclient.ClaimRequest{})
	owner := spilled.LeaseID[strings.LastIndexByte(spilled.LeaseID, '-')+1:]
	if owner != "b" && owner != "c" {
		t.Fatalf("the claim on a full A is owned by %q, want b or c", owner)
	}
	if n := len(bs["b"].Instances()) + len(bs["c"].Instances()); n != 1 || len(bs[owner].Instances()) != 1 {
		t.Fatalf("B and C run %d instances (%s: %d), want exactly one, on %s", n, owner, len(bs[owner].Instances()), owner)
	}
	conn := dialVia(t, a, spilled.LeaseID, brokerclient.DialOptions{})
	if got := say(t, conn, "spilled"); got != "echo #1: spilled" {
		t.Fatalf("the spilled lease through A answered %q", got)
	}
	a.claim(brokerclient.ClaimRequest{}) // the last free slot, wherever it is
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := a.Client.Claim(ctx, brokerclient.ClaimRequest{Config: "engine:\n  name: example\n"})
	var api *brokerclient.APIError
	if !errors.As(err, &api) || api.Status != 503 || api.Message != "capacity wait timed out" {
		t.Fatalf("a claim with the whole cluster full: %v, want 503 capacity wait timed out", err)
	}
	if n := len(a.Instances()) + len(bs["b"].Instances()) + len(bs["c"].Instances()); n != 3 {
		t.Fatalf("%d instances run across the cluster, want 3", n)
	}
}

// TestClusterPrincipalCapCountsEveryBroker: max_leases_per_principal counts
// the principal's leases on every broker.
func TestClusterPrincipalCapCountsEveryBroker(t *testing.T) {
	_, bs := startCluster(t, clusterAuthYAML+"max_leases_per_principal: 2\n", "alice-token", "a", "b", "c")
	bs["a"].claim(brokerclient.ClaimRequest{})
	bs["b"].claim(brokerclient.ClaimRequest{})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := bs["c"].Client.Claim(ctx, brokerclient.ClaimRequest{Config: "engine:\n  name: example\n"})
	var api *brokerclient.APIError
	if !errors.As(err, &api) || api.Status != 429 || api.Message != "lease limit reached for this principal" {
		t.Fatalf("alice's third claim, on C, with one lease on A and one on B: %v, want 429", err)
	}
	if _, err := bs["c"].Client.Claim(ctx, brokerclient.ClaimRequest{Config: "engine:\n  name: example\n"}); err == nil {
		t.Fatal("a fourth claim was admitted")
	}
}

// TestClusterA2AContextContinuesOnAnotherBroker: a conversation started
// through A continues through B, on A's session; a new one started
// through B belongs to B.
func TestClusterA2AContextContinuesOnAnotherBroker(t *testing.T) {
	bs := a2aCluster(t, "", "", "a", "b")
	for _, binding := range bindings {
		t.Run(string(binding), func(t *testing.T) {
			conv := "cluster-" + string(binding)
			first := sendTask(t, a2aClient(t, bs["a"], "support", binding), userMsg(conv, "hello"))
			if got := answerOf(t, first); got != "echo #1: hello" {
				t.Fatalf("through A: %q", got)
			}
			second := sendTask(t, a2aClient(t, bs["b"], "support", binding), userMsg(conv, "again"))
			if got := answerOf(t, second); got != "echo #2: again (earlier: hello)" {
				t.Fatalf("through B the conversation answered %q, not on A's session", got)
			}
			if len(bs["b"].Instances()) != 0 {
				t.Fatalf("B spawned an instance for A's conversation")
			}
		})
	}
	fresh := sendTask(t, a2aClient(t, bs["b"], "support", a2a.TransportProtocolJSONRPC), userMsg("born-on-b", "new"))
	if got := answerOf(t, fresh); got != "echo #1: new" || len(bs["b"].Instances()) != 1 {
		t.Fatalf("a new conversation through B answered %q with %d instances on B", got, len(bs["b"].Instances()))
	}
}

// TestClusterChunksWhatExceedsMaxPayload: with a NATS max_payload of
// 4 KiB, a claim body larger than that still spills from a full broker to
// a peer, and 64 KiB messages pass both ways through a non-owner, in
// order, none lost.
func TestClusterChunksWhatExceedsMaxPayload(t *testing.T) {
	ns := startNATS(t, 0, func(o *natsserver.Options) { o.MaxPayload = 4 << 10 })
	// 64 KiB inputs: nexus-echo reads frames larger than max_client_frame's default.
	bs := startClusterOn(t, ns, "max_concurrent: 1\nqueue_wait_timeout: 1s\nmax_client_frame: 131072\n", "", "a", "b")
	a, b := bs["a"], bs["b"]
	a.GatewayLog.wait(t, regexp.MustCompile(`max_payload=4096`), 5*time.Second)
	first := a.claim(brokerclient.ClaimRequest{})
	big := "engine:\n  name: example\n" + strings.Repeat("# padding the claim past one NATS message\n", 400)
	spilled := a.claim(brokerclient.ClaimRequest{Config: big})
	if !strings.HasSuffix(spilled.LeaseID, "-b") {
		t.Fatalf("a %d-byte claim on a full A went to %q, want b", len(big), spilled.LeaseID)
	}

	conn := dialVia(t, b, first.LeaseID, brokerclient.DialOptions{})
	var texts []string
	for i := range 3 {
		text := strings.Repeat(fmt.Sprintf("%d123456789", i), 64<<10/10)
		texts = append(texts, text)
		if err := conn.Send(brokerframe.IO{Type: brokerframe.IOInput, Content: text}); err != nil {
			t.Fatal(err)
		}
	}
	_ = conn.Underlying().SetReadDeadline(time.Now().Add(60 * time.Second))
	for i, text := range texts {
		got, err := conn.Answer()
		if want := fmt.Sprintf("echo #%d: %s", i+1, text); err != nil || !strings.HasPrefix(got, want) {
			t.Fatalf("answer %d through B: %d bytes starting %.40q, %v; want %d bytes starting %.40q", i+1, len(got), got, err, len(want), want)
		}
	}
}
