package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/nexus-broker/nexus-broker/internal/auth/authtest"
	"github.com/nexus-broker/nexus-broker/internal/sockdir"
	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// The static principals of the auth tests: three owners and an operator.
const (
	tokAlice = "tok-alice"
	tokBob   = "tok-bob"
	tokCarol = "tok-carol"
	tokDave  = "tok-dave"
	tokOps   = "tok-ops"
)

const staticAuthYAML = `auth:
  validators:
    - type: static
      tokens:
        - {token: tok-alice, principal: alice, tenant: acme}
        - {token: tok-bob, principal: bob}
        - {token: tok-carol, principal: carol}
        - {token: tok-dave, principal: dave}
        - {token: tok-ops, principal: ops, scopes: "nexus.broker.admin"}
`

// startAuthBroker starts a broker with the static table and extra YAML; the
// harness's own requests carry the operator's token.
func startAuthBroker(t *testing.T, yaml string, o Options) *Broker {
	o.YAML = staticAuthYAML + yaml
	o.Token = tokOps
	return startBroker(t, o)
}

// as is a client of b carrying token.
func (b *Broker) as(token string) *brokerclient.Client {
	return &brokerclient.Client{Base: b.Base, Token: token}
}

func (b *Broker) claimAs(token string) *brokerclient.Claim {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c, err := b.as(token).Claim(ctx, brokerclient.ClaimRequest{Config: "engine:\n  name: example\n"})
	if err != nil {
		b.t.Fatalf("claim as %s: %v", token, err)
	}
	return c
}

// dialErr dials and returns the refusal (nil on success, closing the conn).
func dialErr(c *brokerclient.Claim, o brokerclient.DialOptions) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := brokerclient.Dial(ctx, c.WSURL, o)
	if err == nil {
		conn.Close()
	}
	return err
}

