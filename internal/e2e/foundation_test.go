package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// say sends one input and returns the streamed answer.
func say(t *testing.T, conn *brokerclient.Conn, text string) string {
	t.Helper()
	if err := conn.Send(brokerframe.IO{Type: brokerframe.IOInput, Content: text}); err != nil {
		t.Fatalf("send %q: %v", text, err)
	}
	_ = conn.Underlying().SetReadDeadline(time.Now().Add(30 * time.Second))
	answer, err := conn.Answer()
	if err != nil {
		t.Fatalf("reading the answer to %q: %v", text, err)
	}
	return answer
}

// closeCode reads until the socket closes and returns the close code and text.
func closeCode(t *testing.T, conn *brokerclient.Conn) (int, string) {
	t.Helper()
	_ = conn.Underlying().SetReadDeadline(time.Now().Add(30 * time.Second))
	for {
		_, err := conn.Next()
		if err == nil {
			continue
		}
		var ce *websocket.CloseError
		if errors.As(err, &ce) {
			return ce.Code, ce.Text
		}
		t.Fatalf("socket ended without a close frame: %v", err)
	}
}

func TestClaimStreamReleaseResume(t *testing.T) {
	b := startBroker(t, Options{})
	claim := b.claim(brokerclient.ClaimRequest{})
	if claim.LeaseID == "" || claim.SessionID == "" {
		t.Fatalf("claim answer lacks lease_id or session_id: %+v", claim)
	}
	if want := "ws://" + b.Addr + "/lease/" + claim.LeaseID; claim.WSURL != want {
		t.Fatalf("ws_url = %q, want %q", claim.WSURL, want)
	}
	// Upstream's line and keys, duration ours.
	b.GatewayLog.wait(t, regexp.MustCompile(`level=INFO msg="claim ready" lease_id=`+claim.LeaseID+` pid=[1-9][0-9]* ws_url=`+
		regexp.QuoteMeta(claim.WSURL)+` session_id=`+claim.SessionID+` principal_id="" ticket_issued=false binary=nexus duration=`), time.Second)
	conn := b.dial(claim, brokerclient.DialOptions{})
	if got := say(t, conn, "hello"); got != "echo #1: hello" {
		t.Fatalf("answer = %q", got)
	}

	status, body := b.do("POST", "/release/"+claim.LeaseID, "")
	if status != 200 || strings.TrimSpace(body) != fmt.Sprintf(`{"lease_id":%q,"status":"released"}`, claim.LeaseID) {
		t.Fatalf("release = %d %s", status, body)
	}
	if code, text := closeCode(t, conn); code != 1001 || text != "lease closed" {
		t.Fatalf("client closed with %d %q, want 1001 \"lease closed\"", code, text)
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`level=INFO msg="lease released" lease_id=`+claim.LeaseID+` reason="manual release"`), time.Second)
	b.waitNoInstances(10 * time.Second)
	if status, body := b.do("POST", "/release/"+claim.LeaseID, ""); status != 404 || strings.TrimSpace(body) != `{"error":"unknown lease"}` {
		t.Fatalf("second release = %d %s, want 404 unknown lease", status, body)
	}

	// Resume: the engine reloads the transcript the first lease persisted.
	resumed := b.claim(brokerclient.ClaimRequest{SessionID: claim.SessionID})
	if resumed.SessionID != claim.SessionID {
		t.Fatalf("resume answered session %q, want %q", resumed.SessionID, claim.SessionID)
	}
	conn2 := b.dial(resumed, brokerclient.DialOptions{})
	if got := say(t, conn2, "again"); got != "echo #2: again (earlier: hello)" {
		t.Fatalf("resumed answer = %q", got)
	}
	if status, _ := b.do("POST", "/release/"+resumed.LeaseID, ""); status != 200 {
		t.Fatalf("release of the resumed lease = %d", status)
	}

	// A session that does not exist fails the instance's boot: 502.
	_, err := b.Client.Claim(context.Background(), brokerclient.ClaimRequest{Config: "x: 1\n", SessionID: "0123456789abcdef"})
	var ae *brokerclient.APIError
	if !errors.As(err, &ae) || ae.Status != 502 || ae.Message != "instance exited before signalling ready" {
		t.Fatalf("resume of an unknown session = %v, want 502 instance exited before signalling ready", err)
	}
	b.waitNoInstances(10 * time.Second)
}

