package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/a2aproject/a2a-go/v2/a2a"
	"github.com/a2aproject/a2a-go/v2/a2aclient"

	"github.com/nexus-broker/nexus-broker/internal/sockdir"
)

// statusText is a settled task's status message.
func statusText(task *a2a.Task) string {
	if m := task.Status.Message; m != nil && len(m.Parts) > 0 {
		return m.Parts[0].Text()
	}
	return ""
}

// tasksOf lists a context's tasks, newest first.
func tasksOf(t *testing.T, c *a2aclient.Client, contextID string) []*a2a.Task {
	t.Helper()
	list, err := c.ListTasks(ctxT(t), &a2a.ListTasksRequest{ContextID: contextID, IncludeArtifacts: true})
	if err != nil {
		t.Fatalf("ListTasks: %v", err)
	}
	return list.Tasks
}

// settledTask waits until task id is terminal and returns it.
func settledTask(t *testing.T, c *a2aclient.Client, id a2a.TaskID) *a2a.Task {
	t.Helper()
	var task *a2a.Task
	eventually(t, 30*time.Second, func() string { return fmt.Sprintf("task %s still %+v", id, task) }, func() bool {
		got, err := c.GetTask(ctxT(t), &a2a.GetTaskRequest{ID: id})
		if err == nil && got.Status.State.Terminal() {
			task = got
		}
		return task != nil
	})
	return task
}

// TestA2AContinuityAfterRestart: a conversation whose instance is gone
// continues after a gateway restart: the new gateway has nothing of it in
// memory, finds its session in a2a-contexts.jsonl and re-spawns with
// -recall, so the instance runs the same session and sees its transcript.
// The "lazy" profile's instance reports its session id only after its
// first answer and after session_report_grace: the binding is written
// when the report comes, however late.
func TestA2AContinuityAfterRestart(t *testing.T) {
	for _, profile := range []string{"support", "lazy"} {
		t.Run(profile, func(t *testing.T) { continuityAfterRestart(t, profile) })
	}
}