// rawDial returns the status and body of a refused WebSocket handshake.
func rawDial(t *testing.T, wsURL, query, token string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest("GET", strings.Replace(wsURL, "ws://", "http://", 1)+query, nil)
	req.Header.Set("Connection", "Upgrade")
	req.Header.Set("Upgrade", "websocket")
	req.Header.Set("Sec-WebSocket-Version", "13")
	req.Header.Set("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ==")
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	// A connection of its own, as a WebSocket client opens: on a kept-alive
	// connection reused after a refusal, Go's client returned the 101 only
	// when the gateway's peer timeout closed the socket, 45 s on (the
	// gateway answers 101 at once on a reused connection: checked by hand).
	tr := &http.Transport{DisableKeepAlives: true}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusSwitchingProtocols {
		return resp.StatusCode, "" // the body is the WebSocket, open until someone closes it
	}
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

const (
	bodyRequired = `{"error":"authentication required"}` + "\n"
	bodyRejected = `{"error":"credential rejected"}` + "\n"
	bodyUnknown  = `{"error":"unknown lease"}` + "\n"
)

func wantAnswer(t *testing.T, what string, status int, body string, wantStatus int, wantBody string) {
	t.Helper()
	if status != wantStatus || body != wantBody {
		t.Errorf("%s: %d %q, want %d %q", what, status, body, wantStatus, wantBody)
	}
}

// TestAuthEveryRouteNeedsACredential: with an auth: block every route but
// /healthz refuses a missing credential (authentication required) and a bad
// one (credential rejected); /metrics needs the admin scope on top.
func TestAuthEveryRouteNeedsACredential(t *testing.T) {
	b := startAuthBroker(t, "", Options{})
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="client authentication enabled" validators=\[static\]`), time.Second)
	if strings.Contains(b.GatewayLog.String(), "client authentication is DISABLED") {
		t.Error("the no-auth WARN was logged with an auth: block")
	}
	routes := []struct{ method, path string }{
		{"POST", "/claim"}, {"POST", "/release/x"}, {"POST", "/ticket/x"},
		{"GET", "/leases"}, {"GET", "/binaries"}, {"GET", "/metrics"}, {"GET", "/openapi.json"},
		{"GET", "/console"}, {"GET", "/console/events"},
	}
	for _, r := range routes {
		body := ""
		if r.path == "/claim" {
			body = `{"config":"engine:\n  name: example\n"}`
		}
		status, got := b.doAs("", r.method, r.path, body)
		wantAnswer(t, r.method+" "+r.path+" without a credential", status, got, 401, bodyRequired)
		status, got = b.doAs("wrong-token", r.method, r.path, body)
		wantAnswer(t, r.method+" "+r.path+" with a bad token", status, got, 401, bodyRejected)
	}
	status, got := rawDial(t, "ws://"+b.Addr+"/lease/x", "", "")
	wantAnswer(t, "WS /lease without a credential", status, got, 401, bodyRequired)
	status, got = rawDial(t, "ws://"+b.Addr+"/lease/x", "", "wrong-token")
	wantAnswer(t, "WS /lease with a bad token", status, got, 401, bodyRejected)

	if status, _ := b.doAs("", "GET", "/healthz", ""); status != 200 {
		t.Errorf("GET /healthz without a credential = %d, want 200", status)
	}
	status, got = b.doAs(tokAlice, "GET", "/metrics", "")
	wantAnswer(t, "GET /metrics without the admin scope", status, got, 403, `{"error":"insufficient scope"}`+"\n")
	if status, _ := b.doAs(tokAlice, "GET", "/binaries", ""); status != 200 {
		t.Errorf("GET /binaries with a valid token = %d", status)
	}
	m := b.metrics()
	if v := m[`nexus_broker_claims_total{outcome="rejected"}`]; v != 2 {
		t.Errorf(`claims_total{outcome="rejected"} = %v, want 2`, v)
	}
	// Upstream's audit records: one "auth denied" per refusal, one "auth
	// allowed" per authenticated request, and never a token.
	log := b.GatewayLog.String()
	if n := strings.Count(log, `level=WARN msg="auth denied" route=`); n != 2*len(routes)+3 {
		t.Errorf("%d auth denied records, want %d", n, 2*len(routes)+3)
	}
	if !strings.Contains(log, `level=WARN msg="auth denied" route="POST /release/{lease_id}" principal_id="" lease_id=x reason="authentication required" status=401 denial=`) {
		t.Error("a refused release was not audited with its route pattern, lease and reason")
	}
	if !strings.Contains(log, `level=WARN msg="auth denied" route="GET /metrics" principal_id=alice reason="insufficient scope" status=403 denial="no auth.admin_scope" peer=`) {
		t.Error("the 403 was not audited with its route and reason")
	}
	if !strings.Contains(log, `level=INFO msg="auth allowed" route="GET /binaries" principal_id=alice`+"\n") {
		t.Error("the authenticated GET /binaries has no auth allowed record")
	}
	if strings.Contains(log, `msg="auth allowed" route="GET /metrics" principal_id=alice`) {
		t.Error("alice's GET /metrics without the admin scope was recorded as allowed as well as denied")
	}
	for _, tok := range []string{"wrong-token", tokAlice, tokOps} {
		if strings.Contains(log, tok) {
			t.Errorf("the gateway log carries the token %q", tok)
		}
	}
}

// TestAuthCrossPrincipalAttemptsChangeNothing: bob's release, ticket,
// connect and eviction attempts on alice's lease, and the operator's, all get
// the byte-identical 404 of a lease that never existed; alice's instance and
// socket carry on untouched.
func TestAuthCrossPrincipalAttemptsChangeNothing(t *testing.T) {
	b := startAuthBroker(t, "", Options{})
	claim := b.claimAs(tokAlice)
	if claim.Ticket == "" {
		t.Fatal("a claim on an authenticated broker returned no ticket")
	}
	conn := b.dial(claim, brokerclient.DialOptions{Ticket: claim.Ticket})
	if got := say(t, conn, "one"); got != "echo #1: one" {
		t.Fatalf("answer %q", got)
	}
	pids := b.Instances()

	_, never := b.doAs(tokBob, "POST", "/release/0123456789abcdef0123456789abcdef", "")
	if never != bodyUnknown {
		t.Fatalf("unknown lease body %q", never)
	}
	for _, tok := range []string{tokBob, tokOps} {
		status, got := b.doAs(tok, "POST", "/release/"+claim.LeaseID, "")
		wantAnswer(t, tok+" releasing alice's lease", status, got, 404, never)
		status, got = b.doAs(tok, "POST", "/ticket/"+claim.LeaseID, "")
		wantAnswer(t, tok+" minting a ticket for alice's lease", status, got, 404, never)
		status, got = rawDial(t, claim.WSURL, "", tok)
		wantAnswer(t, tok+" connecting to alice's lease", status, got, 404, never)
		status, got = rawDial(t, claim.WSURL, "?from_seq=0", tok)
		wantAnswer(t, tok+" resuming alice's lease", status, got, 404, never)
	}
	// Alice's own mint is logged, never its value.
	if status, got := b.doAs(tokAlice, "POST", "/ticket/"+claim.LeaseID, ""); status != 200 {
		t.Fatalf("alice minting a ticket for her lease: %d %s", status, got)
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`(?m)level=INFO msg="issued lease ticket" route="POST /ticket/\{lease_id\}" lease_id=`+claim.LeaseID+` principal_id=alice issued=true$`), time.Second)
	// Bob's own valid ticket, for his own lease, does not open alice's.
	bobClaim := b.claimAs(tokBob)
	status, got := rawDial(t, claim.WSURL, "?ticket="+bobClaim.Ticket, "")
	wantAnswer(t, "bob's ticket on alice's lease", status, got, 401, bodyRejected)

	// Nothing changed: same process, socket still attached and answering,
	// nobody evicted.
	if after := b.Instances(); len(after) != 2 || !contains(after, pids[0]) {
		t.Fatalf("instances %v, want alice's %v still running", after, pids)
	}
	if got := say(t, conn, "two"); got != "echo #2: two (earlier: one)" {
		t.Fatalf("alice's socket after the attempts: %q", got)
	}
	if v := b.metrics()["nexus_broker_client_evictions_total"]; v != 0 {
		t.Errorf("client_evictions_total = %v, want 0", v)
	}
	if st, ok := b.lease(claim.LeaseID); !ok || st.State != "active" {
		t.Errorf("alice's lease: %+v %v", st, ok)
	}
	// The cross-principal attempts are audited (the lines come through the
	// gateway's stderr, after the answers).
	b.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="lease access denied" route="POST /release/\{lease_id\}" principal_id=.* lease_id=`+claim.LeaseID+` reason="unknown lease or not owned by this principal" peer=`), 5*time.Second)

	// GET /leases is filtered for owners, aggregates absent; the operator
	// sees everything.
	_, view := b.doAs(tokBob, "GET", "/leases", "")
	if strings.Contains(view, claim.LeaseID) || !strings.Contains(view, bobClaim.LeaseID) || strings.Contains(view, "max_concurrent") || strings.Contains(view, "slots_in_use") {
		t.Errorf("bob's GET /leases: %s", view)
	}
	_, view = b.doAs(tokCarol, "GET", "/leases", "")
	if view != `{"leases":[]}`+"\n" {
		t.Errorf("carol's GET /leases: %q", view)
	}
	if v := b.leases(); len(v.Leases) != 2 || v.MaxConcurrent != 8 {
		t.Errorf("the operator's GET /leases: %+v", v)
	}

	// The owner may release.
	if err := b.as(tokAlice).Release(context.Background(), claim.LeaseID); err != nil {
		t.Fatal(err)
	}
	if err := b.as(tokBob).Release(context.Background(), bobClaim.LeaseID); err != nil {
		t.Fatal(err)
	}
	b.waitNoInstances(15 * time.Second)
}

