package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/gorilla/websocket"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// hostStatus sends method path to b with the Host header host (the
// client writes req.Host, never a Host in the header map) and returns the
// status and body.
func hostStatus(t *testing.T, b *Broker, host, method, path, body string) (int, string) {
	t.Helper()
	// Bounded: a route that is served streams (GET /console/events).
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, b.Base+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Host = host
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s with Host %s: %v", method, path, host, err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(data)
}

// wantHosts checks GET /leases with each Host: allowed ones served (200),
// the others 421 naming the Host.
func wantHosts(t *testing.T, b *Broker, what string, allowed, refused []string) {
	t.Helper()
	for _, h := range allowed {
		if status, body := hostStatus(t, b, h, "GET", "/leases", ""); status != http.StatusOK {
			t.Errorf("%s: GET /leases with Host %q = %d %s, want 200", what, h, status, body)
		}
	}
	for _, h := range refused {
		if status, body := hostStatus(t, b, h, "GET", "/leases", ""); status != http.StatusMisdirectedRequest || !strings.Contains(body, `Host \"`+h+`\" names no address of this broker`) {
			t.Errorf("%s: GET /leases with Host %q = %d %s, want 421 naming the Host", what, h, status, body)
		}
	}
}

// TestHostCheckWithoutAuth: a broker without an auth: block answers 421
// on every route but the probes to a request whose Host names none of its
// addresses (a DNS-rebinding page's), and serves the loopback names, with
// or without a port, [::1] among them. Nothing the refused requests asked
// for happens.
func TestHostCheckWithoutAuth(t *testing.T) {
	b := startBroker(t, Options{})
	c := b.claim(brokerclient.ClaimRequest{})
	_, port, _ := net.SplitHostPort(b.Addr)
	evil := "evil.example:" + port
	for _, route := range []string{
		"POST /claim", "POST /release/" + c.LeaseID, "POST /ticket/" + c.LeaseID, "GET /leases", "GET /binaries",
		"GET /metrics", "GET /openapi.json", "GET /console", "GET /console/events",
	} {
		method, path, _ := strings.Cut(route, " ")
		if status, body := hostStatus(t, b, evil, method, path, ""); status != http.StatusMisdirectedRequest || !strings.Contains(body, `misdirected request: Host \"`+evil+`\" names no address of this broker`) {
			t.Errorf("%s with Host %s = %d %s, want 421 naming the Host", route, evil, status, body)
		}
	}
	// The lease socket, as a browser's WebSocket would open it.
	conn, resp, err := websocket.DefaultDialer.Dial("ws://"+b.Addr+"/lease/"+c.LeaseID, http.Header{"Host": {evil}})
	if err == nil {
		conn.Close()
	}
	if resp == nil || resp.StatusCode != http.StatusMisdirectedRequest {
		t.Errorf("WS /lease with Host %s: %v, %v; want 421", evil, resp, err)
	}
	for _, path := range []string{"/healthz", "/readyz"} {
		if status, body := hostStatus(t, b, evil, "GET", path, ""); status != http.StatusOK {
			t.Errorf("GET %s with Host %s = %d %s, want 200 (probes answer any Host)", path, evil, status, body)
		}
	}
	if l, ok := b.lease(c.LeaseID); !ok || l.State != "active" {
		t.Errorf("after the refused release the lease is %+v (listed %v), want it active", l, ok)
	}
	if n := len(b.leases().Leases); n != 1 {
		t.Errorf("%d leases after the refused claim, want 1", n)
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="request refused".* host=`+regexp.QuoteMeta(evil)), 5*time.Second)
	wantHosts(t, b, "listen 127.0.0.1",
		[]string{b.Addr, "127.0.0.1", "localhost:" + port, "localhost", "LocalHost.", "[::1]:" + port, "[::1]", "127.0.0.2:" + port},
		[]string{"evil.example", "localhost.evil.example:" + port, "192.0.2.1:" + port, "[::1]:" + port + ".evil.example"})
	// The socket over an allowed Host.
	if got := say(t, b.dial(c, brokerclient.DialOptions{}), "hi"); !strings.HasSuffix(got, "hi") {
		t.Errorf("over ws_url the instance answered %q", got)
	}
}

// TestHostCheckAdvertiseAndWildcard: advertise_addr's host is accepted;
// with a wildcard listen_addr and no advertise_addr (ws_url is then built
// from Host) so are this host's name and interface addresses, and the
// listen address as logged ([::]:port).
func TestHostCheckAdvertiseAndWildcard(t *testing.T) {
	adv := startBroker(t, Options{YAML: "advertise_addr: \"nexus.test:9443\"\n"})
	wantHosts(t, adv, "advertise nexus.test:9443",
		[]string{"nexus.test:9443", "NEXUS.test", "nexus.test:1", adv.Addr, "localhost"},
		[]string{"evil.example:9443", "nexus.test.evil.example", hostname(t)})

	wide := startListeningOn(t, ":0")
	_, port, _ := net.SplitHostPort(wide.Addr)
	allowed := []string{wide.Addr, "localhost:" + port, hostname(t), strings.ToUpper(hostname(t)) + ":" + port}
	ifaddrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range ifaddrs {
		if p, err := netip.ParsePrefix(a.String()); err == nil && !p.Addr().IsLoopback() {
			allowed = append(allowed, netip.AddrPortFrom(p.Addr(), 80).String())
		}
	}
	wantHosts(t, wide, "listen :0", allowed, []string{"evil.example:" + port, "nexus.test:9443"})
	// The claim's ws_url comes from its Host.
	host := hostname(t) + ":" + port
	status, body := hostStatus(t, wide, host, "POST", "/claim", `{"config":"engine:\n  name: x\n"}`)
	var c brokerclient.Claim
	if err := json.Unmarshal([]byte(body), &c); status != http.StatusOK || err != nil {
		t.Fatalf("POST /claim with Host %s = %d %s (%v)", host, status, body, err)
	}
	if want := "ws://" + host + "/lease/" + c.LeaseID; c.WSURL != want {
		t.Errorf("ws_url %s, want %s", c.WSURL, want)
	}
}

// hostname is this host's name, as the broker reads it.
func hostname(t *testing.T) string {
	t.Helper()
	h, err := os.Hostname()
	if err != nil || h == "" {
		t.Fatalf("hostname %q: %v", h, err)
	}
	return h
}

// TestHostCheckNotWithAuth: with an auth: block the credential is the
// defence, and any Host reaches authentication.
func TestHostCheckNotWithAuth(t *testing.T) {
	b := startAuthBroker(t, "", Options{})
	status, body := hostStatus(t, b, "evil.example", "GET", "/leases", "")
	wantAnswer(t, "GET /leases with Host evil.example and no credential", status, body, 401, bodyRequired)
	req, _ := http.NewRequest("GET", b.Base+"/leases", nil)
	req.Host = "evil.example"
	req.Header.Set("Authorization", "Bearer "+tokOps)
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != http.StatusOK {
		t.Errorf("GET /leases with Host evil.example and a credential: %v %v, want 200", resp, err)
	} else {
		resp.Body.Close()
	}
}

// TestHostCheckRebindingBrowser: the attack itself. Chromium resolves
// evil.example to 127.0.0.1 (as a rebinding DNS answer would make it), and
// a page it loads from there gets 421 for the console and the API alike;
// the probes still answer.
func TestHostCheckRebindingBrowser(t *testing.T) {
	b := startBroker(t, Options{})
	_, port, _ := net.SplitHostPort(b.Addr)
	tab := startChromium(t, chromedp.Flag("host-resolver-rules", "MAP evil.example 127.0.0.1"))
	ctx, cancel := context.WithTimeout(tab, time.Minute)
	defer cancel()
	origin := "http://evil.example:" + port
	for path, want := range map[string]string{
		"/console": "misdirected request", "/leases": "misdirected request", "/healthz": `"status":"ok"`,
	} {
		if err := chromedp.Do(ctx, chromedp.Navigate(origin+path)); err != nil {
			t.Fatalf("opening %s%s: %v", origin, path, err)
		}
		text, err := chromedp.Run(ctx, chromedp.Evaluate[string](`document.documentElement.innerText`))
		if err != nil {
			t.Fatalf("reading %s%s: %v", origin, path, err)
		}
		if !strings.Contains(text, want) {
			t.Errorf("the browser at %s%s got %q, want %s", origin, path, text, want)
		}
	}
	// What the page's own script gets when it asks the API.
	status, err := chromedp.Run(ctx, chromedp.Evaluate[int](`fetch("/claim", {method: "POST", body: '{"config":"engine:\\n  name: x\\n"}'}).then(r => r.status)`, chromedp.EvalAwaitPromise))
	if err != nil {
		t.Fatal(err)
	}
	if status != http.StatusMisdirectedRequest {
		t.Errorf("the rebinding page's POST /claim answered %d, want 421", status)
	}
	if n := len(b.leases().Leases); n != 0 {
		t.Errorf("the rebinding page claimed %d leases", n)
	}
}

// TestCrossSitePageCannotDriveAnOpenBroker: a page of another site, in
// Chromium, whose script aims at the broker's own address (an allowed
// Host): its simple POST /claim (no-cors, text/plain: no preflight), a
// POST /release of a lease it knows, and a WebSocket to that lease each
// reach the broker with the page's Origin and are refused 403, so nothing
// is claimed, released or read. The broker's own console, same-origin,
// still works (TestConsoleInABrowser).
func TestCrossSitePageCannotDriveAnOpenBroker(t *testing.T) {
	b := startBroker(t, Options{})
	c := b.claim(brokerclient.ClaimRequest{})
	page := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/html")
		_, _ = io.WriteString(w, "<!doctype html><title>elsewhere</title>")
	}))
	defer page.Close()
	_, pagePort, _ := net.SplitHostPort(page.Listener.Addr().String())
	tab := startChromium(t, chromedp.Flag("host-resolver-rules", "MAP evil.example 127.0.0.1"))
	ctx, cancel := context.WithTimeout(tab, time.Minute)
	defer cancel()
	if err := chromedp.Do(ctx, chromedp.Navigate("http://evil.example:"+pagePort+"/")); err != nil {
		t.Fatal(err)
	}
	script := fmt.Sprintf(`(async () => {
		const base = %q, lease = %q;
		const ws = await new Promise(done => {
			const ws = new WebSocket(base.replace("http", "ws") + "/lease/" + lease);
			ws.onopen = () => { ws.close(); done("opened"); };
			ws.onerror = () => done("refused");
		});
		await fetch(base + "/claim", {method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"}, body: '{"config":"engine:\\n  name: x\\n"}'}).catch(() => {});
		await fetch(base + "/release/" + lease, {method: "POST", mode: "no-cors"}).catch(() => {});
		return ws;
	})()`, b.Base, c.LeaseID)
	ws, err := chromedp.Run(ctx, chromedp.Evaluate[string](script, chromedp.EvalAwaitPromise))
	if err != nil {
		t.Fatal(err)
	}
	if ws != "refused" {
		t.Errorf("the cross-site page's WebSocket to the lease: %s, want refused", ws)
	}
	if n := len(b.leases().Leases); n != 1 {
		t.Errorf("%d leases after the cross-site page's claim, want 1", n)
	}
	if l, ok := b.lease(c.LeaseID); !ok || l.State != "active" {
		t.Errorf("after the cross-site page's release the lease is %+v (listed %v), want it active", l, ok)
	}
	// One record per peer and reason each 10 s (logbound), naming the Origin.
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="request refused".*status=403 reason="Origin names no address of this broker".*origin=http://evil\.example:`+pagePort), 10*time.Second)
	// A client that is no browser sends no Origin and is served as before;
	// one that names the broker's own origin too.
	req, _ := http.NewRequest("POST", b.Base+"/claim", strings.NewReader(`{"config":"engine:\n  name: x\n"}`))
	req.Header.Set("Origin", b.Base)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("POST /claim with the broker's own Origin %s = %d, want 200", b.Base, resp.StatusCode)
	}
}