func continuityAfterRestart(t *testing.T, profile string) {
	b := a2aBroker(t, "session_report_grace: 100ms\n", Options{StateDir: true})
	c := a2aClient(t, b, profile, a2a.TransportProtocolJSONRPC)
	if got := answerOf(t, sendTask(t, c, userMsg("keep", "first words"))); got != "echo #1: first words" {
		t.Fatalf("first answer %q", got)
	}
	var session string
	eventually(t, 10*time.Second, func() string { return "the instance's session id never reached GET /leases" }, func() bool {
		leases := b.leases().Leases
		if len(leases) != 1 {
			t.Fatalf("want one A2A lease, GET /leases has %+v", leases)
		}
		session = leases[0].SessionID
		return session != ""
	})
	contexts := filepath.Join(b.Dir, "state", "a2a-contexts.jsonl")
	var index []byte
	eventually(t, 10*time.Second, func() string {
		return fmt.Sprintf("a2a-contexts.jsonl does not bind the context to session %s:\n%s", session, index)
	}, func() bool {
		index, _ = os.ReadFile(contexts)
		return strings.Contains(string(index), session)
	})

	// The gateway goes, and while it is away the instance goes too.
	b.KillGateway(syscall.SIGKILL)
	pids := b.Instances()
	if len(pids) != 1 {
		t.Fatalf("want the conversation's one instance, found pids %v", pids)
	}
	if err := syscall.Kill(pids[0], syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	eventually(t, 20*time.Second, func() string { return "the killed instance is still there" }, func() bool { return len(b.Instances()) == 0 })
	b.StartGateway()
	if n := len(b.leases().Leases); n != 0 {
		t.Fatalf("the restarted gateway restored %d leases of a dead instance", n)
	}

	c = a2aClient(t, b, profile, a2a.TransportProtocolHTTPJSON)
	if got := answerOf(t, sendTask(t, c, userMsg("keep", "second"))); got != "echo #2: second (earlier: first words)" {
		t.Errorf("after a restart with the instance gone the conversation answered %q, want its transcript continued", got)
	}
	leases := b.leases().Leases
	if len(leases) != 1 || leases[0].SessionID != session {
		t.Errorf("the conversation runs on %+v, want one lease of session %s", leases, session)
	}
	// Another context is another conversation: a fresh session.
	if got := answerOf(t, sendTask(t, c, userMsg("other", "hello"))); got != "echo #1: hello" {
		t.Errorf("a new context answered %q", got)
	}
}

// TestA2ATaskCap: the store holds at most 2048 tasks; past that the oldest
// finished ones go first, whatever their conversation. The store is
// preloaded with 2048 finished tasks (as a previous run would have left
// it); new messages push the oldest out and the count stays at the cap.
func TestA2ATaskCap(t *testing.T) {
	const limit = 2048
	dir := t.TempDir()
	state := filepath.Join(dir, "state")
	if err := os.MkdirAll(state, 0o700); err != nil {
		t.Fatal(err)
	}
	var lines strings.Builder
	base := time.Now().Add(-time.Hour)
	id := func(i int) string { return fmt.Sprintf("00000000-0000-4000-8000-%012d", i) }
	for i := range limit {
		at := base.Add(time.Duration(i) * time.Millisecond)
		rec := map[string]any{"principal": "", "profile": "support", "created": at, "updated": at, "task": map[string]any{
			"id": id(i), "contextId": fmt.Sprintf("old-%d", i%64),
			"status":    map[string]any{"state": "TASK_STATE_COMPLETED", "timestamp": at},
			"artifacts": []any{map[string]any{"artifactId": "a", "name": "answer", "parts": []any{map[string]any{"text": "old answer"}}}},
		}}
		line, _ := json.Marshal(rec)
		lines.Write(line)
		lines.WriteByte('\n')
	}
	lines.WriteString(`{"principal":"","profile":"supp`) // torn by a crash mid-write
	if err := os.WriteFile(filepath.Join(state, "a2a-tasks.jsonl"), []byte(lines.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	b := a2aBroker(t, "", Options{StateDir: true, Dir: dir})
	b.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="skipped unreadable a2a task records; the broker was most likely killed mid-write" path=\S+/a2a-tasks.jsonl skipped=1 read=2048 first_line=2049 error=`), time.Second)
	b.GatewayLog.wait(t, regexp.MustCompile(`level=INFO msg="a2a task store opened" path=\S+/a2a-tasks.jsonl tasks=2048 settled_orphans=0 skipped_records=1\n`), time.Second)
	c := a2aClient(t, b, "support", a2a.TransportProtocolJSONRPC)
	total := func() int {
		list, err := c.ListTasks(ctxT(t), &a2a.ListTasksRequest{PageSize: 1})
		if err != nil {
			t.Fatal(err)
		}
		return list.TotalSize
	}
	if n := total(); n != limit {
		t.Fatalf("the preloaded store lists %d tasks, want %d", n, limit)
	}
	const fresh = 3
	var newest *a2a.Task
	for i := range fresh {
		newest = sendTask(t, c, userMsg("new", fmt.Sprintf("message %d", i)))
		answerOf(t, newest)
	}
	if n := total(); n != limit {
		t.Errorf("after %d more tasks the store lists %d, want it to stay at %d", fresh, n, limit)
	}
	for i := range fresh {
		if _, err := c.GetTask(ctxT(t), &a2a.GetTaskRequest{ID: a2a.TaskID(id(i))}); !errors.Is(err, a2a.ErrTaskNotFound) {
			t.Errorf("the oldest task %s still reads back (%v)", id(i), err)
		}
	}
	for _, i := range []int{fresh, limit - 1} {
		if _, err := c.GetTask(ctxT(t), &a2a.GetTaskRequest{ID: a2a.TaskID(id(i))}); err != nil {
			t.Errorf("task %s, not among the oldest, was dropped: %v", id(i), err)
		}
	}
	if got, err := c.GetTask(ctxT(t), &a2a.GetTaskRequest{ID: newest.ID}); err != nil || answerOf(t, got) != "echo #3: message 2 (earlier: message 1)" {
		t.Errorf("the newest task reads back %+v, %v", got, err)
	}
	// And so after a restart: the file was compacted to the cap.
	b.KillGateway(syscall.SIGTERM)
	b.StartGateway()
	c = a2aClient(t, b, "support", a2a.TransportProtocolHTTPJSON)
	if n := total(); n != limit {
		t.Errorf("after a restart the store lists %d tasks, want %d", n, limit)
	}
}

// TestA2APrincipalCaps: A2A leases are counted against the per-principal
// caps like claimed ones. A message that would need a lease over the cap
// settles REJECTED saying so (a refusal, not a failed spawn; never naming
// a lease), a claim over it answers 429, and other principals are still
// served; a spawn queued for capacity counts against
// max_queued_per_principal.
func TestA2APrincipalCaps(t *testing.T) {
	b := a2aBroker(t, staticAuthYAML+"max_concurrent: 3\nmax_leases_per_principal: 2\nmax_queued_per_principal: 1\nqueue_wait_timeout: 1m\n", Options{Token: tokOps})
	alice := a2aClientAs(t, b, "support", a2a.TransportProtocolJSONRPC, bearer(tokAlice))
	bob := a2aClientAs(t, b, "support", a2a.TransportProtocolHTTPJSON, bearer(tokBob))
	carol := a2aClientAs(t, b, "support", a2a.TransportProtocolJSONRPC, bearer(tokCarol))

	answerOf(t, sendTask(t, alice, userMsg("a1", "hello")))
	answerOf(t, sendTask(t, alice, userMsg("a2", "hello")))
	over := sendTask(t, alice, userMsg("a3", "a third conversation"))
	if over.Status.State != a2a.TaskStateRejected || !strings.Contains(statusText(over), "lease limit reached for this principal") {
		t.Errorf("alice's third conversation over max_leases_per_principal: %s %q", over.Status.State, statusText(over))
	}
	for _, l := range b.leases().Leases {
		if strings.Contains(statusText(over), l.LeaseID) {
			t.Errorf("the status message names a lease: %q", statusText(over))
		}
	}
	code, body := b.doAs(tokAlice, "POST", "/claim", `{"config":"engine: {}\n"}`)
	wantAnswer(t, "alice's claim beside her A2A lease", code, body, 429, `{"error":"lease limit reached for this principal"}`+"\n")
	// Her first conversation still runs on its lease.
	if got := answerOf(t, sendTask(t, alice, userMsg("a1", "again"))); got != "echo #2: again (earlier: hello)" {
		t.Errorf("alice's first conversation answered %q", got)
	}
	answerOf(t, sendTask(t, bob, userMsg("b1", "bob here"))) // the last slot

	// Capacity is full: carol's first spawn queues, her second is refused
	// (her lease cap would allow it).
	queued := userMsg("c1", "carol waits")
	queued.Config = &a2a.SendMessageConfig{ReturnImmediately: true}
	waiting := sendTask(t, carol, queued)
	b.waitQueueDepth(1, 10*time.Second)
	refused := sendTask(t, carol, userMsg("c2", "and again"))
	if refused.Status.State != a2a.TaskStateRejected || !strings.Contains(statusText(refused), "queued claim limit reached for this principal") {
		t.Errorf("carol's second queued spawn: %s %q", refused.Status.State, statusText(refused))
	}
	// A freed slot goes to carol's queued spawn, and her task runs.
	var aliceLease string
	_, mine := b.doAs(tokAlice, "GET", "/leases", "")
	if m := regexp.MustCompile(`"lease_id":"([0-9a-f]+)"`).FindStringSubmatch(mine); m != nil {
		aliceLease = m[1]
	}
	if code, body := b.doAs(tokAlice, "POST", "/release/"+aliceLease, ""); code != 200 {
		t.Fatalf("alice releasing her A2A lease %q: %d %s", aliceLease, code, body)
	}
	if got := answerOf(t, settledTask(t, carol, waiting.ID)); got != "echo #1: carol waits" {
		t.Errorf("carol's queued task answered %q", got)
	}
}

// TestA2AHangUpKeepsTheMessage: a client that hangs up has not withdrawn
// its message, whether it was running (a blocking send, a stream left
// mid-way) or still queued: each task runs and reads back COMPLETED with
// its answer, in order.
func TestA2AHangUpKeepsTheMessage(t *testing.T) {
	b := a2aBroker(t, "", Options{})
	c := a2aClient(t, b, "slow", a2a.TransportProtocolJSONRPC)
	rest := a2aClient(t, b, "slow", a2a.TransportProtocolHTTPJSON)

	// send starts a blocking send on context "h" that hangs up when told,
	// once state is the newest task's.
	send := func(text string, n int, state a2a.TaskState) (hangUp func(), done chan error) {
		ctx, hangUp := context.WithCancel(context.Background())
		done = make(chan error, 1)
		go func() {
			_, err := c.SendMessage(ctx, userMsg("h", text))
			done <- err
		}()
		eventually(t, 20*time.Second, func() string { return fmt.Sprintf("%q never reached %s", text, state) }, func() bool {
			ts := tasksOf(t, rest, "h")
			return len(ts) == n && ts[0].Status.State == state
		})
		return hangUp, done
	}
	// One hangs up while its task works, one while its task is queued.
	hangUp, done := send("one two three", 1, a2a.TaskStateWorking)
	hangUpQueued, queuedDone := send("queued", 2, a2a.TaskStateSubmitted)
	hangUp()
	hangUpQueued()
	for _, ch := range []chan error{done, queuedDone} {
		if err := <-ch; !errors.Is(err, context.Canceled) {
			t.Errorf("a hung-up send returned %v, want the client's cancellation", err)
		}
	}
	// A stream left after its first WORKING event.
	for ev, err := range rest.SendStreamingMessage(ctxT(t), userMsg("h", "streamed")) {
		if err != nil {
			t.Fatal(err)
		}
		if su, ok := ev.(*a2a.TaskStatusUpdateEvent); ok && su.Status.State == a2a.TaskStateWorking {
			break
		}
	}

	ts := tasksOf(t, rest, "h")
	if len(ts) != 3 {
		t.Fatalf("the context lists %d tasks, want 3", len(ts))
	}
	want := []string{"echo #3: streamed (earlier: queued)", "echo #2: queued (earlier: one two three)", "echo #1: one two three"}
	for i, task := range ts {
		if got := answerOf(t, settledTask(t, rest, task.ID)); got != want[i] {
			t.Errorf("task %d answered %q, want %q", i, got, want[i])
		}
	}
}

// TestA2AMissingProfileConfigRefusesTheBoot: a profile whose config file is
// missing refuses the gateway's boot, naming the profile and the path, and
// the port never answers.
func TestA2AMissingProfileConfigRefusesTheBoot(t *testing.T) {
	b := a2aBroker(t, "", Options{})
	b.KillGateway(syscall.SIGTERM)
	missing := filepath.Join(b.Dir, "no-such-agent.yaml")
	out := refusedBoot(t, b, "a missing agent config", func(text string) string {
		return regexp.MustCompile(`(?m)^(  support:\n    config: )"[^"]*"`).ReplaceAllString(text, fmt.Sprintf("${1}%q", missing))
	}, "agents.support.config", missing, "no such file or directory")
	if strings.Contains(out, "nexus-broker listening") {
		t.Errorf("the gateway announced itself before refusing:\n%s", out)
	}
	if c, err := net.DialTimeout("tcp", b.Addr, time.Second); err == nil {
		c.Close()
		t.Errorf("something listens on the refused gateway's port")
	}
}