func contains(l []int, v int) bool {
	for _, x := range l {
		if x == v {
			return true
		}
	}
	return false
}

// TestAuthTickets: a claim's ticket works once; a second use, another
// lease's ticket and a bad ticket beside a valid bearer are 401 credential
// rejected; POST /ticket mints a fresh one that reconnects with from_seq;
// the outstanding gauge is exact throughout. (Expiry is held to 30 s in
// internal/auth's TestTickets.)
func TestAuthTickets(t *testing.T) {
	b := startAuthBroker(t, "", Options{})
	gauge := func() float64 { return b.metrics()["nexus_broker_tickets_outstanding"] }
	claim := b.claimAs(tokAlice)
	if g := gauge(); g != 1 {
		t.Errorf("tickets_outstanding after a claim = %v, want 1", g)
	}
	conn := b.dial(claim, brokerclient.DialOptions{Ticket: claim.Ticket})
	if g := gauge(); g != 0 {
		t.Errorf("tickets_outstanding after redeeming = %v, want 0", g)
	}
	if got := say(t, conn, "hi"); got != "echo #1: hi" {
		t.Fatalf("answer %q", got)
	}
	status, got := rawDial(t, claim.WSURL, "?ticket="+claim.Ticket, "")
	wantAnswer(t, "a ticket's second use", status, got, 401, bodyRejected)
	// A ticket wins exclusively: a bad one beside alice's valid bearer is
	// still refused.
	status, got = rawDial(t, claim.WSURL, "?ticket=bogus", tokAlice)
	wantAnswer(t, "a bad ticket with a valid bearer", status, got, 401, bodyRejected)

	other := b.claimAs(tokAlice)
	status, got = rawDial(t, claim.WSURL, "?ticket="+other.Ticket, "")
	wantAnswer(t, "another lease's ticket", status, got, 401, bodyRejected)

	// Reconnect the documented way: a fresh ticket and from_seq.
	fresh, err := b.as(tokAlice).Ticket(context.Background(), claim.LeaseID)
	if err != nil || fresh == "" {
		t.Fatalf("POST /ticket: %q %v", fresh, err)
	}
	if err := b.as(tokAlice).Release(context.Background(), other.LeaseID); err != nil {
		t.Fatal(err)
	}
	if g := gauge(); g != 1 {
		t.Errorf("tickets_outstanding = %v, want 1 (the fresh one; the released lease's are destroyed)", g)
	}
	from := conn.LastSeq
	conn.Close()
	re, err := brokerclient.Dial(context.Background(), claim.WSURL, brokerclient.DialOptions{Ticket: fresh, FromSeq: &from})
	if err != nil {
		t.Fatal(err)
	}
	defer re.Close()
	if got := say(t, re, "again"); got != "echo #2: again (earlier: hi)" {
		t.Fatalf("after the reconnect: %q", got)
	}
	// A bearer on the handshake works without a ticket.
	if err := dialErr(claim, brokerclient.DialOptions{Token: tokAlice}); err != nil {
		t.Errorf("connecting with a bearer: %v", err)
	}
	// Minted tickets die with their lease.
	if _, err := b.as(tokAlice).Ticket(context.Background(), claim.LeaseID); err != nil {
		t.Fatal(err)
	}
	if err := b.as(tokAlice).Release(context.Background(), claim.LeaseID); err != nil {
		t.Fatal(err)
	}
	if g := gauge(); g != 0 {
		t.Errorf("tickets_outstanding after release = %v, want 0", g)
	}
	b.waitNoInstances(15 * time.Second)
}

