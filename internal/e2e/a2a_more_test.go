package e2e

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/a2aproject/a2a-go/v2/a2a"
)

// rpc posts one JSON-RPC request to profile's endpoint with headers.
func (b *Broker) rpc(t *testing.T, profile, method, params string, header ...string) (int, map[string]any) {
	t.Helper()
	body := fmt.Sprintf(`{"jsonrpc":"2.0","id":7,"method":%q,"params":%s}`, method, params)
	code, text := b.doAs(b.Token, "POST", "/agents/"+profile+"/a2a", body, header...)
	var out map[string]any
	if err := json.Unmarshal([]byte(text), &out); err != nil {
		t.Fatalf("%s answered %d %q, not JSON", method, code, text)
	}
	return code, out
}

func rpcCode(out map[string]any) float64 {
	e, _ := out["error"].(map[string]any)
	c, _ := e["code"].(float64)
	return c
}

// errorInfo is a JSON-RPC error's ErrorInfo detail.
func errorInfo(out map[string]any) map[string]any {
	e, _ := out["error"].(map[string]any)
	data, _ := e["data"].([]any)
	if len(data) == 0 {
		return nil
	}
	info, _ := data[0].(map[string]any)
	return info
}

// TestA2AProtocolErrors: the A2A errors and their codes, on both bindings.
func TestA2AProtocolErrors(t *testing.T) {
	b := a2aBroker(t, "", Options{})
	send := `{"message":{"messageId":"m1","role":"ROLE_USER","parts":[{"text":"hi"}]}}`
	for _, c := range []struct {
		name, method, params string
		header               []string
		code                 float64
		detail               bool
	}{
		{"other A2A-Version", "GetTask", `{"id":"x"}`, []string{"A2A-Version", "0.3"}, -32009, false},
		{"unknown method", "message/send", send, nil, -32601, false},
		{"push notification config", "CreateTaskPushNotificationConfig", `{"taskId":"x"}`, nil, -32003, false},
		{"extended card", "GetExtendedAgentCard", `{}`, nil, -32004, true},
		{"non-text part", "SendMessage", `{"message":{"messageId":"m1","role":"ROLE_USER","parts":[{"url":"https://example.com/a.png"}]}}`, nil, -32005, false},
		{"unknown task", "GetTask", `{"id":"nope"}`, nil, -32001, false},
		{"params of the wrong shape", "GetTask", `[1,2]`, nil, -32602, false},
	} {
		code, out := b.rpc(t, "support", c.method, c.params, c.header...)
		if code != 200 || rpcCode(out) != c.code {
			t.Errorf("%s: %d %v, want code %v", c.name, code, out, c.code)
		}
		if c.detail {
			// Upstream's words, the ErrorInfo naming the operation.
			e, _ := out["error"].(map[string]any)
			info := errorInfo(out)
			md, _ := info["metadata"].(map[string]any)
			if e["message"] != fmt.Sprintf("operation %q is not yet implemented by this broker's A2A ingress", c.method) ||
				info["reason"] != "UNSUPPORTED_OPERATION" || md["operation"] != c.method || md["detail"] != "OPERATION_NOT_IMPLEMENTED" {
				t.Errorf("%s: %v, want upstream's not-yet-implemented error", c.name, out)
			}
		}
	}
	code, text := b.doAs(b.Token, "DELETE", "/agents/support/a2a/v1/tasks/x/pushNotificationConfigs/c", "")
	if code != 400 || !strings.Contains(text, `"message":"operation \"DeleteTaskPushNotificationConfig\" refused: this broker does not deliver push notifications`) ||
		!strings.Contains(text, `"reason":"PUSH_NOTIFICATION_NOT_SUPPORTED"`) || !strings.Contains(text, `"metadata":{"operation":"DeleteTaskPushNotificationConfig"}`) {
		t.Errorf("HTTP+JSON push config delete: %d %s", code, text)
	}
	// Refusals of a request's fields in upstream's words: InvalidParams
	// names the field in a BadRequest detail.
	for _, c := range []struct {
		name, method, params string
		code                 float64
		message, field, why  string
	}{
		{"agent role", "SendMessage", `{"message":{"messageId":"m1","role":"ROLE_AGENT","parts":[{"text":"hi"}]}}`, -32602,
			"Invalid parameters", "message.role", `an inbound message must carry ROLE_USER, got "ROLE_AGENT"`},
		{"blank parts", "SendMessage", `{"message":{"messageId":"m1","role":"ROLE_USER","parts":[{"text":" "},{"text":""}]}}`, -32602,
			"Invalid parameters", "message.parts", "at least one part must carry non-empty text"},
		{"foreign page token", "ListTasks", `{"pageToken":"zz"}`, -32602,
			"Invalid parameters", "pageToken", "must be a nextPageToken returned by a previous ListTasks call"},
		{"no message id", "SendMessage", `{"message":{"role":"ROLE_USER","parts":[{"text":"hi"}]}}`, -32602,
			"Invalid parameters", "message.messageId", "message id is required"},
		{"unknown role", "SendMessage", `{"message":{"messageId":"m1","role":"ROLE_X","parts":[{"text":"hi"}]}}`, -32602,
			"Invalid parameters", "message.role", `role must be ROLE_USER or ROLE_AGENT, got "ROLE_X"`},
		{"no parts", "SendMessage", `{"message":{"messageId":"m1","role":"ROLE_USER","parts":[]}}`, -32602,
			"Invalid parameters", "message.parts", "at least one part is required"},
		{"page too large", "ListTasks", `{"pageSize":500}`, -32602, "Invalid parameters", "pageSize", "must be between 1 and 100, got 500"},
		{"unknown state", "ListTasks", `{"status":"TASK_STATE_DREAMING"}`, -32602, "Invalid parameters", "status", `unknown task state "TASK_STATE_DREAMING"`},
		{"negative history", "GetTask", `{"id":"x","historyLength":-1}`, -32602, "Invalid parameters", "historyLength", "must not be negative, got -1"},
		{"no text output", "SendMessage", `{"message":{"messageId":"m1","role":"ROLE_USER","parts":[{"text":"hi"}]},"configuration":{"acceptedOutputModes":["image/png"]}}`, -32005,
			"this agent produces text/plain; the request accepts only image/png", "", ""},
	} {
		_, out := b.rpc(t, "support", c.method, c.params)
		e, _ := out["error"].(map[string]any)
		ok := rpcCode(out) == c.code && e["message"] == c.message
		if c.field != "" {
			data, _ := e["data"].([]any)
			ok = ok && len(data) == 2 && fmt.Sprint(data[1]) ==
				fmt.Sprintf("map[@type:type.googleapis.com/google.rpc.BadRequest fieldViolations:[map[description:%s field:%s]]]", c.why, c.field)
		}
		if !ok {
			t.Errorf("%s: %v", c.name, out)
		}
	}
	// The JSON-RPC envelope and params refused in upstream's words.
	for _, c := range []struct {
		name, body string
		code       float64
		message    string
		violation  string // the BadRequest detail, when there is one
	}{
		{"not JSON", `{"jsonrpc":`, -32700, "Invalid JSON payload", ""},
		{"not an envelope", `{"jsonrpc":"2.0","id":3,"method":7}`, -32600, "malformed JSON-RPC envelope: ", ""},
		{"another version", `{"jsonrpc":"1.0","id":3,"method":"GetTask","params":{"id":"x"}}`, -32600, "Request payload validation error", `map[description:must be "2.0", got "1.0" field:jsonrpc]`},
		{"no method", `{"jsonrpc":"2.0","id":3,"params":{}}`, -32600, "Request payload validation error", `map[description:must be a non-empty A2A operation name field:method]`},
		{"unknown method", `{"jsonrpc":"2.0","id":3,"method":"message/send","params":{}}`, -32601, `unknown A2A operation "message/send"`, ""},
		{"no params", `{"jsonrpc":"2.0","id":3,"method":"GetTask"}`, -32602, "Invalid parameters", `map[description:GetTask requires a parameter object field:params]`},
		{"no task id", `{"jsonrpc":"2.0","id":3,"method":"CancelTask","params":{"id":""}}`, -32602, "Invalid parameters", `map[description:task id is required field:id]`},
	} {
		_, text := b.doAs(b.Token, "POST", "/agents/support/a2a", c.body)
		var out map[string]any
		_ = json.Unmarshal([]byte(text), &out)
		e, _ := out["error"].(map[string]any)
		msg, _ := e["message"].(string)
		data, _ := e["data"].([]any)
		ok := rpcCode(out) == c.code && strings.HasPrefix(msg, c.message)
		if c.violation != "" {
			ok = ok && len(data) == 2 && strings.Contains(fmt.Sprint(data[1]), "fieldViolations:["+c.violation+"]")
		}
		if !ok {
			t.Errorf("%s: %s", c.name, text)
		}
	}
	// HTTP+JSON ListTasks query parameters, read and refused as upstream's.
	for q, want := range map[string]string{
		"pageSize=x":                "fieldViolations\":[{\"field\":\"pageSize\",\"description\":\"must be an integer, got \\\"x\\\"\"}]",
		"includeArtifacts=maybe":    "fieldViolations\":[{\"field\":\"includeArtifacts\",\"description\":\"must be true or false, got \\\"maybe\\\"\"}]",
		"statusTimestampAfter=soon": "fieldViolations\":[{\"field\":\"statusTimestampAfter\",\"description\":\"must be an ISO 8601 timestamp, got \\\"soon\\\"\"}]",
	} {
		if code, text := b.doAs(b.Token, "GET", "/agents/support/a2a/v1/tasks?"+q, ""); code != 400 || !strings.Contains(text, `"message":"Invalid parameters"`) || !strings.Contains(text, want) {
			t.Errorf("ListTasks ?%s: %d %s", q, code, text)
		}
	}
	if code, out := b.rpc(t, "support", "SendMessage", send); code != 200 || out["error"] != nil {
		t.Fatalf("SendMessage: %d %v", code, out)
	}
	for q, n := range map[string]string{"2000-01-01T00:00:00Z": `"totalSize":1`, "2999-01-01T00:00:00Z": `"totalSize":0`} {
		if code, text := b.doAs(b.Token, "GET", "/agents/support/a2a/v1/tasks?statusTimestampAfter="+q, ""); code != 200 || !strings.Contains(text, n) {
			t.Errorf("ListTasks after %s: %d %s, want %s", q, code, text, n)
		}
	}
	// Upstream's refusals name the task in their ErrorInfo.
	_, out := b.rpc(t, "support", "GetTask", `{"id":"nope"}`)
	if md := errorInfo(out)["metadata"]; fmt.Sprint(md) != "map[taskId:nope]" {
		t.Errorf("unknown task's ErrorInfo metadata %v, want taskId", md)
	}
	// An inline push config is refused in upstream's words.
	code, out = b.rpc(t, "support", "SendMessage", `{"message":{"messageId":"m1","role":"ROLE_USER","parts":[{"text":"hi"}]},`+
		`"configuration":{"taskPushNotificationConfig":{"url":"https://example.com/hook"}}}`)
	if code != 200 || rpcCode(out) != -32003 || !strings.Contains(fmt.Sprint(out),
		"this broker does not deliver push notifications; the agent card declares capabilities.pushNotifications as false") {
		t.Errorf("inline push config: %d %v", code, out)
	}
	big := fmt.Sprintf(`{"jsonrpc":"2.0","id":1,"method":"SendMessage","params":{"message":{"messageId":"m","role":"ROLE_USER","parts":[{"text":%q}]}}}`, strings.Repeat("x", 1<<20))
	code, text = b.doAs(b.Token, "POST", "/agents/support/a2a", big)
	if code != 200 || !strings.Contains(text, "-32600") || !strings.Contains(text, "1048576 bytes") {
		t.Errorf("over-size JSON-RPC body: %d %.200s", code, text)
	}
	code, text = b.doAs(b.Token, "POST", "/agents/support/a2a/v1/message:send", big)
	if code != 413 || !strings.Contains(text, "1048576 bytes") {
		t.Errorf("over-size HTTP+JSON body: %d %.200s", code, text)
	}
	code, text = b.doAs(b.Token, "GET", "/agents/support/a2a/v1/tasks/nope", "", "A2A-Version", "2.0")
	if code != 400 || !strings.Contains(text, "VERSION_NOT_SUPPORTED") {
		t.Errorf("HTTP+JSON other version: %d %s", code, text)
	}
	// A path no HTTP+JSON operation is at is upstream's 404; one an
	// operation is at under another method its 405, naming the method.
	for _, c := range []struct {
		method, path string
		client       *http.Client // unchecked: openapi.json has no such route
		code         int
		allow, text  string
	}{
		{"GET", "/agents/support/a2a/v1/nothing/here", unchecked, 404, "", `"message":"no A2A operation is mounted at /agents/support/a2a/v1/nothing/here"`},
		{"GET", "/agents/support/a2a/v1/tasks/x:bogus", http.DefaultClient, 404, "", `"message":"no A2A operation is mounted at /agents/support/a2a/v1/tasks/x:bogus"`},
		{"PUT", "/agents/support/a2a/v1/message:send", unchecked, 405, "POST, OPTIONS", `"message":"PUT is not allowed on /agents/support/a2a/v1/message:send"`},
		{"DELETE", "/agents/support/a2a/v1/tasks/x/pushNotificationConfigs", unchecked, 405, "GET, POST, OPTIONS", `"status":"METHOD_NOT_ALLOWED"`},
		{"POST", "/agents/support/a2a/v1/tasks/x", http.DefaultClient, 405, "GET, OPTIONS", `"message":"POST is not allowed on /agents/support/a2a/v1/tasks/x"`},
		{"GET", "/agents/support/a2a/v1/tasks/x:cancel", http.DefaultClient, 405, "POST, OPTIONS", `"code":405`},
	} {
		req, _ := http.NewRequest(c.method, b.Base+c.path, nil)
		resp, err := c.client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if resp.StatusCode != c.code || resp.Header.Get("Allow") != c.allow || !strings.Contains(string(body), c.text) {
			t.Errorf("%s %s: %d Allow %q %s, want %d Allow %q with %s", c.method, c.path, resp.StatusCode, resp.Header.Get("Allow"), body, c.code, c.allow, c.text)
		}
	}
	// An unknown profile is a 404 in each binding's own shape, as upstream
	// answers it, and a WARN naming the profile asked for.
	code, text = b.doAs(b.Token, "GET", "/agents/nobody/a2a/v1/tasks", "")
	if code != 404 || !strings.Contains(text, `"code":404`) || !strings.Contains(text, `"status":"NOT_FOUND"`) ||
		!strings.Contains(text, `"message":"unknown agent profile: no A2A agent is mounted at /agents/nobody/a2a/v1/tasks"`) {
		t.Errorf("unknown profile over HTTP+JSON: %d %s", code, text)
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="a2a request for an unknown agent profile" route="GET /agents/\{name\}/a2a/v1/tasks" profile=nobody path=/agents/nobody/a2a/v1/tasks\n`), time.Second)
	code, out = b.rpc(t, "nobody", "GetTask", `{"id":"x"}`)
	if e, _ := out["error"].(map[string]any); code != 404 || rpcCode(out) != -32601 || out["id"] != nil ||
		e["message"] != "unknown agent profile: no A2A agent is mounted at /agents/nobody/a2a" {
		t.Errorf("unknown profile over JSON-RPC: %d %v", code, out)
	}
	c := a2aClient(t, b, "support", a2a.TransportProtocolHTTPJSON)
	m := a2a.NewMessage(a2a.MessageRoleUser, a2a.NewFileURLPart("https://example.com/a.png", "image/png"))
	if _, err := c.SendMessage(ctxT(t), &a2a.SendMessageRequest{Message: m}); !errors.Is(err, a2a.ErrUnsupportedContentType) ||
		!strings.Contains(err.Error(), "message.parts[0] is a url part; this agent accepts text parts only") {
		t.Errorf("a file part over HTTP+JSON: %v, want ContentTypeNotSupported", err)
	}
}

// TestA2ASpawnFailureSettles: an instance that dies before ready fails the
// task, with a message that names no lease.
func TestA2ASpawnFailureSettles(t *testing.T) {
	b := a2aBroker(t, "", Options{})
	writeAgent(t, b, "  doomed:\n    path: %q\n    env: {NEXUS_ECHO_EXIT_BEFORE_READY: \"1\"}\n", "doomed")
	c := a2aClient(t, b, "doomed", a2a.TransportProtocolJSONRPC)
	task := sendTask(t, c, userMsg("d", "hello"))
	if task.Status.State != a2a.TaskStateFailed || task.Status.Message == nil {
		t.Fatalf("task %s %+v, want FAILED with a reason", task.Status.State, task.Status.Message)
	}
	if msg := task.Status.Message.Parts[0].Text(); msg != `an agent instance for profile "doomed" could not be started: instance exited before signalling ready` {
		t.Errorf("status message = %q, want upstream's, naming no lease", msg)
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="a2a turn could not start an agent instance" profile=doomed context_id=d session_id="" status=502 error="instance exited before signalling ready"`), time.Second)
	b.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="a2a task settled without ever reaching an agent instance" profile=doomed task_id=`+string(task.ID)+` context_id=d state=FAILED error=`), time.Second)
}

// A conversation whose session was created by another binary than its
// profile now names is refused like a /claim resume (409), and a refusal
// settles the task REJECTED, not FAILED.
func TestA2AResumeUnderAnotherBinaryIsRejected(t *testing.T) {
	b := a2aBroker(t, "", Options{StateDir: true})
	writeAgent(t, b, "  twin:\n    path: %q\n", "twin")
	c := a2aClient(t, b, "twin", a2a.TransportProtocolJSONRPC)
	answerOf(t, sendTask(t, c, userMsg("tw", "hello")))
	for _, l := range b.leases().Leases {
		if code, body := b.do("POST", "/release/"+l.LeaseID, ""); code != 200 {
			t.Fatalf("releasing %s: %d %s", l.LeaseID, code, body)
		}
	}
	data, err := os.ReadFile(b.ConfigPath)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(b.ConfigPath, []byte(strings.Replace(string(data), "twin: {binary: twin,", "twin: {binary: nexus,", 1)), 0o600); err != nil {
		t.Fatal(err)
	}
	if got := b.reload(t); got != "applied" {
		t.Fatalf("reload %s", got)
	}
	task := sendTask(t, c, userMsg("tw", "again"))
	if task.Status.State != a2a.TaskStateRejected || !strings.HasPrefix(statusText(task), `this broker refused to start an agent instance for profile "twin": session "`) ||
		!strings.Contains(statusText(task), `was created by binary "twin" but this claim requests "nexus"`) {
		t.Errorf("a resume under another binary settled %s %q, want REJECTED naming both binaries", task.Status.State, statusText(task))
	}
}

