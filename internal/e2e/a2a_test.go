package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/a2aproject/a2a-go/v2/a2a"
	"github.com/a2aproject/a2a-go/v2/a2aclient"
	"github.com/a2aproject/a2a-go/v2/a2aclient/agentcard"
)

// The A2A front door, driven by the official Go client (a2a-go v2.3.1)
// against the real broker, spawnd and nexus-echo.

// a2aBroker starts a broker serving the profile "support" (and "crashy",
// "late" whose instances crash mid-turn and right after answering).
func a2aBroker(t testing.TB, yaml string, o Options) *Broker {
	t.Helper()
	dir := t.TempDir()
	agentCfg := filepath.Join(dir, "support.yaml")
	if err := os.WriteFile(agentCfg, []byte("engine:\n  name: support\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	y := fmt.Sprintf(`  crashy:
    path: %q
    env: {NEXUS_ECHO_CRASH: mid-turn}
  late:
    path: %q
    env: {NEXUS_ECHO_CRASH: after-answer}
  slow:
    path: %q
    env: {NEXUS_ECHO_SLOW_TURN: 300ms}
  lazy:
    path: %q
    env: {NEXUS_ECHO_SESSION_REPORT_DELAY: 1s}
agents:
  support:
    config: %q
    card:
      name: Support Agent
      description: Answers questions.
      version: "1.2.0"
      default_output_modes: [text/plain, text/markdown]
      skills: [{id: answer, name: Answer questions, description: Answers a question., input_modes: [text/plain]}]
  crashy: {binary: crashy, config: %q, card: {name: C, description: D, version: "1"}}
  late: {binary: late, config: %q, card: {name: L, description: D, version: "1"}}
  slow: {binary: slow, config: %q, card: {name: S, description: D, version: "1"}}
  lazy: {binary: lazy, config: %q, card: {name: Z, description: D, version: "1"}}
`, bin("nexus-echo"), bin("nexus-echo"), bin("nexus-echo"), bin("nexus-echo"), agentCfg, agentCfg, agentCfg, agentCfg, agentCfg) + yaml
	o.YAML = y + o.YAML
	return startBroker(t, o)
}

var bindings = []a2a.TransportProtocol{a2a.TransportProtocolJSONRPC, a2a.TransportProtocolHTTPJSON}

// a2aClient resolves profile's card and returns a client speaking binding.
func a2aClient(t testing.TB, b *Broker, profile string, binding a2a.TransportProtocol) *a2aclient.Client {
	t.Helper()
	return a2aClientAs(t, b, profile, binding, http.DefaultClient)
}

// a2aClientAs is a2aClient making its requests with hc (a credential).
func a2aClientAs(t testing.TB, b *Broker, profile string, binding a2a.TransportProtocol, hc *http.Client) *a2aclient.Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	card, err := agentcard.NewResolver(hc).Resolve(ctx, b.Base+"/agents/"+profile)
	if err != nil {
		t.Fatalf("resolving the card: %v", err)
	}
	var ifaces []*a2a.AgentInterface
	for _, i := range card.SupportedInterfaces {
		if i.ProtocolBinding == binding {
			ifaces = append(ifaces, i)
		}
	}
	if len(ifaces) != 1 {
		t.Fatalf("card lists %d %s interfaces: %+v", len(ifaces), binding, card.SupportedInterfaces)
	}
	c, err := a2aclient.NewFromEndpoints(ctx, ifaces, a2aclient.WithJSONRPCTransport(hc), a2aclient.WithRESTTransport(hc))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func userMsg(contextID, text string) *a2a.SendMessageRequest {
	m := a2a.NewMessage(a2a.MessageRoleUser, a2a.NewTextPart(text))
	m.ContextID = contextID
	return &a2a.SendMessageRequest{Message: m}
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func sendTask(t *testing.T, c *a2aclient.Client, req *a2a.SendMessageRequest) *a2a.Task {
	t.Helper()
	res, err := c.SendMessage(ctxT(t), req)
	if err != nil {
		t.Fatalf("SendMessage: %v", err)
	}
	task, ok := res.(*a2a.Task)
	if !ok {
		t.Fatalf("SendMessage answered %T, want a task", res)
	}
	return task
}

// sendNow sends text on conversation conv with returnImmediately: the
// task as it stands, running or queued.
func sendNow(t *testing.T, c *a2aclient.Client, conv, text string) *a2a.Task {
	t.Helper()
	req := userMsg(conv, text)
	req.Config = &a2a.SendMessageConfig{ReturnImmediately: true}
	return sendTask(t, c, req)
}

func answerOf(t *testing.T, task *a2a.Task) string {
	t.Helper()
	if task.Status.State != a2a.TaskStateCompleted || len(task.Artifacts) != 1 || len(task.Artifacts[0].Parts) != 1 {
		t.Fatalf("task %s is %s with %d artifacts, want COMPLETED with the answer; status %+v", task.ID, task.Status.State, len(task.Artifacts), task.Status.Message)
	}
	return task.Artifacts[0].Parts[0].Text()
}

// events collects a stream until it ends.
func events(t *testing.T, seq func(func(a2a.Event, error) bool)) []a2a.Event {
	t.Helper()
	var out []a2a.Event
	for ev, err := range seq {
		if err != nil {
			t.Fatalf("stream failed after %d events: %v", len(out), err)
		}
		out = append(out, ev)
	}
	return out
}

func states(evs []a2a.Event) []string {
	var out []string
	for _, ev := range evs {
		switch e := ev.(type) {
		case *a2a.Task:
			out = append(out, "task:"+string(e.Status.State))
		case *a2a.TaskStatusUpdateEvent:
			out = append(out, string(e.Status.State))
		case *a2a.TaskArtifactUpdateEvent:
			out = append(out, "artifact:"+e.Artifact.Parts[0].Text())
		default:
			out = append(out, fmt.Sprintf("%T", ev))
		}
	}
	return out
}

// TestA2ACard: the card carries the operator's identity and the derived
// interfaces and capabilities, with absolute URLs.
func TestA2ACard(t *testing.T) {
	b := a2aBroker(t, "", Options{})
	card, err := agentcard.NewResolver(http.DefaultClient).Resolve(ctxT(t), b.Base+"/agents/support")
	if err != nil {
		t.Fatal(err)
	}
	if card.Name != "Support Agent" || card.Version != "1.2.0" || len(card.Skills) != 1 || card.Skills[0].ID != "answer" {
		t.Errorf("card identity = %+v", card)
	}
	// Upstream's mode keys: configured where given, text/plain where not.
	if fmt.Sprint(card.DefaultInputModes, card.DefaultOutputModes, card.Skills[0].InputModes, card.Skills[0].OutputModes) != "[text/plain] [text/plain text/markdown] [text/plain] []" {
		t.Errorf("card modes %v %v, skill %v %v", card.DefaultInputModes, card.DefaultOutputModes, card.Skills[0].InputModes, card.Skills[0].OutputModes)
	}
	if !card.Capabilities.Streaming || card.Capabilities.PushNotifications || card.Capabilities.ExtendedAgentCard {
		t.Errorf("capabilities = %+v", card.Capabilities)
	}
	want := map[a2a.TransportProtocol]string{
		a2a.TransportProtocolJSONRPC:  b.Base + "/agents/support/a2a",
		a2a.TransportProtocolHTTPJSON: b.Base + "/agents/support/a2a/v1",
	}
	for _, i := range card.SupportedInterfaces {
		if want[i.ProtocolBinding] != i.URL || i.ProtocolVersion != "1.0" {
			t.Errorf("interface %+v", i)
		}
		delete(want, i.ProtocolBinding)
	}
	if len(want) > 0 {
		t.Errorf("missing interfaces %v", want)
	}
	if code, body := b.get("/agents/nobody/.well-known/agent-card.json"); code != 404 || !strings.Contains(body, `"unknown agent profile"`) {
		t.Errorf("unknown profile: %d %s", code, body)
	}
	// The card carries upstream's validators; a matching If-None-Match is a
	// 304, HEAD its headers alone. The bindings' answers say A2A-Version.
	cardURL := b.Base + "/agents/support/.well-known/agent-card.json"
	resp, err := http.Get(cardURL)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	etag := resp.Header.Get("ETag")
	if !regexp.MustCompile(`^"[0-9a-f]{32}"$`).MatchString(etag) || resp.Header.Get("Cache-Control") != "public, max-age=300" {
		t.Errorf("card headers %v, want a quoted 32-hex ETag and Cache-Control public, max-age=300", resp.Header)
	}
	for _, m := range []string{etag, "W/" + etag + ", \"other\"", "*"} {
		req, _ := http.NewRequest(http.MethodGet, cardURL, nil)
		req.Header.Set("If-None-Match", m)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusNotModified || len(body) != 0 || resp.Header.Get("ETag") != etag {
			t.Errorf("If-None-Match %s: %d %q", m, resp.StatusCode, body)
		}
	}
	if resp, err := http.Head(cardURL); err != nil || resp.StatusCode != 200 || resp.Header.Get("ETag") != etag {
		t.Errorf("HEAD of the card: %v %v", resp, err)
	}
	for _, u := range []string{"/agents/support/a2a/v1/tasks", "/agents/nobody/a2a/v1/tasks"} {
		if resp, err := http.Get(b.Base + u); err != nil || resp.Header.Get("A2A-Version") != "1.0" {
			t.Errorf("GET %s: %v %v, want A2A-Version 1.0", u, resp, err)
		} else {
			_ = resp.Body.Close()
		}
	}
	// The boot states the ingress in upstream's lines.
	q := regexp.QuoteMeta
	b.GatewayLog.wait(t, regexp.MustCompile(`level=INFO msg="a2a ingress enabled" profiles=5 base_url=`+q(b.Base)+`\n`+
		`.*level=INFO msg="a2a task retention" state_dir="" durable=false ttl=24h0m0s max_per_context=50 max_tasks=2048 input_timeout=15m0s max_store_bytes=268435456\n`+
		`(?s:.*)level=INFO msg="a2a agent profile" name=support binary=nexus config=/\S+/support.yaml agent_card=`+q(b.Base)+`/agents/support/.well-known/agent-card.json jsonrpc=`+
		q(b.Base)+`/agents/support/a2a rest=`+q(b.Base)+`/agents/support/a2a/v1\n`), time.Second)
}

// TestA2AConversation: over each binding, blocking sends on one context
// continue one session, a stream reports the turn, get and list read the
// record back, and a fresh context gets a fresh session.
func TestA2AConversation(t *testing.T) {
	b := a2aBroker(t, "", Options{})
	for _, binding := range bindings {
		t.Run(string(binding), func(t *testing.T) {
			c := a2aClient(t, b, "support", binding)
			conv := "conv-" + string(binding)
			first := sendTask(t, c, userMsg(conv, "hello"))
			if got := answerOf(t, first); got != "echo #1: hello" {
				t.Errorf("first answer %q", got)
			}
			if first.ContextID != conv {
				t.Errorf("contextId %q, want %q", first.ContextID, conv)
			}
			b.GatewayLog.wait(t, regexp.MustCompile(`level=INFO msg="a2a turn started an agent instance" profile=support context_id=`+regexp.QuoteMeta(conv)+
				` session_id=[0-9a-f]+ lease_id=\S+ pid=[1-9][0-9]* binary=nexus resumed=false`), time.Second)
			second := sendTask(t, c, userMsg(conv, "again"))
			if got := answerOf(t, second); got != "echo #2: again (earlier: hello)" {
				t.Errorf("second answer %q: not the same session", got)
			}

			evs := events(t, c.SendStreamingMessage(ctxT(t), userMsg(conv, "streamed")))
			got := strings.Join(states(evs), ",")
			want := "task:TASK_STATE_SUBMITTED,TASK_STATE_WORKING,artifact:echo #3: streamed (earlier: again),TASK_STATE_COMPLETED"
			if got != want {
				t.Errorf("stream = %s\nwant     %s", got, want)
			}

			read, err := c.GetTask(ctxT(t), &a2a.GetTaskRequest{ID: first.ID})
			if err != nil || answerOf(t, read) != "echo #1: hello" {
				t.Errorf("GetTask = %+v, %v", read, err)
			}
			if a := read.Artifacts[0]; string(a.ID) != string(first.ID)+"-response" || a.Name != "response" {
				t.Errorf("the answer artifact is %q named %q, want upstream's <task id>-response named response", a.ID, a.Name)
			}
			// A tool approval request has no A2A meaning: the task is not
			// touched, and the gateway says so in upstream's WARN.
			appr := sendTask(t, c, userMsg("approve-"+string(binding), "/approve rm -rf /tmp/x"))
			if got := answerOf(t, appr); got != "approval requested for rm -rf /tmp/x" {
				t.Errorf("approval turn answered %q", got)
			}
			b.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="a2a ingress received a tool approval request it cannot express; the turn will wait for an approval no A2A client can send" profile=support task_id=`+
				regexp.QuoteMeta(string(appr.ID))+` prompt_id=[0-9a-f]+\n`), time.Second)
			// A message without contextId gets one minted.
			m := a2a.NewMessage(a2a.MessageRoleUser, a2a.NewTextPart("fresh"))
			fresh := sendTask(t, c, &a2a.SendMessageRequest{Message: m})
			if fresh.ContextID == "" || answerOf(t, fresh) != "echo #1: fresh" {
				t.Errorf("fresh context %q answered %q", fresh.ContextID, answerOf(t, fresh))
			}

			page1, err := c.ListTasks(ctxT(t), &a2a.ListTasksRequest{ContextID: conv, PageSize: 2})
			if err != nil {
				t.Fatal(err)
			}
			if page1.TotalSize != 3 || len(page1.Tasks) != 2 || page1.NextPageToken == "" {
				t.Fatalf("first page %+v", page1)
			}
			page2, err := c.ListTasks(ctxT(t), &a2a.ListTasksRequest{ContextID: conv, PageSize: 2, PageToken: page1.NextPageToken})
			if err != nil || len(page2.Tasks) != 1 || page2.NextPageToken != "" || page2.Tasks[0].ID != first.ID {
				t.Errorf("second page %+v, %v", page2, err)
			}
			_, err = c.GetTask(ctxT(t), &a2a.GetTaskRequest{ID: "no-such-task"})
			if !errors.Is(err, a2a.ErrTaskNotFound) || !strings.Contains(err.Error(), "Task not found") {
				t.Errorf("unknown task: %v, want TaskNotFound with upstream's text", err)
			}
		})
	}
}