// TestAuthPerPrincipalCaps: the (N+1)th lease and the (M+1)th queued claim
// of one principal get 429 at once, while other principals are served.
func TestAuthPerPrincipalCaps(t *testing.T) {
	b := startAuthBroker(t, "max_concurrent: 3\nmax_leases_per_principal: 2\nmax_queued_per_principal: 1\nqueue_wait_timeout: 1m\n", Options{})
	ctx := context.Background()
	a1, a2 := b.claimAs(tokAlice), b.claimAs(tokAlice)
	// A slot is free, and alice is still refused: a quota, not capacity.
	_, err := b.as(tokAlice).Claim(ctx, brokerclient.ClaimRequest{Config: "engine: {}\n"})
	var api *brokerclient.APIError
	if !errors.As(err, &api) || api.Status != 429 || api.Message != "lease limit reached for this principal" {
		t.Fatalf("alice's third lease: %v", err)
	}
	b.claimAs(tokBob) // the last slot

	// Carol parks one claim; her second is refused; dave still parks.
	type result struct {
		c   *brokerclient.Claim
		err error
	}
	park := func(tok string) chan result {
		ch := make(chan result, 1)
		go func() {
			c, err := b.as(tok).Claim(ctx, brokerclient.ClaimRequest{Config: "engine: {}\n"})
			ch <- result{c, err}
		}()
		return ch
	}
	carol := park(tokCarol)
	b.waitQueueDepth(1, 10*time.Second)
	_, err = b.as(tokCarol).Claim(ctx, brokerclient.ClaimRequest{Config: "engine: {}\n"})
	if !errors.As(err, &api) || api.Status != 429 || api.Message != "queued claim limit reached for this principal" {
		t.Fatalf("carol's second queued claim: %v", err)
	}
	dave := park(tokDave)
	b.waitQueueDepth(2, 10*time.Second)

	// Freed slots go to the parked claims in order.
	for _, c := range []*brokerclient.Claim{a1, a2} {
		if err := b.as(tokAlice).Release(ctx, c.LeaseID); err != nil {
			t.Fatal(err)
		}
	}
	for name, ch := range map[string]chan result{"carol": carol, "dave": dave} {
		if r := <-ch; r.err != nil {
			t.Errorf("%s's parked claim: %v", name, r.err)
		}
	}
	m := b.metrics()
	if m[`nexus_broker_claims_total{outcome="principal_lease_limit"}`] != 1 || m[`nexus_broker_claims_total{outcome="principal_queue_limit"}`] != 1 {
		t.Errorf("claims_total: lease limit %v, queue limit %v", m[`nexus_broker_claims_total{outcome="principal_lease_limit"}`], m[`nexus_broker_claims_total{outcome="principal_queue_limit"}`])
	}
	refused := `msg="request refused" route="POST /claim" principal_id=\S+ status=429`
	b.GatewayLog.wait(t, regexp.MustCompile(`(?s)`+refused+`.*`+refused), 5*time.Second)
	if n := len(regexp.MustCompile(refused).FindAllString(b.GatewayLog.String(), -1)); n != 2 {
		t.Errorf("%d audited 429s, want 2", n)
	}
}

// TestAuthOwnershipSurvivesRestarts: three principals' live leases survive a
// gateway kill -9 and then a spawnd restart with their owners: each
// reconnects to its own lease with a fresh ticket, and the others get 404.
func TestAuthOwnershipSurvivesRestarts(t *testing.T) {
	b := startAuthBroker(t, "", Options{StateDir: true})
	toks := []string{tokAlice, tokBob, tokCarol}
	claims := make([]*brokerclient.Claim, len(toks))
	for i, tok := range toks {
		claims[i] = b.claimAs(tok)
	}
	ids := make([]string, len(claims))
	for i, c := range claims {
		ids[i] = c.LeaseID
	}
	check := func(stage string) {
		t.Helper()
		b.waitStates(ids, "active", 20*time.Second)
		for i, c := range claims {
			for j, tok := range toks {
				status, got := b.doAs(tok, "POST", "/ticket/"+c.LeaseID, "")
				if i != j {
					wantAnswer(t, fmt.Sprintf("%s: %s minting for %s's lease", stage, tok, toks[i]), status, got, 404, bodyUnknown)
					continue
				}
				conn, err := b.as(tok).Reconnect(context.Background(), c, nil)
				if err != nil {
					t.Fatalf("%s: %s reconnecting to its own lease: %v", stage, tok, err)
				}
				if got := say(t, conn, stage); !strings.Contains(got, stage) {
					t.Errorf("%s: answer %q", stage, got)
				}
				conn.Close()
			}
		}
	}
	check("fresh")
	b.KillGateway(syscall.SIGKILL)
	b.StartGateway()
	check("gateway-restarted")
	b.KillGateway(syscall.SIGKILL)
	b.KillSpawnd(syscall.SIGKILL)
	b.StartSpawnd()
	b.StartGateway()
	check("both-restarted")
}

// proxyGet sends GET path with headers (each value a header line of its
// own) from a client bound to the local address from, and returns the
// answer.
func proxyGet(t *testing.T, from, url string, headers ...[2]string) (int, string) {
	t.Helper()
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}}
	return sendWith(t, &http.Transport{DialContext: d.DialContext}, url, headers...)
}