func TestInstanceEnvironmentIsExactlyTheAllowedNames(t *testing.T) {
	b := startBroker(t, Options{
		NoNexusEntry: true,
		YAML: fmt.Sprintf(`inherit_env: [NEXUS_E2E_INHERITED, NEXUS_E2E_NOT_HELD]
binaries:
  nexus:
    path: %q
    env:
      NEXUS_E2E_ENTRY: "1"
`, bin("nexus-echo")),
		Env: []string{"NEXUS_E2E_INHERITED=yes", "NEXUS_E2E_LEAKED=secret-value"},
	})
	conn := b.dial(b.claim(brokerclient.ClaimRequest{}), brokerclient.DialOptions{})
	got := strings.Split(say(t, conn, "/env"), ",")
	want := []string{"HOME", "LANG", "NEXUS_BROKER_ADDR", "NEXUS_BROKER_LEASE_ID", "NEXUS_BROKER_SPAWN_SECRET",
		"NEXUS_E2E_ENTRY", "NEXUS_E2E_INHERITED", "PATH", "TZ"}
	sort.Strings(got)
	if strings.Join(got, ",") != strings.Join(want, ",") {
		t.Fatalf("instance environment names = %v\nwant exactly        %v", got, want)
	}
	// spawnd names what spawns carry, and the inherit_env name it lacks.
	b.SpawndLog.wait(t, regexp.MustCompile(`msg="binary registry entry" name=nexus .*spawn_env=HOME,LANG,NEXUS_BROKER_ADDR,NEXUS_BROKER_LEASE_ID,NEXUS_BROKER_SPAWN_SECRET,NEXUS_E2E_ENTRY,NEXUS_E2E_INHERITED,PATH,TZ`), time.Second)
	b.SpawndLog.wait(t, regexp.MustCompile(`level=WARN .*NEXUS_E2E_NOT_HELD`), time.Second)
	if strings.Contains(b.SpawndLog.String()+b.GatewayLog.String(), "secret-value") {
		t.Fatal("a value of the environment reached a log")
	}
}

func TestGrandchildIsGoneAfterRelease(t *testing.T) {
	b := startBroker(t, Options{YAML: "release_grace: 2s\n"})
	claim := b.claim(brokerclient.ClaimRequest{})
	conn := b.dial(claim, brokerclient.DialOptions{})
	answer := say(t, conn, "/spawn-child")
	var child int
	if _, err := fmt.Sscanf(answer, "child=%d", &child); err != nil {
		t.Fatalf("answer %q carries no child pid", answer)
	}
	if err := syscall.Kill(child, 0); err != nil {
		t.Fatalf("grandchild %d not running before release: %v", child, err)
	}
	if status, _ := b.do("POST", "/release/"+claim.LeaseID, ""); status != 200 {
		t.Fatalf("release = %d", status)
	}
	eventually(t, 10*time.Second, func() string { return fmt.Sprintf("grandchild %d gone after its instance's release", child) },
		func() bool { return !alive(child) })
}

// alive reports whether pid is a live (non-zombie) process.
func alive(pid int) bool {
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	return err == nil && !zombie(st)
}

func TestHTTPRefusals(t *testing.T) {
	b := startBroker(t, Options{YAML: "max_claim_body: 200\n"})
	cases := []struct {
		name, method, path, body string
		status                   int
		want                     string
	}{
		{"not json", "POST", "/claim", "{", 400, `{"error":"invalid claim body"}`},
		{"empty config", "POST", "/claim", `{"config":"  "}`, 400, `{"error":"claim requires a non-empty config"}`},
		{"unknown binary", "POST", "/claim", `{"config":"a: 1","binary":" vision "}`, 400, `{"error":"unknown binary \"vision\"; this broker spawns: nexus"}`},
		{"over max_claim_body", "POST", "/claim", `{"config":"` + strings.Repeat("x", 300) + `"}`, 413,
			`{"error":"claim body exceeds max_claim_body (200 bytes); raise max_claim_body or send a smaller config"}`},
		{"release unknown", "POST", "/release/nope", "", 404, `{"error":"unknown lease"}`},
		{"ticket unknown", "POST", "/ticket/nope", "", 404, `{"error":"unknown lease"}`},
		{"connect unknown", "GET", "/lease/nope", "", 404, `{"error":"unknown lease"}`},
		{"healthz", "GET", "/healthz", "", 200, `{"status":"ok"}`},
		{"binaries", "GET", "/binaries", "", 200, `{"binaries":[{"name":"nexus"}]}`},
		{"leases", "GET", "/leases", "", 200, `{"max_concurrent":8,"slots_in_use":0,"queue_depth":0,"max_queue_depth":64,"leases":[]}`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			status, body := b.do(c.method, c.path, c.body)
			if status != c.status || strings.TrimSpace(body) != c.want {
				t.Fatalf("%s %s = %d %s\nwant %d %s", c.method, c.path, status, body, c.status, c.want)
			}
		})
	}
	if n := len(b.Instances()); n != 0 {
		t.Fatalf("refused claims left %d instances", n)
	}
}