// TestA2ASubscribeAndCancel: returnImmediately gives the task at once; a
// subscriber to the live task sees it finish; a finished one gives its state
// and the end; an INPUT_REQUIRED round trip answers via hitl; a parked task
// can be cancelled.
func TestA2ASubscribeAndCancel(t *testing.T) {
	b := a2aBroker(t, "", Options{})
	for _, binding := range bindings {
		t.Run(string(binding), func(t *testing.T) {
			c := a2aClient(t, b, "slow", binding)
			req := userMsg("sub-"+string(binding), "one two three")
			req.Config = &a2a.SendMessageConfig{ReturnImmediately: true}
			task := sendTask(t, c, req)
			if task.Status.State.Terminal() {
				t.Fatalf("returnImmediately answered a finished task %s", task.Status.State)
			}
			evs := events(t, c.SubscribeToTask(ctxT(t), &a2a.SubscribeToTaskRequest{ID: task.ID}))
			if s := states(evs); len(s) < 2 || !strings.HasPrefix(s[0], "task:") || s[len(s)-1] != "TASK_STATE_COMPLETED" {
				t.Errorf("live subscription = %v", s)
			}
			evs = events(t, c.SubscribeToTask(ctxT(t), &a2a.SubscribeToTaskRequest{ID: task.ID}))
			if s := states(evs); len(s) != 1 || s[0] != "task:TASK_STATE_COMPLETED" {
				t.Errorf("subscription to a finished task = %v", s)
			}

			// INPUT_REQUIRED and its answer.
			ask := sendTask(t, c, userMsg("ask-"+string(binding), "/ask proceed?"))
			if ask.Status.State != a2a.TaskStateInputRequired || ask.Status.Message == nil ||
				ask.Status.Message.Parts[0].Text() != "proceed?\n\nAnswer with one of these option ids:\n  yes — Yes\n  no — No" {
				t.Fatalf("ask task %s %+v", ask.Status.State, ask.Status.Message)
			}
			if id, _ := ask.Status.Message.Metadata["nexus.hitl.requestId"].(string); id == "" {
				t.Errorf("the question carries no nexus.hitl.requestId: %v", ask.Status.Message.Metadata)
			}
			// An answer naming another context is refused, in upstream's words.
			astray := a2a.NewMessageForTask(a2a.MessageRoleUser, ask, a2a.NewTextPart("yes"))
			astray.ContextID = "elsewhere"
			if _, err := c.SendMessage(ctxT(t), &a2a.SendMessageRequest{Message: astray}); !errors.Is(err, a2a.ErrUnsupportedOperation) || !strings.Contains(err.Error(),
				fmt.Sprintf("message names task %q but context \"elsewhere\"; a task is continued by naming the context it belongs to, %q", ask.ID, ask.ContextID)) {
				t.Errorf("an answer naming another context: %v", err)
			}
			reply := a2a.NewMessageForTask(a2a.MessageRoleUser, ask, a2a.NewTextPart("yes"))
			done := sendTask(t, c, &a2a.SendMessageRequest{Message: reply})
			if got := answerOf(t, done); got != "answered: yes" || done.ID != ask.ID {
				t.Errorf("answered task %s: %q", done.ID, got)
			}

			// Cancel a parked question.
			ask = sendTask(t, c, userMsg("cancel-"+string(binding), "/ask stop?"))
			canceled, err := c.CancelTask(ctxT(t), &a2a.CancelTaskRequest{ID: ask.ID})
			if err != nil || canceled.Status.State != a2a.TaskStateCanceled || statusText(canceled) != "the task was canceled by the client" {
				t.Fatalf("CancelTask = %+v, %v", canceled, err)
			}
			b.GatewayLog.wait(t, regexp.MustCompile(`level=INFO msg="a2a task canceled" profile=slow task_id=`+string(ask.ID)), time.Second)
			if _, err := c.CancelTask(ctxT(t), &a2a.CancelTaskRequest{ID: ask.ID}); !errors.Is(err, a2a.ErrTaskNotCancelable) ||
				!strings.Contains(err.Error(), "task is in terminal state CANCELED and cannot be canceled") {
				t.Errorf("cancelling a canceled task: %v", err)
			}
			// A message naming an ended task is refused in upstream's words.
			_, err = c.SendMessage(ctxT(t), &a2a.SendMessageRequest{Message: a2a.NewMessageForTask(a2a.MessageRoleUser, ask, a2a.NewTextPart("late"))})
			if !errors.Is(err, a2a.ErrUnsupportedOperation) || !strings.Contains(err.Error(), fmt.Sprintf("task %q has ended and accepts no further messages; send a message with no taskId to start a new task", ask.ID)) {
				t.Errorf("a message naming a canceled task: %v", err)
			}
			// The conversation still works after the cancel.
			after := sendTask(t, c, userMsg("cancel-"+string(binding), "still there"))
			if got := answerOf(t, after); !strings.HasPrefix(got, "echo #") {
				t.Errorf("after a cancel the conversation answered %q", got)
			}
		})
	}
}