// refusedBoot rewrites b's stopped gateway's config with edit and starts
// the gateway on it, which must refuse to boot saying each of wants; it
// returns what the gateway said.
func refusedBoot(t *testing.T, b *Broker, what string, edit func(string) string, wants ...string) string {
	t.Helper()
	text, err := os.ReadFile(b.ConfigPath)
	if err != nil {
		t.Fatal(err)
	}
	edited := edit(string(text))
	if edited == string(text) {
		t.Fatalf("%s: the edit changed nothing in:\n%s", what, text)
	}
	if err := os.WriteFile(b.ConfigPath, []byte(edited), 0o600); err != nil {
		t.Fatal(err)
	}
	code, out := runToExit(t, b.env, "nexus-broker", "-config", b.ConfigPath, "-launch-spawnd=false")
	refused(t, what, code, out, wants...)
	return out
}

// TestA2AAdoptsAnIdleInstanceAtOnce: after a gateway restart the next
// message of a conversation whose instance was idle goes to the surviving
// instance at once, not after the bound kept for an instance that never
// says it is idle.
func TestA2AAdoptsAnIdleInstanceAtOnce(t *testing.T) {
	b := a2aBroker(t, "", Options{StateDir: true})
	c := a2aClient(t, b, "support", a2a.TransportProtocolJSONRPC)
	answerOf(t, sendTask(t, c, userMsg("warm", "one")))
	pids := b.Instances()
	b.KillGateway(syscall.SIGKILL)
	b.StartGateway()
	c = a2aClient(t, b, "support", a2a.TransportProtocolJSONRPC)
	start := time.Now()
	got := answerOf(t, sendTask(t, c, userMsg("warm", "two")))
	took := time.Since(start)
	if got != "echo #2: two (earlier: one)" {
		t.Errorf("after the restart the conversation answered %q", got)
	}
	if now := b.Instances(); len(now) != 1 || now[0] != pids[0] {
		t.Errorf("the conversation runs on instances %v, want the surviving %v", now, pids)
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`level=INFO msg="a2a turn adopted a live instance already running its session" profile=support context_id=warm session_id=[0-9a-f]+ lease_id=\S+ held_until_idle=false`), time.Second)
	// The bound for an instance that never reports idle is 10 s.
	if took >= 10*time.Second || strings.Contains(b.GatewayLog.String(), "held_until_idle=true") {
		t.Errorf("the message took %s after the restart: it was held for an idle report an idle instance never sends", took)
	}
}

