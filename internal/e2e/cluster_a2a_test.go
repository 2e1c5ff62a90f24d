package e2e

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/a2aproject/a2a-go/v2/a2a"

	"github.com/nexus-broker/nexus-broker/internal/cluster"
)

// a2aCluster runs an embedded nats-server and one A2A broker pair per id
// with yaml added to each configuration (the harness calling as token),
// and waits until every broker hears every other.
func a2aCluster(t testing.TB, yaml, token string, ids ...string) map[string]*Broker {
	t.Helper()
	ns := startNATS(t, 0, nil)
	bs := map[string]*Broker{}
	for _, id := range ids {
		bs[id] = a2aBroker(t, yaml, Options{YAML: clusterYAML(id, ns.ClientURL()), StateDir: true, Advertise: true,
			Token: token, GatewayEnv: []string{clusterSecretEnv + "=" + clusterSecret}})
	}
	for _, b := range bs {
		b.waitPeers(len(ids) - 1)
	}
	return bs
}

// TestClusterA2AThroughNonOwners: a conversation started through A is
// streamed through B event by event (the task is still working on A when
// its first events arrive), read through C, and its queued task cancelled
// through B; another principal's task is the same not-found through a
// non-owner as on the owner; ListTasks through any broker gathers every
// broker's, and names the ones that did not answer.
func TestClusterA2AThroughNonOwners(t *testing.T) {
	bs := a2aCluster(t, staticAuthYAML, tokOps, "a", "b", "c")
	a, b, c := bs["a"], bs["b"], bs["c"]
	var aliceTasks []a2a.TaskID
	for _, binding := range bindings {
		t.Run(string(binding), func(t *testing.T) {
			viaA := a2aClientAs(t, a, "slow", binding, bearer(tokAlice))
			viaB := a2aClientAs(t, b, "slow", binding, bearer(tokAlice))
			viaC := a2aClientAs(t, c, "slow", binding, bearer(tokAlice))
			conv := "nonowner-" + string(binding)
			first := sendTask(t, viaA, userMsg(conv, "hello"))
			if got := answerOf(t, first); got != "echo #1: hello" {
				t.Fatalf("through A: %q", got)
			}

			var seen []string
			var streamed a2a.TaskID
			for ev, err := range viaB.SendStreamingMessage(ctxT(t), userMsg(conv, "one two three four five six")) {
				if err != nil {
					t.Fatalf("the stream through B failed after %v: %v", seen, err)
				}
				seen = append(seen, states([]a2a.Event{ev})...)
				if task, ok := ev.(*a2a.Task); ok {
					streamed = task.ID
				}
				if st, ok := ev.(*a2a.TaskStatusUpdateEvent); ok && st.Status.State == a2a.TaskStateWorking {
					// The event came as the owner stored it: the task is
					// not done there yet.
					now, err := viaC.GetTask(ctxT(t), &a2a.GetTaskRequest{ID: streamed})
					if err != nil || now.Status.State.Terminal() {
						t.Fatalf("when WORKING arrived through B, the task read through C was %+v, %v: the stream came when the task settled", now, err)
					}
				}
			}
			if got := strings.Join(seen, ","); got != "task:TASK_STATE_SUBMITTED,TASK_STATE_WORKING,artifact:echo #2: one two three four five six (earlier: hello),TASK_STATE_COMPLETED" {
				t.Fatalf("the stream through B = %s", got)
			}
			read, err := viaC.GetTask(ctxT(t), &a2a.GetTaskRequest{ID: streamed})
			if err != nil || answerOf(t, read) != "echo #2: one two three four five six (earlier: hello)" {
				t.Fatalf("GetTask through C = %+v, %v", read, err)
			}

			running := sendNow(t, viaA, conv, "a long turn to keep the conversation busy")
			queued := sendNow(t, viaA, conv, "queued")
			if queued.Status.State != a2a.TaskStateSubmitted {
				t.Fatalf("the second task is %s, want SUBMITTED (queued)", queued.Status.State)
			}
			canceled, err := viaB.CancelTask(ctxT(t), &a2a.CancelTaskRequest{ID: queued.ID})
			if err != nil || canceled.Status.State != a2a.TaskStateCanceled {
				t.Fatalf("CancelTask of a queued task through B = %+v, %v", canceled, err)
			}
			evs := events(t, viaC.SubscribeToTask(ctxT(t), &a2a.SubscribeToTaskRequest{ID: running.ID}))
			if s := states(evs); s[len(s)-1] != "TASK_STATE_COMPLETED" {
				t.Fatalf("SubscribeToTask through C = %v", s)
			}
			if n := len(b.Instances()) + len(c.Instances()); n != 0 {
				t.Fatalf("B and C run %d instances for A's conversation", n)
			}
			aliceTasks = append(aliceTasks, first.ID, streamed, running.ID, queued.ID)

			// bob naming alice's task through C answers exactly as bob
			// naming it on A, the owner: not found.
			for _, q := range []struct{ method, path, body string }{
				{"POST", "/agents/slow/a2a", `{"jsonrpc":"2.0","id":1,"method":"GetTask","params":{"id":"%s"}}`},
				{"POST", "/agents/slow/a2a", `{"jsonrpc":"2.0","id":1,"method":"CancelTask","params":{"id":"%s"}}`},
				{"GET", "/agents/slow/a2a/v1/tasks/%s", ""},
				{"GET", "/agents/slow/a2a/v1/tasks/%s:subscribe", ""},
			} {
				fill := strings.NewReplacer("%s", string(first.ID))
				onA, onABody := a.doAs(tokBob, q.method, fill.Replace(q.path), fill.Replace(q.body))
				viaC, viaCBody := c.doAs(tokBob, q.method, fill.Replace(q.path), fill.Replace(q.body))
				if onA != viaC || onABody != viaCBody || !strings.Contains(viaCBody, "TASK_NOT_FOUND") {
					t.Fatalf("bob's %s %s: on the owner %d %s, through C %d %s; want the same not-found", q.method, q.path, onA, onABody, viaC, viaCBody)
				}
			}
		})
	}

	// A conversation born on B: ListTasks through C holds A's and B's.
	bornOnB := sendTask(t, a2aClientAs(t, b, "slow", a2a.TransportProtocolJSONRPC, bearer(tokAlice)), userMsg("born-on-b", "fresh"))
	want := append(aliceTasks, bornOnB.ID)
	for _, binding := range bindings {
		list, err := a2aClientAs(t, c, "slow", binding, bearer(tokAlice)).ListTasks(ctxT(t), &a2a.ListTasksRequest{PageSize: 100})
		if err != nil {
			t.Fatalf("ListTasks through C (%s): %v", binding, err)
		}
		got := map[a2a.TaskID]bool{}
		for _, task := range list.Tasks {
			got[task.ID] = true
		}
		for _, id := range want {
			if !got[id] {
				t.Fatalf("ListTasks through C (%s) lacks task %s: %d tasks, total %d", binding, id, len(list.Tasks), list.TotalSize)
			}
		}
		if list.TotalSize != len(want) || len(list.Tasks) != len(want) {
			t.Fatalf("ListTasks through C (%s): %d tasks, total %d, want %d", binding, len(list.Tasks), list.TotalSize, len(want))
		}
	}
	if list, err := a2aClientAs(t, c, "slow", a2a.TransportProtocolJSONRPC, bearer(tokBob)).ListTasks(ctxT(t), &a2a.ListTasksRequest{}); err != nil || len(list.Tasks) != 0 {
		t.Fatalf("bob's ListTasks through C = %+v, %v; want none of alice's", list, err)
	}

	b.KillGateway(syscall.SIGKILL)
	a.waitPeers(1)
	req, _ := http.NewRequest("GET", a.Base+"/agents/slow/a2a/v1/tasks", nil)
	req.Header.Set("Authorization", "Bearer "+tokAlice)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("Nexus-Unreachable-Brokers") != "b" {
		t.Fatalf("ListTasks through A with B down: %d, Nexus-Unreachable-Brokers %q; want 200 naming b", resp.StatusCode, resp.Header.Get("Nexus-Unreachable-Brokers"))
	}
}

