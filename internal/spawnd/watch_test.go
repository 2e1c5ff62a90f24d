package spawnd

import (
	"testing"

	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// TestSlowWatcherIsDroppedNotWaitedFor: publish never blocks; a subscriber
// that falls watchBuffer exits behind is dropped, the others keep going.
func TestSlowWatcherIsDroppedNotWaitedFor(t *testing.T) {
	w := watchers{subs: map[*subscriber]struct{}{}}
	slow, fast := w.subscribe(), w.subscribe()
	for i := range watchBuffer {
		w.publish(&spawnpb.ExitEvent{Pid: int64(i)})
		<-fast.events
	}
	w.publish(&spawnpb.ExitEvent{Pid: watchBuffer})

	select {
	case <-slow.dropped:
	default:
		t.Fatal("a subscriber with a full buffer was not dropped")
	}
	if ev := <-fast.events; ev.Pid != watchBuffer {
		t.Errorf("the keeping-up subscriber got %v, want the last exit", ev)
	}
	if _, ok := w.subs[fast]; !ok || len(w.subs) != 1 {
		t.Errorf("subscribers left = %d, want only the one keeping up", len(w.subs))
	}
}