func sendWith(t *testing.T, tr *http.Transport, url string, headers ...[2]string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest("GET", url, nil)
	for _, h := range headers {
		req.Header.Add(h[0], h[1])
	}
	resp, err := (&http.Client{Transport: validating(tr)}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	return resp.StatusCode, string(body)
}

var asAlice = [2]string{"X-Forwarded-User", "alice"}

// TestAuthProxyListen: proxy_headers are honoured on auth.proxy_listen, a
// 0660 socket of proxy_listen_group, each connection's peer uid logged
// once; a request there without the principal header, or with it twice, is
// 401. A process bound to 127.0.0.2 sending the same header over TCP (an
// instance on this host, say) is refused, and a uid outside the group
// cannot connect at all.
func TestAuthProxyListen(t *testing.T) {
	sock := filepath.Join(sockdir.New(t, "nxp"), "proxy.sock")
	b := startBroker(t, Options{Token: tokOps, YAML: fmt.Sprintf(`auth:
  proxy_listen: %q
  proxy_listen_group: adm
  validators:
    - type: proxy_headers
      principal_header: X-Forwarded-User
    - type: static
      tokens: [{token: tok-ops, principal: ops, scopes: "nexus.broker.admin"}]
`, sock)})
	st, err := os.Stat(sock)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode()&os.ModeSocket == 0 || st.Mode().Perm() != 0o660 || st.Sys().(*syscall.Stat_t).Gid != 4 {
		t.Errorf("proxy_listen is %v gid %d, want a 0660 socket of adm (4)", st.Mode(), st.Sys().(*syscall.Stat_t).Gid)
	}
	tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}
	defer tr.CloseIdleConnections()
	url := "http://proxy/leases"
	status, got := sendWith(t, tr, url, asAlice)
	wantAnswer(t, "alice through the proxy's socket", status, got, 200, `{"leases":[]}`+"\n")
	status, got = sendWith(t, tr, url, asAlice)
	wantAnswer(t, "alice again, same connection", status, got, 200, `{"leases":[]}`+"\n")
	status, got = sendWith(t, tr, url)
	wantAnswer(t, "no principal header on the socket", status, got, 401, bodyRequired)
	status, got = sendWith(t, tr, url, [2]string{"Authorization", "Bearer tok-ops"})
	wantAnswer(t, "a bearer but no principal header on the socket", status, got, 401, bodyRequired)
	status, got = sendWith(t, tr, url, asAlice, [2]string{"X-Forwarded-User", "ops"})
	wantAnswer(t, "the principal header twice on the socket", status, got, 401, bodyRejected)
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="auth allowed" route="GET /leases" principal_id=alice`), 5*time.Second)
	if n := b.GatewayLog.count(regexp.MustCompile(`level=INFO msg="proxy connection" proxy_listen=\S+ peer_uid=0 peer_gid=0 peer_pid=\d+`)); n != 1 {
		t.Errorf("%d proxy connection records for one connection, want 1:\n%s", n, b.GatewayLog)
	}

	// The attack: a process on this host binds 127.0.0.2 and names alice.
	status, got = proxyGet(t, "127.0.0.2", b.Base+"/leases", asAlice, [2]string{"X-Forwarded-For", "127.0.0.2"})
	wantAnswer(t, "X-Forwarded-User over TCP from 127.0.0.2", status, got, 401, bodyRejected)
	if status, got := proxyGet(t, "127.0.0.2", b.Base+"/leases", [2]string{"Authorization", "Bearer tok-ops"}); status != 200 {
		t.Errorf("a direct caller with a token over TCP: %d %s", status, got)
	}

	// A uid outside the socket's group cannot connect.
	out, err := exec.Command("setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
		"curl", "-sS", "--unix-socket", sock, "-H", "X-Forwarded-User: alice", "http://proxy/leases").CombinedOutput()
	if err == nil || !strings.Contains(string(out), "ermission denied") && !strings.Contains(string(out), "Couldn't connect") {
		t.Errorf("uid 65534 outside adm on the socket: %v %s", err, out)
	}
	if strings.Contains(b.GatewayLog.String(), "peer_uid=65534") {
		t.Error("uid 65534 reached the gateway through the socket")
	}
	b.KillGateway(syscall.SIGTERM) // waits for the exit
	if _, err := os.Lstat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("proxy_listen after the gateway stopped: %v, want it removed", err)
	}
}

// TestAuthProxyCIDRsOfThisHostAreRefused: a trusted_proxy_cidrs entry
// holding an address of this host refuses the boot and a SIGHUP, naming
// the entry; an address this host takes after the boot is refused at
// request time, though the CIDR trusts it.
func TestAuthProxyCIDRsOfThisHostAreRefused(t *testing.T) {
	const later = "198.18.0.7" // not this host's, until the test adds it
	yaml := `auth:
  validators:
    - type: proxy_headers
      trusted_proxy_cidrs: [` + later + `/32]
      principal_header: X-Forwarded-User
    - type: static
      tokens: [{token: tok-ops, principal: ops, scopes: "nexus.broker.admin"}]
`
	b := startBroker(t, Options{Token: tokOps, YAML: yaml})
	text, err := os.ReadFile(b.ConfigPath)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(b.ConfigPath, []byte(strings.Replace(string(text), later+"/32", "10.9.0.0/16, 127.0.0.2/32", 1)), 0o600); err != nil {
		t.Fatal(err)
	}
	if got := b.reload(t); !strings.HasPrefix(got, "rejected") {
		t.Fatalf("a SIGHUP with a same-host CIDR: %s", got)
	}
	if !strings.Contains(unquoted(b.GatewayLog.String()), `auth.validators[0].trusted_proxy_cidrs[1]: "127.0.0.2/32" holds 127.0.0.2, an address of this host`) {
		t.Errorf("the rejected reload does not name the CIDR:\n%s", b.GatewayLog)
	}

	// This host takes the trusted address after the boot.
	if out, err := exec.Command("ip", "addr", "add", later+"/32", "dev", "lo").CombinedOutput(); err != nil {
		t.Fatalf("ip addr add: %v %s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("ip", "addr", "del", later+"/32", "dev", "lo").Run() })
	status, got := proxyGet(t, later, b.Base+"/leases", asAlice)
	wantAnswer(t, "X-Forwarded-User from "+later+", now this host's", status, got, 401, bodyRejected)
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="auth denied" route="GET /leases" principal_id="" reason="credential rejected" status=401 denial="proxy_headers: identity header from an address of this host`), 5*time.Second)

	b.KillGateway(syscall.SIGTERM)
	if err := os.WriteFile(b.ConfigPath, text, 0o600); err != nil {
		t.Fatal(err)
	}
	sameHost := func(s string) string { return strings.Replace(s, later+"/32", "10.9.0.0/16, 127.0.0.2/32", 1) }
	refusedBoot(t, b, "a same-host trusted_proxy_cidrs", sameHost,
		`auth.validators[0].trusted_proxy_cidrs[1]: "127.0.0.2/32" holds 127.0.0.2, an address of this host`)
	refusedBoot(t, b, "a CIDR this host now holds", func(s string) string { return strings.Replace(s, "10.9.0.0/16, 127.0.0.2/32", later+"/32", 1) },
		`auth.validators[0].trusted_proxy_cidrs[0]: "`+later+`/32" holds `+later+`, an address of this host`)
}