// TestA2AQueue: a second message while the first runs is SUBMITTED and runs
// after it, in order; cancelling a queued task removes it.
func TestA2AQueue(t *testing.T) {
	b := a2aBroker(t, "", Options{})
	c := a2aClient(t, b, "slow", a2a.TransportProtocolJSONRPC)
	imm := func(text string) *a2a.Task { return sendNow(t, c, "q", text) }
	first := imm("first message here")
	second := imm("second")
	third := imm("third")
	if second.Status.State != a2a.TaskStateSubmitted {
		t.Errorf("queued task is %s, want SUBMITTED", second.Status.State)
	}
	// A message naming a task that is not parked on a question is refused.
	_, err := c.SendMessage(ctxT(t), &a2a.SendMessageRequest{Message: a2a.NewMessageForTask(a2a.MessageRoleUser, second, a2a.NewTextPart("early"))})
	if !errors.Is(err, a2a.ErrUnsupportedOperation) || !strings.Contains(err.Error(),
		fmt.Sprintf("task %q is not waiting for input; a message may only continue a task that reported INPUT_REQUIRED", second.ID)) {
		t.Errorf("a message naming a queued task: %v", err)
	}
	for i, task := range []*a2a.Task{second, third} {
		b.GatewayLog.wait(t, regexp.MustCompile(fmt.Sprintf(`level=WARN msg="a2a task queued behind the conversation's active turn" profile=slow task_id=%s context_id=q ahead=%d`, task.ID, i+1)), time.Second)
	}
	canceled, err := c.CancelTask(ctxT(t), &a2a.CancelTaskRequest{ID: third.ID})
	if err != nil || canceled.Status.State != a2a.TaskStateCanceled || statusText(canceled) != "the task was canceled by the client" {
		t.Fatalf("cancelling a queued task: %+v %v", canceled, err)
	}
	evs := events(t, c.SubscribeToTask(ctxT(t), &a2a.SubscribeToTaskRequest{ID: second.ID}))
	if s := states(evs); s[len(s)-1] != "TASK_STATE_COMPLETED" {
		t.Fatalf("second task stream %v", s)
	}
	got1, _ := c.GetTask(ctxT(t), &a2a.GetTaskRequest{ID: first.ID})
	got2, _ := c.GetTask(ctxT(t), &a2a.GetTaskRequest{ID: second.ID})
	if answerOf(t, got1) != "echo #1: first message here" || answerOf(t, got2) != "echo #2: second (earlier: first message here)" {
		t.Errorf("answers out of order: %q, %q", answerOf(t, got1), answerOf(t, got2))
	}
}