// TestClusterA2AOwnerLossIsExplicit: C's task and context ids name C; with
// C's gateway and spawnd killed, its task read through A and a message on
// either of its conversations (a context id C minted, one the client
// chose) answer "lease owner unavailable" in each binding's shape (never
// TASK_NOT_FOUND, never a new conversation on A), a task id naming a
// broker never heard from is TASK_NOT_FOUND, and nothing of C's appears
// on A or B; C restarted on its state_dir serves the task through A and
// both conversations continue there, on their sessions.
func TestClusterA2AOwnerLossIsExplicit(t *testing.T) {
	bs := a2aCluster(t, "", "", "a", "b", "c")
	a, b, c := bs["a"], bs["b"], bs["c"]
	onC := a2aClient(t, c, "support", a2a.TransportProtocolJSONRPC)
	minted := sendTask(t, onC, userMsg("", "hello"))
	chosen := sendTask(t, onC, userMsg("chosen-on-c", "hi"))
	for _, id := range []string{string(minted.ID), minted.ContextID, string(chosen.ID)} {
		if cluster.Owner(id) != "c" || url.PathEscape(id) != id {
			t.Fatalf("id %q minted by C does not name C as a URL-safe token", id)
		}
	}
	sessions := map[string]string{} // lease → session, on C
	eventually(t, 10*time.Second, func() string { return "C's two conversations have not both reported a session" }, func() bool {
		for _, l := range c.leases().Leases {
			sessions[l.LeaseID] = l.SessionID
		}
		return len(sessions) == 2 && !slices.Contains(slices.Collect(maps.Values(sessions)), "")
	})
	index := filepath.Join(c.Dir, "state", "a2a-contexts.jsonl")
	eventually(t, 10*time.Second, func() string { return "a2a-contexts.jsonl lacks C's conversations" }, func() bool {
		data, _ := os.ReadFile(index)
		return strings.Contains(string(data), minted.ContextID) && strings.Contains(string(data), "chosen-on-c")
	})

	c.KillGateway(syscall.SIGKILL)
	c.KillSpawnd(syscall.SIGKILL)
	a.waitPeers(1)
	b.waitPeers(1)
	unavailable := func(what string, err error) {
		t.Helper()
		if !errors.Is(err, a2a.ErrServerError) || !strings.Contains(err.Error(), "lease owner unavailable") {
			t.Fatalf("%s with C down: %v; want the server error \"lease owner unavailable\"", what, err)
		}
	}
	for _, binding := range bindings {
		for _, via := range []*Broker{a, b} {
			cl := a2aClient(t, via, "support", binding)
			_, err := cl.GetTask(ctxT(t), &a2a.GetTaskRequest{ID: minted.ID})
			unavailable(fmt.Sprintf("GetTask of C's task through %s (%s)", via.Base, binding), err)
			_, err = cl.CancelTask(ctxT(t), &a2a.CancelTaskRequest{ID: chosen.ID})
			unavailable("CancelTask of C's task ("+string(binding)+")", err)
			for _, conv := range []string{minted.ContextID, "chosen-on-c"} {
				_, err = cl.SendMessage(ctxT(t), userMsg(conv, "while C is down"))
				unavailable("SendMessage on C's conversation "+conv+" ("+string(binding)+")", err)
				for _, err = range cl.SendStreamingMessage(ctxT(t), userMsg(conv, "streamed while C is down")) {
					break
				}
				unavailable("SendStreamingMessage on C's conversation "+conv+" ("+string(binding)+")", err)
			}
			never := a2a.TaskID("0123456789abcdef0123456789abcdef-zz")
			if _, err := cl.GetTask(ctxT(t), &a2a.GetTaskRequest{ID: never}); !errors.Is(err, a2a.ErrTaskNotFound) {
				t.Fatalf("GetTask of a task naming a broker never heard from (%s): %v, want TASK_NOT_FOUND", binding, err)
			}
		}
	}
	// The shapes on the wire: JSON-RPC's -32000 server error, HTTP+JSON's 503.
	get := `{"jsonrpc":"2.0","id":7,"method":"GetTask","params":{"id":"` + string(minted.ID) + `"}}`
	if st, body := a.do("POST", "/agents/support/a2a", get); st != 200 || !strings.Contains(body, `"code":-32000,"message":"lease owner unavailable"`) || !strings.Contains(body, `"id":7`) {
		t.Fatalf("JSON-RPC GetTask of C's task through A = %d %s", st, body)
	}
	st, body := a.get("/agents/support/a2a/v1/tasks/" + string(minted.ID))
	var rest struct {
		Error struct{ Status, Message string }
	}
	if st != 503 || json.Unmarshal([]byte(body), &rest) != nil || rest.Error.Status != "UNAVAILABLE" || rest.Error.Message != "lease owner unavailable" {
		t.Fatalf("HTTP+JSON GetTask of C's task through A = %d %s", st, body)
	}
	// A profile no broker serves is unknown before any owner is asked.
	if st, body := a.do("POST", "/agents/nosuch/a2a", get); st != 404 || !strings.Contains(body, "unknown agent profile") {
		t.Fatalf("JSON-RPC GetTask of C's task on an unknown profile through A = %d %s, want 404 unknown agent profile", st, body)
	}

	// Nothing of C's, and nothing started for C's conversations, on A or B.
	for _, via := range []*Broker{a, b} {
		resp, err := http.Get(via.Base + "/agents/support/a2a/v1/tasks")
		if err != nil {
			t.Fatal(err)
		}
		var list struct{ Tasks []json.RawMessage }
		err = json.NewDecoder(resp.Body).Decode(&list)
		resp.Body.Close()
		if err != nil || resp.StatusCode != 200 || len(list.Tasks) != 0 || resp.Header.Get("Nexus-Unreachable-Brokers") != "c" {
			t.Fatalf("ListTasks through %s with C down: %d, %d tasks (%v), unreachable %q; want none, naming c",
				via.Base, resp.StatusCode, len(list.Tasks), err, resp.Header.Get("Nexus-Unreachable-Brokers"))
		}
		st, body := via.get("/leases")
		var v struct {
			Leases             []json.RawMessage `json:"leases"`
			UnreachableBrokers []string          `json:"unreachable_brokers"`
		}
		if st != 200 || json.Unmarshal([]byte(body), &v) != nil || len(v.Leases) != 0 || fmt.Sprint(v.UnreachableBrokers) != "[c]" {
			t.Fatalf("GET /leases through %s with C down = %d %s; want no lease, naming c", via.Base, st, body)
		}
	}
	if n := len(a.Instances()) + len(b.Instances()); n != 0 {
		t.Fatalf("A and B run %d instances while C is down", n)
	}

	c.StartSpawnd()
	c.StartGateway(clusterSecretEnv + "=" + clusterSecret)
	a.waitPeers(2)
	viaA := a2aClient(t, a, "support", a2a.TransportProtocolHTTPJSON)
	if got, err := viaA.GetTask(ctxT(t), &a2a.GetTaskRequest{ID: minted.ID}); err != nil || answerOf(t, got) != "echo #1: hello" {
		t.Fatalf("GetTask of C's task through A after C's restart = %+v, %v", got, err)
	}
	again := sendTask(t, viaA, userMsg(minted.ContextID, "again"))
	if got := answerOf(t, again); got != "echo #2: again (earlier: hello)" || cluster.Owner(string(again.ID)) != "c" {
		t.Fatalf("C's minted conversation through A after C's restart answered %q in task %s; want it continued on C", got, again.ID)
	}
	if got := answerOf(t, sendTask(t, viaA, userMsg("chosen-on-c", "more"))); got != "echo #2: more (earlier: hi)" {
		t.Fatalf("C's client-chosen conversation through A after C's restart answered %q; want it continued on C", got)
	}
	if n := len(a.Instances()) + len(b.Instances()); n != 0 {
		t.Fatalf("A and B run %d instances for C's conversations", n)
	}
	for _, l := range c.leases().Leases {
		if s, ok := sessions[l.LeaseID]; ok && s != l.SessionID || !slices.Contains(slices.Collect(maps.Values(sessions)), l.SessionID) {
			t.Fatalf("after C's restart its lease %s runs session %s; want one of %v", l.LeaseID, l.SessionID, sessions)
		}
	}
}