// jwksValidator is a jwks validator entry over is, audience nexus-broker.
func jwksValidator(is *authtest.Issuer) string {
	return fmt.Sprintf(`    - type: jwks
      issuer: %q
      jwks_url: %q
      audience: nexus-broker
      principal_claim: sub
`, is.URL(), is.JWKSURL())
}

// TestAuthJWKSAndIntrospectAgainstTheBroker: an OIDC token from a local
// issuer claims and connects; an introspect validator whose endpoint is down
// answers 503 with Retry-After: 5 and claims nothing. The client secret's
// variable is in the gateway's environment only: spawnd reads the same file
// and needs none of the gateway's secrets.
func TestAuthJWKSAndIntrospectAgainstTheBroker(t *testing.T) {
	is := authtest.NewIssuer()
	defer is.Stop()
	in := authtest.NewIntrospector("broker", "s3cret")
	in.Stop()
	b := startBroker(t, Options{YAML: "auth:\n  validators:\n" + jwksValidator(is) + fmt.Sprintf(`    - type: introspect
      endpoint: %q
      client_id: broker
      client_secret_env: NEXUS_TEST_INTROSPECT_SECRET
`, in.URL()), GatewayEnv: []string{"NEXUS_TEST_INTROSPECT_SECRET=s3cret"}})
	tok := is.Sign(authtest.Claims(is.URL(), "nexus-broker", "alice"))
	claim := b.claimAs(tok)
	conn := b.dial(claim, brokerclient.DialOptions{Ticket: claim.Ticket})
	if got := say(t, conn, "jwt"); got != "echo #1: jwt" {
		t.Fatalf("answer %q", got)
	}

	req, _ := http.NewRequest("POST", b.Base+"/claim", strings.NewReader(`{"config":"engine: {}\n"}`))
	req.Header.Set("Authorization", "Bearer opaque-token")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	wantAnswer(t, "introspection endpoint down", resp.StatusCode, string(body), 503, `{"error":"credential validation unavailable"}`+"\n")
	if ra := resp.Header.Get("Retry-After"); ra != "5" {
		t.Errorf("Retry-After %q, want 5", ra)
	}
	if n := len(b.Instances()); n != 1 {
		t.Errorf("%d instances, want only the JWT claim's", n)
	}
	if strings.Contains(b.GatewayLog.String(), "s3cret") || strings.Contains(b.GatewayLog.String(), tok) {
		t.Error("the gateway log carries a secret or a token")
	}
}

// TestAuthAbsentTicketsAreInert: with no auth: block a claim carries no
// ticket, POST /ticket answers 200 without the key, and the lease socket
// takes a connection with no ticket (or an ignored one).
func TestAuthAbsentTicketsAreInert(t *testing.T) {
	b := startBroker(t, Options{})
	claim := b.claim(brokerclient.ClaimRequest{})
	if claim.Ticket != "" {
		t.Errorf("a claim without auth: returned ticket %q", claim.Ticket)
	}
	status, got := b.do("POST", "/ticket/"+claim.LeaseID, "")
	wantAnswer(t, "POST /ticket without auth:", status, got, 200, `{"lease_id":"`+claim.LeaseID+`"}`+"\n")
	b.GatewayLog.wait(t, regexp.MustCompile(`level=INFO msg="issued lease ticket" route="POST /ticket/\{lease_id\}" lease_id=`+claim.LeaseID+` principal_id="" issued=false`), time.Second)
	conn := b.dial(claim, brokerclient.DialOptions{Ticket: "ignored"})
	if got := say(t, conn, "open"); got != "echo #1: open" {
		t.Fatalf("answer %q", got)
	}
	if strings.Contains(b.GatewayLog.String(), `msg="request refused"`) {
		t.Error("a broker without auth: refused something")
	}
}

