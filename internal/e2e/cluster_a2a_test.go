package e2e

import (
	"net/http"
	"strings"
	"syscall"
	"testing"

	"github.com/a2aproject/a2a-go/v2/a2a"
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
