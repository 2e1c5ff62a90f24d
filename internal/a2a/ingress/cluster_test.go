package ingress

import (
	"encoding/json"
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/nexus-broker/nexus-broker/internal/a2a"
)

// FuzzTargetOf: reading which conversation or task an A2A request is
// about never panics, whatever the body and path, and a JSON-RPC task
// method's target is the task its params name.
func FuzzTargetOf(f *testing.F) {
	for _, seed := range [][3]string{
		{"/agents/p/a2a", "", `{"jsonrpc":"2.0","id":1,"method":"GetTask","params":{"id":"t1"}}`},
		{"/agents/p/a2a", "", `{"jsonrpc":"2.0","id":1,"method":"SendStreamingMessage","params":{"message":{"contextId":"c1"}}}`},
		{"/agents/p/a2a", "", `{"jsonrpc":"2.0","id":1,"method":"SendMessage","params":{"message":{"taskId":"t2"}}}`},
		{"/agents/p/a2a/v1/message:stream", "", `{"message":{"contextId":"c2"}}`},
		{"/agents/p/a2a/v1/tasks/t3:subscribe", "t3:subscribe", ""},
		{"/agents/p/a2a", "", `{"method":"SubscribeToTask","params":null}`},
		{"/agents/p/a2a", "", `[1,2]`},
	} {
		f.Add(seed[0], seed[1], seed[2])
	}
	f.Fuzz(func(t *testing.T, path, task, body string) {
		r := &http.Request{Method: http.MethodPost, URL: &url.URL{Path: path}}
		if task != "" {
			r.SetPathValue("task", task)
		}
		got := targetOf(r, []byte(body))
		if got.stream && !strings.HasSuffix(path, ":stream") && !strings.HasSuffix(path, "/a2a") && !strings.HasSuffix(task, ":subscribe") {
			t.Fatalf("%s %q %q: a stream, though neither the path nor the method says so", path, task, body)
		}
		if got.rpc && !strings.HasSuffix(path, "/a2a") {
			t.Fatalf("%s %q: read as JSON-RPC off the JSON-RPC route", path, body)
		}
		var req a2a.RPCRequest
		if task == "" && strings.HasSuffix(path, "/a2a") && json.Unmarshal([]byte(body), &req) == nil && req.Method == "GetTask" {
			var p struct{ ID string }
			if json.Unmarshal(req.Params, &p) == nil && got.task != p.ID {
				t.Fatalf("GetTask of %q read as %+v", p.ID, got)
			}
		}
	})
}