// TestAuthSessionSurvivesADroppedSocket: brokerclient's Session (what
// nexus-client uses) reconnects a socket that dropped under it with a fresh
// ticket and from_seq, and the conversation carries on; a close the broker
// sends is final.
func TestAuthSessionSurvivesADroppedSocket(t *testing.T) {
	b := startAuthBroker(t, "", Options{})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cl := b.as(tokAlice)
	claim, err := cl.Claim(ctx, brokerclient.ClaimRequest{Config: "engine: {}\n"})
	if err != nil {
		t.Fatal(err)
	}
	sess, err := cl.Open(ctx, claim)
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	ask := func(text string) string {
		t.Helper()
		if err := sess.Send(ctx, brokerframe.IO{Type: brokerframe.IOInput, Content: text}); err != nil {
			t.Fatal(err)
		}
		var out strings.Builder
		for {
			f, err := sess.Next(ctx)
			if err != nil {
				t.Fatalf("reading the answer to %q: %v", text, err)
			}
			var p brokerframe.IO
			if f.Signal != brokerframe.SignalIO || json.Unmarshal(f.Payload, &p) != nil {
				continue
			}
			switch {
			case p.Type == brokerframe.IOStreamDelta:
				out.WriteString(p.Content)
			case p.Type == brokerframe.IOStatus && p.State == brokerframe.StateIdle && out.Len() > 0:
				return out.String()
			}
		}
	}
	if got := ask("one"); got != "echo #1: one" {
		t.Fatalf("answer %q", got)
	}
	first := sess.Conn()
	// The network drops the socket: no close frame, just a dead TCP
	// connection under the client.
	_ = first.Underlying().UnderlyingConn().Close()
	if got := ask("two"); got != "echo #2: two (earlier: one)" {
		t.Fatalf("after the reconnect: %q", got)
	}
	if sess.Conn() == first {
		t.Fatal("no new socket after the drop")
	}
	if err := cl.Release(ctx, claim.LeaseID); err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := sess.Next(ctx); err != nil {
			var ce *websocket.CloseError
			if !errors.As(err, &ce) || ce.Code != 1001 {
				t.Fatalf("after release: %v, want the broker's 1001 close, final", err)
			}
			break
		}
	}
}

