package e2e

import (
	"net/http"
	"strings"
	"testing"

	"github.com/a2aproject/a2a-go/v2/a2a"
)

// bearer is an http.Client that presents token on every request.
func bearer(token string) *http.Client {
	return &http.Client{Transport: bearerTransport{token}}
}

type bearerTransport struct{ token string }

func (t bearerTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+t.token)
	return http.DefaultTransport.RoundTrip(r)
}

// TestA2AAuth: every A2A route, the card included, is behind the auth
// guard; continuity and tasks are scoped to the caller, and another
// caller's task is indistinguishable from an unknown id.
func TestA2AAuth(t *testing.T) {
	b := a2aBroker(t, staticAuthYAML, Options{Token: tokOps})
	for _, path := range []string{"/agents/support/.well-known/agent-card.json", "/agents/support/a2a/v1/tasks", "/agents/nobody/a2a/v1/tasks"} {
		code, body := b.doAs("", "GET", path, "")
		wantAnswer(t, "GET "+path+" without a credential", code, body, 401, `{"error":"authentication required"}`+"\n")
	}
	code, body := b.doAs("", "POST", "/agents/support/a2a", `{"jsonrpc":"2.0","id":1,"method":"GetTask","params":{"id":"x"}}`)
	wantAnswer(t, "JSON-RPC without a credential", code, body, 401, `{"error":"authentication required"}`+"\n")

	code, body = b.doAs(tokAlice, "GET", "/agents/support/.well-known/agent-card.json", "")
	// Upstream's derivation: a scheme per validator, named as the chain
	// names it, with its description.
	if code != 200 || !strings.Contains(body, `"securitySchemes":{"static":{"httpAuthSecurityScheme":{"description":"Shared bearer token issued out-of-band by the operator of this broker.","scheme":"Bearer"}}},"securityRequirements":[{"schemes":{"static":[]}}]`) {
		t.Errorf("card under auth: %d %s", code, body)
	}

	alice := a2aClientAs(t, b, "support", a2a.TransportProtocolJSONRPC, bearer(tokAlice))
	bob := a2aClientAs(t, b, "support", a2a.TransportProtocolJSONRPC, bearer(tokBob))
	mine := sendTask(t, alice, userMsg("shared", "alice speaking"))
	if got := answerOf(t, mine); got != "echo #1: alice speaking" {
		t.Fatalf("alice's answer %q", got)
	}
	// The same contextId under another principal is another conversation.
	if got := answerOf(t, sendTask(t, bob, userMsg("shared", "bob speaking"))); got != "echo #1: bob speaking" {
		t.Errorf("bob's message on alice's contextId answered %q: it reached her session", got)
	}
	// One of alice's tasks is finished, one still running: bob's every
	// way of naming either answers exactly as an id that never existed.
	slowAlice := a2aClientAs(t, b, "slow", a2a.TransportProtocolJSONRPC, bearer(tokAlice))
	slowly := strings.Repeat("slowly ", 10)
	req := userMsg("running", slowly)
	req.Config = &a2a.SendMessageConfig{ReturnImmediately: true}
	running := sendTask(t, slowAlice, req)
	for _, binding := range []struct{ method, path, body string }{
		{"POST", "/agents/%p/a2a", `{"jsonrpc":"2.0","id":1,"method":"GetTask","params":{"id":"%s"}}`},
		{"POST", "/agents/%p/a2a", `{"jsonrpc":"2.0","id":1,"method":"CancelTask","params":{"id":"%s"}}`},
		{"POST", "/agents/%p/a2a", `{"jsonrpc":"2.0","id":1,"method":"SubscribeToTask","params":{"id":"%s"}}`},
		{"POST", "/agents/%p/a2a", `{"jsonrpc":"2.0","id":1,"method":"SendMessage","params":{"message":{"messageId":"m","role":"ROLE_USER","taskId":"%s","parts":[{"text":"yes"}]}}}`},
		{"GET", "/agents/%p/a2a/v1/tasks/%s", ""},
		{"POST", "/agents/%p/a2a/v1/tasks/%s:cancel", ""},
		{"GET", "/agents/%p/a2a/v1/tasks/%s:subscribe", ""},
		{"POST", "/agents/%p/a2a/v1/message:send", `{"message":{"messageId":"m","role":"ROLE_USER","taskId":"%s","parts":[{"text":"yes"}]}}`},
	} {
		for _, task := range []struct{ profile, id string }{{"support", string(mine.ID)}, {"slow", string(running.ID)}} {
			req := func(id string) (int, string) {
				fill := strings.NewReplacer("%p", task.profile, "%s", id)
				return b.doAs(tokBob, binding.method, fill.Replace(binding.path), fill.Replace(binding.body))
			}
			// The refusal echoes the id asked about (upstream's taskId
			// metadata), so the two compare with the id set aside.
			const never = "00000000-0000-4000-8000-000000000000"
			theirs, theirBody := req(task.id)
			unknown, unknownBody := req(never)
			if theirs != unknown || strings.ReplaceAll(theirBody, task.id, "ID") != strings.ReplaceAll(unknownBody, never, "ID") {
				t.Errorf("%s %s on %s: another's task answers %d %s\nan unknown one %d %s", binding.method, binding.path, task.profile, theirs, theirBody, unknown, unknownBody)
			}
			if !strings.Contains(theirBody, "TASK_NOT_FOUND") {
				t.Errorf("%s %s on %s: %d %s, want task not found", binding.method, binding.path, task.profile, theirs, theirBody)
			}
		}
	}
	// Bob's cancel and answer reached nothing: alice's running task ends
	// with its own answer.
	if got := answerOf(t, settledTask(t, slowAlice, running.ID)); got != "echo #1: "+slowly {
		t.Errorf("alice's running task, after bob's attempts, answered %q", got)
	}
	list, err := bob.ListTasks(ctxT(t), &a2a.ListTasksRequest{ContextID: "shared"})
	if err != nil || list.TotalSize != 1 || list.Tasks[0].ID == mine.ID {
		t.Errorf("bob's list of the shared contextId: %+v, %v", list, err)
	}
	// Alice's task is still hers, untouched.
	read, err := alice.GetTask(ctxT(t), &a2a.GetTaskRequest{ID: mine.ID})
	if err != nil || answerOf(t, read) != "echo #1: alice speaking" {
		t.Errorf("alice reads back %+v, %v", read, err)
	}
	// A2A leases are alice's like any other: her GET /leases lists her two
	// (support and slow), bob's his one.
	_, leases := b.doAs(tokAlice, "GET", "/leases", "")
	_, bobs := b.doAs(tokBob, "GET", "/leases", "")
	if strings.Count(leases, `"lease_id"`) != 2 || strings.Count(bobs, `"lease_id"`) != 1 {
		t.Errorf("each principal should see exactly its own A2A leases: alice %s; bob %s", leases, bobs)
	}
}
