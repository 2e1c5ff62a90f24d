package e2e

import (
	"bufio"
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/a2aproject/a2a-go/v2/a2a"
)

// keepaliveWait bounds the wait for the gateway's keepalive on a parked
// stream (every 20 s, as upstream), with room for a loaded host.
const keepaliveWait = 40 * time.Second

// rawStream opens an A2A stream with a plain HTTP reader (the a2a-go
// client hides SSE comments) and hands its lines over a channel, closed
// when the body ends.
func rawStream(t *testing.T, ctx context.Context, b *Broker, method, path, body string) <-chan string {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, method, b.Base+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	if b.Token != "" {
		req.Header.Set("Authorization", "Bearer "+b.Token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "text/event-stream" {
		resp.Body.Close()
		t.Fatalf("%s %s answered %d %s", method, path, resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	lines := make(chan string, 64)
	go func() {
		defer close(lines)
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			lines <- sc.Text()
		}
	}()
	return lines
}

// nextLine is the stream's next non-blank line; "" when it ended.
func nextLine(t *testing.T, lines <-chan string, within time.Duration) string {
	t.Helper()
	deadline := time.After(within)
	for {
		select {
		case l, ok := <-lines:
			if !ok || l != "" {
				return l
			}
		case <-deadline:
			t.Fatalf("no line on the stream within %s", within)
		}
	}
}

// TestA2AKeepalive: a stream parked on a question gets upstream's SSE
// keepalive comment (": ping", every 20 s) on both bindings, and still
// carries the answer's events to the end afterwards. It waits out the
// real interval, so it runs beside the other parallel tests (the
// launched spawnd's idle exits) rather than adding to the suite.
func TestA2AKeepalive(t *testing.T) {
	t.Parallel()
	b := a2aBroker(t, "", Options{})
	c := a2aClient(t, b, "support", a2a.TransportProtocolJSONRPC)
	ask := sendTask(t, c, userMsg("keepalive", "/ask proceed?"))
	if ask.Status.State != a2a.TaskStateInputRequired {
		t.Fatalf("ask is %s", ask.Status.State)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*keepaliveWait)
	defer cancel()
	streams := map[string]<-chan string{
		"JSONRPC": rawStream(t, ctx, b, "POST", "/agents/support/a2a",
			`{"jsonrpc":"2.0","id":1,"method":"SubscribeToTask","params":{"id":"`+string(ask.ID)+`"}}`),
		"HTTP+JSON": rawStream(t, ctx, b, "GET", "/agents/support/a2a/v1/tasks/"+string(ask.ID)+":subscribe", ""),
	}
	opened := time.Now()
	for name, lines := range streams {
		if l := nextLine(t, lines, 10*time.Second); !strings.HasPrefix(l, "data: ") || !strings.Contains(l, "TASK_STATE_INPUT_REQUIRED") {
			t.Fatalf("%s: the stream opened on %q, want the parked task", name, l)
		}
	}
	for name, lines := range streams {
		// The snapshot is all a parked stream has to say: the next line
		// is the keepalive, not an event.
		if l := nextLine(t, lines, keepaliveWait); l != ": ping" {
			t.Fatalf("%s: a parked stream carried %q, want the keepalive comment", name, l)
		}
	}
	if waited := time.Since(opened); waited < 15*time.Second {
		t.Errorf("the keepalive came %s after the stream opened, want about 20 s", waited)
	}

	done := sendTask(t, c, &a2a.SendMessageRequest{Message: a2a.NewMessageForTask(a2a.MessageRoleUser, ask, a2a.NewTextPart("yes"))})
	if got := answerOf(t, done); got != "answered: yes" {
		t.Fatalf("the answered task: %q", got)
	}
	for name, lines := range streams {
		var last string
		answered := false
		for l := nextLine(t, lines, 10*time.Second); l != ""; l = nextLine(t, lines, 10*time.Second) {
			if !strings.HasPrefix(l, "data: ") {
				t.Errorf("%s: after the answer the stream carried %q", name, l)
			}
			answered = answered || strings.Contains(l, "answered: yes")
			last = l
		}
		if !answered || !strings.Contains(last, "TASK_STATE_COMPLETED") {
			t.Errorf("%s: after the keepalive the stream ended on %q (answer seen: %v), want the answer and COMPLETED", name, last, answered)
		}
	}
}
