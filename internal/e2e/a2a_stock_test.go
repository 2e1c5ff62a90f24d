package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"testing"
	"time"

	"github.com/a2aproject/a2a-go/v2/a2a"
)

// stockBroker serves "stock" and "stockslow": nexus-echo sending its status
// payloads without turn_id, exactly as the stock broker plugin does (its
// deltas, stream ends and questions name their turn); stockslow waits 30 s
// before its first delta, so a turn is caught before any turn id.
func stockBroker(t *testing.T) *Broker {
	t.Helper()
	cfg := filepath.Join(t.TempDir(), "stock.yaml")
	if err := os.WriteFile(cfg, []byte("engine:\n  name: stock\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return startBroker(t, Options{YAML: fmt.Sprintf(`  stock:
    path: %q
    env: {NEXUS_ECHO_STOCK_STATUS: "1"}
  stockslow:
    path: %q
    env: {NEXUS_ECHO_STOCK_STATUS: "1", NEXUS_ECHO_SLOW_TURN: 30s}
agents:
  stock: {binary: stock, config: %q, card: {name: S, description: D, version: "1"}}
  stockslow: {binary: stockslow, config: %q, card: {name: W, description: D, version: "1"}}
`, bin("nexus-echo"), bin("nexus-echo"), cfg, cfg)})
}

// TestA2AStockStatusWorking: over an instance whose statuses name no turn,
// the task is WORKING on the instance's first status, before any delta;
// cancelled there it goes SUBMITTED → WORKING → CANCELED; a turn ends on a
// status idle that names no turn.
func TestA2AStockStatusWorking(t *testing.T) {
	b := stockBroker(t)
	for _, binding := range bindings {
		t.Run(string(binding), func(t *testing.T) {
			c := a2aClient(t, b, "stock", binding)
			if got := answerOf(t, sendTask(t, c, userMsg("done-"+string(binding), "one two"))); got != "echo #1: one two" {
				t.Errorf("answer over stock statuses: %q", got)
			}

			c = a2aClient(t, b, "stockslow", binding)
			ctx := ctxT(t)
			var seen []string
			var task a2a.TaskID
			// Well before the first delta (30 s): WORKING must not wait for it.
			soon, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			for ev, err := range c.SendStreamingMessage(soon, userMsg("slow-"+string(binding), "never answered")) {
				if err != nil {
					t.Fatalf("stream failed after %v: %v", seen, err)
				}
				seen = append(seen, states([]a2a.Event{ev})...)
				if tk, ok := ev.(*a2a.Task); ok {
					task = tk.ID
				}
				if up, ok := ev.(*a2a.TaskStatusUpdateEvent); ok && up.Status.State == a2a.TaskStateWorking {
					break
				}
				if len(seen) > 1 {
					t.Fatalf("events before WORKING: %v", seen)
				}
			}
			if want := []string{"task:TASK_STATE_SUBMITTED", "TASK_STATE_WORKING"}; !slices.Equal(seen, want) {
				t.Fatalf("stream %v, want %v: the instance's thinking status (no turn_id) is a sign of life", seen, want)
			}
			canceled, err := c.CancelTask(ctx, &a2a.CancelTaskRequest{ID: task})
			if err != nil || canceled.Status.State != a2a.TaskStateCanceled {
				t.Fatalf("CancelTask = %+v, %v", canceled, err)
			}
			evs := events(t, c.SubscribeToTask(ctx, &a2a.SubscribeToTaskRequest{ID: task}))
			if s := states(evs); !slices.Equal(s, []string{"task:TASK_STATE_CANCELED"}) {
				t.Errorf("the canceled task reads %v", s)
			}
			// The next message waits for the cancelled turn's idle (naming
			// no turn) and then runs.
			next := sendNow(t, c, "slow-"+string(binding), "after")
			eventually(t, 20*time.Second, func() string { return "the next task never started working" }, func() bool {
				got, err := c.GetTask(ctx, &a2a.GetTaskRequest{ID: next.ID})
				return err == nil && got.Status.State == a2a.TaskStateWorking
			})
		})
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`level=INFO msg="a2a task canceled" profile=stockslow`), time.Second)
}

// TestA2AStockCancelTailIsNotTheNextTask: the stock agent ends a cancelled
// turn with its status idle and only then says so (a system output and a
// cancel.complete naming the turn). A task cancelled before any delta holds
// the conversation until that idle; the output and cancel.complete after it
// are the cancelled turn's, so the message queued behind it is neither
// cancelled by them nor answered with them: it completes with its own
// answer.
func TestA2AStockCancelTailIsNotTheNextTask(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "stock.yaml")
	if err := os.WriteFile(cfg, []byte("engine:\n  name: stock\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	b := startBroker(t, Options{YAML: fmt.Sprintf(`  stockslow:
    path: %q
    env: {NEXUS_ECHO_STOCK_STATUS: "1", NEXUS_ECHO_SLOW_TURN: 5s}
agents:
  stockslow: {binary: stockslow, config: %q, card: {name: W, description: D, version: "1"}}
`, bin("nexus-echo"), cfg)})
	for _, binding := range bindings {
		t.Run(string(binding), func(t *testing.T) {
			c := a2aClient(t, b, "stockslow", binding)
			ctx := ctxT(t)
			conv := "tail-" + string(binding)
			var task a2a.TaskID
			for ev, err := range c.SendStreamingMessage(ctx, userMsg(conv, "cancel me")) {
				if err != nil {
					t.Fatalf("stream failed: %v", err)
				}
				if tk, ok := ev.(*a2a.Task); ok {
					task = tk.ID
				}
				if up, ok := ev.(*a2a.TaskStatusUpdateEvent); ok && up.Status.State == a2a.TaskStateWorking {
					break
				}
			}
			// Queued behind it, so it goes as soon as the hold ends.
			queued := sendNow(t, c, conv, "after")
			if canceled, err := c.CancelTask(ctx, &a2a.CancelTaskRequest{ID: task}); err != nil || canceled.Status.State != a2a.TaskStateCanceled {
				t.Fatalf("CancelTask = %+v, %v", canceled, err)
			}
			events(t, c.SubscribeToTask(ctx, &a2a.SubscribeToTaskRequest{ID: queued.ID})) // until it settles
			next, err := c.GetTask(ctx, &a2a.GetTaskRequest{ID: queued.ID})
			if err != nil {
				t.Fatal(err)
			}
			if next.Status.State != a2a.TaskStateCompleted {
				t.Fatalf("the message after the cancel settled %s (%+v), want COMPLETED: the cancelled turn's tail reached it", next.Status.State, next.Status.Message)
			}
			if got := answerOf(t, next); got != "echo #1: after" {
				t.Fatalf("the message after the cancel answered %q, want its own answer", got)
			}
		})
	}
}