// writeAgent appends a binaries entry and a profile using it to the
// broker's config and reloads.
func writeAgent(t *testing.T, b *Broker, entry, name string) {
	t.Helper()
	data, err := os.ReadFile(b.ConfigPath)
	if err != nil {
		t.Fatal(err)
	}
	text := strings.Replace(string(data), "  crashy:\n", fmt.Sprintf(entry, bin("nexus-echo"))+"  crashy:\n", 1)
	cfgPath := regexp.MustCompile(`config: "([^"]+)"`).FindStringSubmatch(text)[1]
	text = strings.Replace(text, "agents:\n", fmt.Sprintf("agents:\n  %s: {binary: %s, config: %q, card: {name: X, description: D, version: \"1\"}}\n", name, name, cfgPath), 1)
	if err := os.WriteFile(b.ConfigPath, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	b.reload(t)
}

var reloadedRE = regexp.MustCompile(`msg="config reload (applied|rejected[^"]*)(?:; no reloadable key changed)?"`)

func (b *Broker) reload(t *testing.T) string {
	t.Helper()
	before := b.GatewayLog.count(reloadedRE)
	_ = b.gateway.cmd.Process.Signal(syscall.SIGHUP)
	eventually(t, 20*time.Second, func() string { return "no reload outcome logged" }, func() bool {
		return b.GatewayLog.count(reloadedRE) > before
	})
	all := reloadedRE.FindAllStringSubmatch(b.GatewayLog.String(), -1)
	return all[len(all)-1][1]
}

// TestA2AReloadProfiles: a SIGHUP publishes a new profile and withdraws a
// removed one; a reload cannot switch the ingress on.
func TestA2AReloadProfiles(t *testing.T) {
	b := a2aBroker(t, "", Options{})
	writeAgent(t, b, "  extra:\n    path: %q\n", "extra")
	if code, body := b.get("/agents/extra/.well-known/agent-card.json"); code != 200 || !strings.Contains(body, `"name":"X"`) {
		t.Fatalf("added profile: %d %s", code, body)
	}
	data, _ := os.ReadFile(b.ConfigPath)
	text := regexp.MustCompile(`(?m)^  extra: \{.*\n`).ReplaceAllString(string(data), "")
	_ = os.WriteFile(b.ConfigPath, []byte(text), 0o600)
	if got := b.reload(t); got != "applied" {
		t.Fatalf("reload %s", got)
	}
	if code, body := b.get("/agents/extra/.well-known/agent-card.json"); code != 404 || !strings.Contains(body, "unknown agent profile") {
		t.Errorf("removed profile: %d %s", code, body)
	}
	// A missing config file rejects the reload and keeps what is in force.
	_ = os.WriteFile(b.ConfigPath, []byte(strings.Replace(text, "support.yaml", "missing.yaml", 1)), 0o600)
	if got := b.reload(t); !strings.HasPrefix(got, "rejected") {
		t.Errorf("a reload naming a missing agent config was %s", got)
	}
	if code, _ := b.get("/agents/support/.well-known/agent-card.json"); code != 200 {
		t.Errorf("after a rejected reload the card answers %d", code)
	}
	// The task store's policy is boot-only, named as the spec names it.
	_ = os.WriteFile(b.ConfigPath, []byte(text+"a2a: {tasks: {ttl: 1h}}\n"), 0o600)
	if got := b.reload(t); got != "applied" {
		t.Fatalf("reload %s", got)
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="config reload: these keys changed in the file but are only read at boot[^"]*" path=\S+ keys=a2a.tasks\n`), time.Second)

	plain := startBroker(t, Options{})
	data, _ = os.ReadFile(plain.ConfigPath)
	cfg := fmt.Sprintf("%sagents: {s: {config: %q, card: {name: S, description: D, version: \"1\"}}}\n", data, plain.ConfigPath)
	_ = os.WriteFile(plain.ConfigPath, []byte(cfg), 0o600)
	plain.reload(t)
	if !regexp.MustCompile(`only read at boot.*keys=agents`).MatchString(plain.GatewayLog.String()) {
		t.Error("switching the ingress on by a reload was not reported as boot-only")
	}
	// No route is registered, so the mux's own 404 answers: read it past the
	// OpenAPI check, which describes the routes a broker serves.
	raw := &http.Client{Transport: &http.Transport{}}
	resp, err := raw.Get(plain.Base + "/agents/s/.well-known/agent-card.json")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 404 {
		t.Errorf("a reload switched the ingress on: %d", resp.StatusCode)
	}
}

// TestA2AInputTimeout: a question nobody answers fails its task after
// input_timeout, the instance is told to cancel, and the queue moves.
func TestA2AInputTimeout(t *testing.T) {
	b := a2aBroker(t, "a2a: {tasks: {input_timeout: 1s}}\n", Options{})
	c := a2aClient(t, b, "support", a2a.TransportProtocolJSONRPC)
	ask := sendTask(t, c, userMsg("t", "/ask anyone?"))
	if ask.Status.State != a2a.TaskStateInputRequired {
		t.Fatalf("ask is %s", ask.Status.State)
	}
	req := userMsg("t", "next")
	req.Config = &a2a.SendMessageConfig{ReturnImmediately: true}
	next := sendTask(t, c, req)
	evs := events(t, c.SubscribeToTask(ctxT(t), &a2a.SubscribeToTaskRequest{ID: next.ID}))
	if s := states(evs); s[len(s)-1] != "TASK_STATE_COMPLETED" {
		t.Errorf("the queued task after a timed-out question: %v", s)
	}
	got, err := c.GetTask(ctxT(t), &a2a.GetTaskRequest{ID: ask.ID})
	if err != nil || got.Status.State != a2a.TaskStateFailed || got.Status.Message.Parts[0].Text() != "the agent asked a question and no answer arrived within 1s, so the turn was abandoned" {
		t.Errorf("the unanswered task reads %+v, %v", got, err)
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="a2a task abandoned: the agent's question went unanswered" profile=support task_id=`+
		regexp.QuoteMeta(string(ask.ID))+` context_id=t input_timeout=1s\n`), time.Second)
}

// Continuity is keyed by profile too: one contextId on two profiles is two
// conversations, each profile lists only its own tasks, and a task of one
// is unknown to the other.
func TestA2AProfilesDoNotShareAConversation(t *testing.T) {
	b := a2aBroker(t, "", Options{})
	support := a2aClient(t, b, "support", a2a.TransportProtocolJSONRPC)
	slow := a2aClient(t, b, "slow", a2a.TransportProtocolHTTPJSON)
	answerOf(t, sendTask(t, support, userMsg("shared", "for support")))
	if got := answerOf(t, sendTask(t, slow, userMsg("shared", "for slow"))); got != "echo #1: for slow" {
		t.Errorf("the other profile's first message on the contextId answered %q: it reached the first profile's session", got)
	}
	if got := answerOf(t, sendTask(t, support, userMsg("shared", "again"))); got != "echo #2: again (earlier: for support)" {
		t.Errorf("the first profile's conversation answered %q", got)
	}
	mine := tasksOf(t, slow, "shared")
	if len(mine) != 1 {
		t.Fatalf("ListTasks on the slow profile lists %d tasks, want its own 1", len(mine))
	}
	supportTasks := tasksOf(t, support, "shared")
	if _, err := slow.GetTask(ctxT(t), &a2a.GetTaskRequest{ID: supportTasks[0].ID}); !errors.Is(err, a2a.ErrTaskNotFound) {
		t.Errorf("GetTask of a support task through the slow profile = %v, want task not found", err)
	}
}