// TestAuthChallenges: each refusal carries RFC 6750's challenge — the
// scheme for a missing credential, invalid_token for a refused one,
// insufficient_scope for a route that needs auth.admin_scope.
func TestAuthChallenges(t *testing.T) {
	b := startAuthBroker(t, "", Options{})
	for _, c := range []struct{ token, path, want string }{
		{"", "/leases", `Bearer realm="nexus-broker"`},
		{"wrong-token", "/leases", `Bearer realm="nexus-broker", error="invalid_token"`},
		{tokAlice, "/metrics", `Bearer realm="nexus-broker", error="insufficient_scope"`},
		{tokAlice, "/console", `Bearer realm="nexus-broker", error="insufficient_scope"`},
	} {
		req, err := http.NewRequest("GET", b.Base+c.path, nil)
		if err != nil {
			t.Fatal(err)
		}
		if c.token != "" {
			req.Header.Set("Authorization", "Bearer "+c.token)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if got := resp.Header.Get("WWW-Authenticate"); got != c.want {
			t.Errorf("GET %s with %q: WWW-Authenticate %q, want %q", c.path, c.token, got, c.want)
		}
	}
}

// TestAuthPrincipalPrefixSeparatesValidators: with principal_prefix, a JWT
// whose sub is alice is not static alice: it cannot see, mint for or
// release her lease. The boot WARNs name each pair of validators whose ids
// can still meet (an unprefixed one beside either), and no other pair.
func TestAuthPrincipalPrefixSeparatesValidators(t *testing.T) {
	is := authtest.NewIssuer()
	defer is.Stop()
	b := startBroker(t, Options{Token: "tok-ops", YAML: fmt.Sprintf(`auth:
  validators:
    - type: static
      principal_prefix: "static:"
      tokens:
        - {token: tok-alice, principal: alice}
        - {token: tok-ops, principal: ops, scopes: "nexus.broker.admin"}
    - type: jwks
      principal_prefix: "oidc:"
      issuer: %q
      jwks_url: %q
      audience: nexus-broker
      principal_claim: sub
    - type: static
      tokens: [{token: tok-legacy, principal: legacy}]
`, is.URL(), is.JWKSURL())})
	warn := regexp.MustCompile(`level=WARN msg="two validators lack distinct principal_prefix values[^"]*" validators=(\S+)`)
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="client authentication enabled"`), 10*time.Second)
	var pairs []string
	for _, m := range warn.FindAllStringSubmatch(b.GatewayLog.String(), -1) {
		pairs = append(pairs, m[1])
	}
	if strings.Join(pairs, " ") != "static,static#2 jwks,static#2" {
		t.Errorf("prefix WARNs name %q, want static,static#2 and jwks,static#2", pairs)
	}

	claim := b.claimAs(tokAlice)
	jwt := is.Sign(authtest.Claims(is.URL(), "nexus-broker", "alice"))
	status, got := b.doAs(jwt, "POST", "/ticket/"+claim.LeaseID, "")
	wantAnswer(t, "the JWT alice minting for static alice's lease", status, got, 404, bodyUnknown)
	status, got = b.doAs(jwt, "POST", "/release/"+claim.LeaseID, "")
	wantAnswer(t, "the JWT alice releasing static alice's lease", status, got, 404, bodyUnknown)
	_, view := b.doAs(jwt, "GET", "/leases", "")
	wantAnswer(t, "the JWT alice's GET /leases", 200, view, 200, `{"leases":[]}`+"\n")
	if st, ok := b.lease(claim.LeaseID); !ok || st.State != "active" {
		t.Errorf("static alice's lease after the JWT alice's attempts: %+v %v", st, ok)
	}
	log := b.GatewayLog.String()
	for _, want := range []string{`msg="auth allowed" route="GET /leases" principal_id=oidc:alice`, `principal_id=static:alice`} {
		if !strings.Contains(log, want) {
			t.Errorf("the gateway log has no %q", want)
		}
	}
	if err := b.as(tokAlice).Release(context.Background(), claim.LeaseID); err != nil {
		t.Fatal(err)
	}
	b.waitNoInstances(15 * time.Second)
}

// TestAuthIntrospectAudienceAndCacheTTL: an introspect validator with
// audience refuses an active token issued for another service, and one
// whose answer has no aud; with cache_ttl: 0 a revoked token stops working
// on the next request.
func TestAuthIntrospectAudienceAndCacheTTL(t *testing.T) {
	in := authtest.NewIntrospector("broker", "s3cret")
	defer in.Stop()
	b := startBroker(t, Options{YAML: fmt.Sprintf(`auth:
  validators:
    - type: introspect
      endpoint: %q
      client_id: broker
      client_secret: s3cret
      principal_claim: client_id
      audience: [nexus-broker, nexus]
      cache_ttl: 0s
`, in.URL())})
	in.Activate("for-us", map[string]any{"client_id": "ci", "aud": []string{"billing", "nexus-broker"}})
	in.Activate("for-billing", map[string]any{"client_id": "ci", "aud": "billing"})
	in.Activate("no-aud", map[string]any{"client_id": "ci"})
	status, got := b.doAs("for-us", "GET", "/leases", "")
	wantAnswer(t, "a token for this broker", status, got, 200, `{"leases":[]}`+"\n")
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="auth allowed" route="GET /leases" principal_id=ci\n`), 5*time.Second)
	for _, tok := range []string{"for-billing", "no-aud"} {
		status, got := b.doAs(tok, "GET", "/leases", "")
		wantAnswer(t, "an active token "+tok, status, got, 401, bodyRejected)
	}
	// The audit lines reach the harness through the gateway's stderr, after
	// the answers: waited for, not read at once.
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="auth denied" route="GET /leases" .*is none of \[\\"nexus-broker\\" \\"nexus\\"\]`), 5*time.Second)
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="auth denied" route="GET /leases" .*the answer has no aud, and audience is configured`), 5*time.Second)

	calls := in.Calls()
	if status, _ := b.doAs("for-us", "GET", "/leases", ""); status != 200 {
		t.Fatalf("the token for this broker, again: %d", status)
	}
	in.Revoke("for-us")
	status, got = b.doAs("for-us", "GET", "/leases", "")
	wantAnswer(t, "the revoked token, next request", status, got, 401, bodyRejected)
	if n := in.Calls() - calls; n != 2 {
		t.Errorf("%d introspection calls for two requests with cache_ttl: 0, want 2", n)
	}
}

// TestAuthJWKSFollowsTheIssuer: a rotated key is accepted on its first
// token although the set was fetched a moment ago, and a key the issuer
// removes stops verifying at the refresh its Cache-Control schedules (60 s,
// the shortest honoured: the test waits it out, beside the other parallel
// tests). The issuer answers in 1.1 s, so a second has passed since the
// boot's fetch when the rotated token arrives.
func TestAuthJWKSFollowsTheIssuer(t *testing.T) {
	t.Parallel()
	is := authtest.NewIssuer()
	defer is.Stop()
	is.SetCacheControl("max-age=60")
	is.SetSlow(1100 * time.Millisecond)
	b := startBroker(t, Options{YAML: "auth:\n  validators:\n" + jwksValidator(is)})
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="jwks key set changed" jwks_url=\S+ kids=\[k1\] next_refresh=1m0s`), 30*time.Second)

	is.Rotate()
	rotated := is.Sign(authtest.Claims(is.URL(), "nexus-broker", "alice"))
	status, got := b.doAs(rotated, "GET", "/leases", "")
	wantAnswer(t, "the rotated key's first token, seconds after a fetch", status, got, 200, `{"leases":[]}`+"\n")

	is.Rotate() // k2 is no longer published
	status, got = b.doAs(rotated, "GET", "/leases", "")
	wantAnswer(t, "the removed key's token before the scheduled refresh", status, got, 200, `{"leases":[]}`+"\n")
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="jwks key set changed" jwks_url=\S+ kids=\[k3\]`), 90*time.Second)
	status, got = b.doAs(rotated, "GET", "/leases", "")
	wantAnswer(t, "the removed key's token after the scheduled refresh", status, got, 401, bodyRejected)
	status, got = b.doAs(is.Sign(authtest.Claims(is.URL(), "nexus-broker", "bob")), "GET", "/leases", "")
	wantAnswer(t, "the current key's token", status, got, 200, `{"leases":[]}`+"\n")
}