func TestBinariesListingAndLeasesShape(t *testing.T) {
	b := startBroker(t, Options{NoNexusEntry: true, YAML: fmt.Sprintf(`binaries:
  nexus:
    path: %[1]q
  vision:
    path: %[1]q
    label: "Nexus (vision)"
    description: "Multimodal build"
    args: ["-replay"]
    env: {NEXUS_VISION: "1"}
  archive:
    path: %[1]q
    label: "Nexus 0.9"
  blank:
    path: %[1]q
    label: ""
`, bin("nexus-echo"))})
	// An unset label or description is omitted; one written as "" is kept.
	_, body := b.get("/binaries")
	want := `{"binaries":[{"name":"archive","label":"Nexus 0.9"},{"name":"blank","label":""},{"name":"nexus"},{"name":"vision","label":"Nexus (vision)","description":"Multimodal build"}]}`
	if strings.TrimSpace(body) != want {
		t.Fatalf("GET /binaries = %s\nwant %s", body, want)
	}
	claim := b.claim(brokerclient.ClaimRequest{Binary: "vision"})
	var leases struct {
		Leases []map[string]any `json:"leases"`
	}
	_, body = b.get("/leases")
	if err := json.Unmarshal([]byte(body), &leases); err != nil || len(leases.Leases) != 1 {
		t.Fatalf("GET /leases = %s", body)
	}
	l := leases.Leases[0]
	if l["lease_id"] != claim.LeaseID || l["binary"] != "vision" || l["state"] != "active" || l["session_id"] != claim.SessionID || l["pid"].(float64) <= 0 {
		t.Fatalf("lease = %v", l)
	}
	if _, has := l["reason"]; has {
		t.Fatalf("an active lease carries a reason: %v", l)
	}
}