// TestA2AStateDirOfItsOwn: in the production split state_dir is
// nexus-spawnd's (root, 0700) and the gateway cannot write there, so
// a2a.state_dir gives the task store and the context index a directory of
// the gateway's own: created 0700, nothing A2A in state_dir, and tasks read
// back from it after a restart. One another user created first refuses
// the boot, naming the key, and is left as it was.
func TestA2AStateDirOfItsOwn(t *testing.T) {
	own := filepath.Join(t.TempDir(), "gateway-state")
	b := a2aBroker(t, fmt.Sprintf("a2a:\n  state_dir: %q\n", own), Options{StateDir: true})
	c := a2aClient(t, b, "support", a2a.TransportProtocolJSONRPC)
	task := sendTask(t, c, userMsg("own", "hello"))
	if got := answerOf(t, task); got != "echo #1: hello" {
		t.Fatalf("answer %q", got)
	}
	st, err := os.Lstat(own)
	if err != nil || !st.IsDir() || st.Mode().Perm() != 0o700 {
		t.Fatalf("a2a.state_dir %s: %v, %v; want a directory of mode 0700", own, st, err)
	}
	for _, name := range []string{"a2a-tasks.jsonl", "a2a-contexts.jsonl"} {
		if _, err := os.Stat(filepath.Join(own, name)); err != nil {
			t.Errorf("%s is not in a2a.state_dir: %v", name, err)
		}
		if _, err := os.Stat(filepath.Join(b.Dir, "state", name)); err == nil {
			t.Errorf("%s was written to state_dir although a2a.state_dir is set", name)
		}
	}
	b.KillGateway(syscall.SIGKILL)
	b.StartGateway()
	c = a2aClient(t, b, "support", a2a.TransportProtocolHTTPJSON)
	read, err := c.GetTask(ctxT(t), &a2a.GetTaskRequest{ID: task.ID})
	if err != nil || answerOf(t, read) != "echo #1: hello" {
		t.Fatalf("after a restart the task reads back as %+v, %v", read, err)
	}

	b.KillGateway(syscall.SIGTERM)
	shared := sockdir.New(t, "nxa")
	if err := os.Chmod(shared, 0o1777); err != nil { // as shared as /tmp
		t.Fatal(err)
	}
	planted := filepath.Join(shared, "planted")
	asNobody(t, "mkdir", "-m", "0777", planted)
	refusedBoot(t, b, "an a2a.state_dir another user created", func(text string) string {
		return strings.Replace(text, fmt.Sprintf("state_dir: %q", own), fmt.Sprintf("state_dir: %q", planted), 1)
	}, "a2a.state_dir", planted, "owned by uid 65534")
	if st, err := os.Lstat(planted); err != nil || st.Mode().Perm() != 0o777 || st.Sys().(*syscall.Stat_t).Uid != 65534 {
		t.Errorf("the planted directory was touched: %v, %v", st, err)
	}
	if entries, _ := os.ReadDir(planted); len(entries) != 0 {
		t.Errorf("the refused gateway wrote into the planted directory: %v", entries)
	}
}

// TestA2AStateDirUnderHome: a state_dir written with a leading ~ (the
// spec's own example, "~/.nexus/broker") is the same directory to both
// processes: the lease journal and the A2A files land under $HOME, and
// nothing is created in the gateway's working directory.
func TestA2AStateDirUnderHome(t *testing.T) {
	b := a2aBroker(t, "state_dir: \"~/broker-state\"\n", Options{})
	c := a2aClient(t, b, "support", a2a.TransportProtocolJSONRPC)
	if got := answerOf(t, sendTask(t, c, userMsg("home", "hello"))); got != "echo #1: hello" {
		t.Fatalf("answer %q", got)
	}
	dir := filepath.Join(b.Home, "broker-state")
	for _, name := range []string{"leases.jsonl", "a2a-tasks.jsonl", "a2a-contexts.jsonl"} {
		if _, err := os.Stat(filepath.Join(dir, name)); err != nil {
			t.Errorf("%s is not in $HOME/broker-state: %v", name, err)
		}
	}
	if _, err := os.Stat("~"); err == nil {
		_ = os.RemoveAll("~") // what the failure left, not the source tree's
		t.Errorf("a directory named ~ was created in the gateway's working directory")
	}
}