// TestClusterA2ARememberedOwnerIsUnavailable: B stops cleanly (it leaves
// A's list; its task stays in its state_dir) and A restarts, so A has not
// heard B since its boot. B is in A's membership record: B's task through
// A is "lease owner unavailable", never TASK_NOT_FOUND; a task id naming a
// broker in neither is still TASK_NOT_FOUND.
func TestClusterA2ARememberedOwnerIsUnavailable(t *testing.T) {
	bs := a2aCluster(t, "", "", "a", "b")
	a, b := bs["a"], bs["b"]
	task := sendTask(t, a2aClient(t, b, "support", a2a.TransportProtocolJSONRPC), userMsg("", "hello"))
	b.KillGateway(syscall.SIGTERM)
	a.KillGateway(syscall.SIGTERM)
	a.StartGateway(clusterSecretEnv + "=" + clusterSecret)
	st, body := a.get("/agents/support/a2a/v1/tasks/" + string(task.ID))
	if st != 503 || !strings.Contains(body, "lease owner unavailable") {
		t.Fatalf("B's task through a restarted A that remembers B: %d %s, want 503 lease owner unavailable", st, body)
	}
	if st, body := a.get("/agents/support/a2a/v1/tasks/0123456789abcdef0123456789abcdef-zz"); st != 404 {
		t.Fatalf("a task naming a broker never heard: %d %s, want 404", st, body)
	}
}