func TestRegistrationRefusalsAreIdenticalOnTheWireAndNamedInTheLog(t *testing.T) {
	cases := []struct {
		knob string
		log  string
		err  string // the record's error attribute, upstream's words
	}{
		{"NEXUS_ECHO_NO_SECRET=1", "carried NO spawn secret", "register frame carried no spawn secret"},
		{"NEXUS_ECHO_WRONG_SECRET=1", "carried the WRONG spawn secret", "register frame spawn secret does not match"},
		{"NEXUS_ECHO_FRAME_VERSION=2", "declares a broker frame schema version this broker does not speak",
			"register frame schema version does not match this broker: instance sent version 2, this broker speaks version 1"},
	}
	for _, c := range cases {
		t.Run(c.knob, func(t *testing.T) {
			name, value, _ := strings.Cut(c.knob, "=")
			b := startBroker(t, Options{NoNexusEntry: true, YAML: fmt.Sprintf("ready_timeout: 2s\nbinaries:\n  nexus:\n    path: %q\n    env: {%s: %q}\n", bin("nexus-echo"), name, value)})
			_, err := b.Client.Claim(context.Background(), brokerclient.ClaimRequest{Config: "a: 1"})
			var ae *brokerclient.APIError
			if !errors.As(err, &ae) || ae.Status != 504 || ae.Message != "instance did not become ready in time" {
				t.Fatalf("claim = %v, want 504", err)
			}
			b.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="rejecting instance registration: [^"]*`+regexp.QuoteMeta(c.log)+`[^"]*" lease_id=\S+ .*error="`+regexp.QuoteMeta(c.err)+`"`), time.Second)
			if strings.Contains(b.GatewayLog.String(), "NEXUS_BROKER_SPAWN_SECRET=") {
				t.Fatal("a secret reached the log")
			}
			b.waitNoInstances(15 * time.Second)
		})
	}
}

// TestANonHandshakeIsRefusedInUpstreamsWords: a request to a WebSocket
// route that is not a handshake is refused as upstream's WebSocket library
// refuses it (426 naming the missing token, with the headers asking for an
// upgrade; 400 for a version other than 13), and logged as upstream does.
func TestANonHandshakeIsRefusedInUpstreamsWords(t *testing.T) {
	b := startBroker(t, Options{})
	claim := b.claim(brokerclient.ClaimRequest{})
	cases := []struct {
		path, peer string
		header     []string
		status     int
		text       string
		want       [2]string // a header the refusal carries
	}{
		{"/lease/" + claim.LeaseID, "client", nil, 426, `WebSocket protocol violation: Connection header "" does not contain Upgrade`, [2]string{"Upgrade", "websocket"}},
		{"/instance", "instance", []string{"Connection", "Upgrade"}, 426, `WebSocket protocol violation: Upgrade header "" does not contain websocket`, [2]string{"Connection", "Upgrade"}},
		{"/lease/" + claim.LeaseID, "client", []string{"Connection", "Upgrade", "Upgrade", "websocket", "Sec-WebSocket-Version", "8"}, 400,
			`unsupported WebSocket protocol version (only 13 is supported): "8"`, [2]string{"Sec-WebSocket-Version", "13"}},
	}
	for _, c := range cases {
		req, err := http.NewRequest(http.MethodGet, b.Base+c.path, nil)
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i+1 < len(c.header); i += 2 {
			req.Header.Set(c.header[i], c.header[i+1])
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if resp.StatusCode != c.status || strings.TrimSpace(string(body)) != c.text || resp.Header.Get(c.want[0]) != c.want[1] {
			t.Errorf("GET %s %v = %d %q (%s: %q), want %d %q", c.path, c.header, resp.StatusCode, body, c.want[0], resp.Header.Get(c.want[0]), c.status, c.text)
		}
		logged := strconv.Quote("failed to accept WebSocket connection: " + c.text)
		b.GatewayLog.wait(t, regexp.MustCompile(`level=ERROR msg="`+c.peer+` websocket accept failed" error=`+regexp.QuoteMeta(logged)), time.Second)
	}
}

func TestUnknownLeaseRegistrationClosesWithPolicyViolation(t *testing.T) {
	b := startBroker(t, Options{})
	ws := b.registerAs(t, "nope", "s")
	_, _, err := ws.ReadMessage()
	var ce *websocket.CloseError
	if !errors.As(err, &ce) || ce.Code != 1008 || ce.Text != "unknown lease" {
		t.Fatalf("got %v, want close 1008 unknown lease", err)
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="rejecting instance registration" lease_id=nope remote=\S+ error="unknown lease: no live lease has this id`), time.Second)
}

func TestExitBeforeReadyIs502AndFreesTheSlot(t *testing.T) {
	b := startBroker(t, Options{NoNexusEntry: true, YAML: fmt.Sprintf("max_concurrent: 1\nbinaries:\n  nexus:\n    path: %q\n    env: {NEXUS_ECHO_EXIT_BEFORE_READY: \"1\"}\n  good:\n    path: %q\n", bin("nexus-echo"), bin("nexus-echo"))})
	_, err := b.Client.Claim(context.Background(), brokerclient.ClaimRequest{Config: "a: 1"})
	var ae *brokerclient.APIError
	if !errors.As(err, &ae) || ae.Status != 502 || ae.Message != "instance exited before signalling ready" {
		t.Fatalf("claim = %v, want 502", err)
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="claim failed" status=502 reason="instance exited before signalling ready" error="exit status 3"`), time.Second)
	// The slot came back: a claim on the one-slot broker succeeds.
	b.claim(brokerclient.ClaimRequest{Binary: "good"})
	m := b.metrics()
	if m[`nexus_broker_spawn_failures_total{reason="exited_before_ready"}`] != 1 || m[`nexus_broker_claims_total{outcome="accepted"}`] != 1 {
		t.Fatalf("metrics after one failed and one good claim: %v", m)
	}
}

func TestClaimSucceedsWithoutASessionReportAfterTheGrace(t *testing.T) {
	b := startBroker(t, Options{NoNexusEntry: true, YAML: fmt.Sprintf("session_report_grace: 300ms\nbinaries:\n  nexus:\n    path: %q\n    env: {NEXUS_ECHO_NO_SESSION_REPORT: \"1\"}\n", bin("nexus-echo"))})
	start := time.Now()
	claim := b.claim(brokerclient.ClaimRequest{})
	if d := time.Since(start); d < 300*time.Millisecond {
		t.Fatalf("claim answered after %s, before session_report_grace", d)
	}
	if claim.SessionID != "" {
		t.Fatalf("session_id = %q from an instance that never reported one", claim.SessionID)
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="instance did not report a session id within grace window" lease_id=`+claim.LeaseID+` `), time.Second)
	if got := say(t, b.dial(claim, brokerclient.DialOptions{}), "hi"); got != "echo #1: hi" {
		t.Fatalf("answer = %q", got)
	}
	// On the wire the key is absent, as upstream's is, not an empty string.
	status, body := b.do("POST", "/claim", `{"config":"a: 1"}`)
	var raw map[string]any
	if err := json.Unmarshal([]byte(body), &raw); status != 200 || err != nil {
		t.Fatalf("claim = %d %s", status, body)
	}
	if v, ok := raw["session_id"]; ok {
		t.Errorf("the answer carries session_id %q from an instance that never reported one; want the key omitted: %s", v, body)
	}
}