// TestA2AIdleReleaseContinues: after idle_timeout released the instance, the
// next message on the context re-spawns with -recall: same session, its
// transcript visible. Without a state_dir too, for as long as the gateway
// runs (the gateway forgets a quiet conversation; its binding is kept).
func TestA2AIdleReleaseContinues(t *testing.T) {
	for _, durable := range []bool{true, false} {
		t.Run(fmt.Sprintf("state_dir=%v", durable), func(t *testing.T) {
			b := a2aBroker(t, "idle_timeout: 1s\n", Options{StateDir: durable})
			c := a2aClient(t, b, "support", a2a.TransportProtocolHTTPJSON)
			answerOf(t, sendTask(t, c, userMsg("idle", "remember me")))
			eventually(t, 20*time.Second, func() string { return "the idle lease is still listed" }, func() bool {
				return len(b.leases().Leases) == 0
			})
			got := answerOf(t, sendTask(t, c, userMsg("idle", "who?")))
			if got != "echo #2: who? (earlier: remember me)" {
				t.Errorf("after an idle release the conversation answered %q", got)
			}
		})
	}
}

// TestA2ACrash: a crash mid-turn fails the task; a crash right after the
// answer completes it with the answer.
func TestA2ACrash(t *testing.T) {
	b := a2aBroker(t, "", Options{})
	c := a2aClient(t, b, "crashy", a2a.TransportProtocolJSONRPC)
	task := sendTask(t, c, userMsg("x", "boom now please"))
	if task.Status.State != a2a.TaskStateFailed || statusText(task) != "the agent instance exited with exit status 4 before the turn finished" {
		t.Errorf("crash mid-turn: %s %q", task.Status.State, statusText(task))
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`level=INFO msg="a2a agent instance stopped" lease_id=\S+`), time.Second)
	b.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="a2a task failed because its agent instance went away" profile=crashy task_id=`+
		string(task.ID)+` reason="the agent instance exited with exit status 4 before the turn finished"`), time.Second)
	c = a2aClient(t, b, "late", a2a.TransportProtocolJSONRPC)
	if got := answerOf(t, sendTask(t, c, userMsg("y", "answer first"))); got != "echo #1: answer first" {
		t.Errorf("crash after the answer: %q", got)
	}
}

// TestA2ARestart: after a gateway restart, finished tasks read back (a 100
// KiB answer byte-identical), the one in flight reads FAILED, and the next
// message of its conversation waits for the surviving instance to leave
// the interrupted turn.
func TestA2ARestart(t *testing.T) {
	b := a2aBroker(t, "", Options{StateDir: true})
	c := a2aClient(t, b, "support", a2a.TransportProtocolJSONRPC)
	big := sendTask(t, c, userMsg("big", "/big 10240"))
	want := strings.Repeat("0123456789", 10240)
	if got := answerOf(t, big); got != want {
		t.Fatalf("100 KiB answer came back as %d bytes", len(got))
	}
	slow := a2aClient(t, b, "slow", a2a.TransportProtocolJSONRPC)
	req := userMsg("inflight", strings.Repeat("word ", 40))
	req.Config = &a2a.SendMessageConfig{ReturnImmediately: true}
	inflight := sendTask(t, slow, req)
	eventually(t, 20*time.Second, func() string { return "the slow task never started working" }, func() bool {
		got, err := slow.GetTask(ctxT(t), &a2a.GetTaskRequest{ID: inflight.ID})
		return err == nil && got.Status.State == a2a.TaskStateWorking
	})
	b.KillGateway(syscall.SIGKILL)
	b.StartGateway()
	c = a2aClient(t, b, "support", a2a.TransportProtocolHTTPJSON)
	read, err := c.GetTask(ctxT(t), &a2a.GetTaskRequest{ID: big.ID})
	if err != nil {
		t.Fatal(err)
	}
	if got := answerOf(t, read); got != want {
		t.Errorf("after a restart the 100 KiB answer reads back as %d bytes, not byte-identical", len(got))
	}
	slow = a2aClient(t, b, "slow", a2a.TransportProtocolHTTPJSON)
	got, err := slow.GetTask(ctxT(t), &a2a.GetTaskRequest{ID: inflight.ID})
	if err != nil || got.Status.State != a2a.TaskStateFailed || got.Status.Message == nil ||
		got.Status.Message.Parts[0].Text() != "the broker stopped while this task was still running, so it will never complete" {
		t.Errorf("the in-flight task reads %+v, %v; want FAILED saying the broker stopped", got, err)
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`level=INFO msg="a2a context index opened" path=\S+/a2a-contexts.jsonl bindings=2 skipped_records=0\n`), time.Second)
	// Upstream's lines: the orphan settled, then the store opened.
	b.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="a2a tasks were left in flight by a previous broker and have been failed" tasks=1\n`+
		`.*level=INFO msg="a2a task store opened" path=\S+/a2a-tasks.jsonl tasks=2 settled_orphans=1 skipped_records=0\n`), time.Second)
	// The conversation carries on, on the instance that survived, which
	// is still inside the interrupted turn: it is told to cancel, and the
	// next message goes once it reports idle, so the two never mix (the
	// cancelled turn is not in the transcript, and none of its words are in
	// the answer).
	start := time.Now()
	ans := answerOf(t, sendTask(t, slow, userMsg("inflight", "next")))
	if ans != "echo #1: next" {
		t.Errorf("after the restart the conversation answered %q, want the new message's own turn", ans)
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`level=INFO msg="a2a turn adopted a live instance already running its session" profile=slow context_id=inflight session_id=[0-9a-f]+ lease_id=\S+ held_until_idle=true reported=`), time.Second)
	if took := time.Since(start); took >= 10*time.Second || strings.Contains(b.GatewayLog.String(), "did not report idle") {
		t.Errorf("the next message took %s: the instance's idle report did not release it", took)
	}
}
