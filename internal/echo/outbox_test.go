package echo

import (
	"context"
	"fmt"
	"testing"
	"time"
)

// drain takes everything queued, as a writer whose writes all succeed.
func drain(o *outbox) string {
	batch := o.take(nil)
	o.finish(nil)
	return fmt.Sprintf("%q", batch)
}

func TestOutboxEvictsOldestFirst(t *testing.T) {
	o := newOutbox(10)
	for _, f := range []string{"aaaa", "bbbb", "cc", "ddd"} { // 13 bytes: "aaaa" must go
		o.push([]byte(f))
	}
	if got, n := drain(o), o.takeDropped(); got != `["bbbb" "cc" "ddd"]` || n != 1 {
		t.Fatalf("over the limit: %s, %d dropped", got, n)
	}
	o.push([]byte("e"))
	o.push([]byte("this frame alone is over the limit"))
	if got, n := drain(o), o.takeDropped(); got != `["this frame alone is over the limit"]` || n != 1 {
		t.Fatalf("an oversized frame: %s, %d dropped", got, n)
	}
	if got := drain(o); got != `[]` {
		t.Fatalf("drained outbox still holds %s", got)
	}
}

func TestOutboxRequeuesUnsentInOrder(t *testing.T) {
	o := newOutbox(1 << 10)
	o.push([]byte("1"))
	o.push([]byte("2"))
	o.push([]byte("3"))
	batch := o.take(nil)
	flushed := o.flushed()
	o.push([]byte("4")) // produced while the batch was being written
	o.finish(batch[1:]) // "1" went out, the socket died before "2"
	select {
	case <-flushed:
		t.Fatal("flushed while frames were still queued")
	default:
	}
	if got := drain(o); got != `["2" "3" "4"]` {
		t.Fatalf("after a failed write: %s", got)
	}
	select {
	case <-flushed:
	default:
		t.Fatal("not flushed once everything was written")
	}
	select {
	case <-o.flushed():
	default:
		t.Fatal("an empty outbox is not flushed")
	}
}

func TestOutboxWaitRoom(t *testing.T) {
	o := newOutbox(10)
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	o.push([]byte("12345"))
	if err := o.waitRoom(cancelled); err != nil {
		t.Fatalf("half full is not congested, yet waitRoom said %v", err)
	}
	o.push([]byte("6"))
	if err := o.waitRoom(cancelled); err == nil {
		t.Fatal("waitRoom did not wait on a congested outbox")
	}
	done := make(chan error, 1)
	go func() { done <- o.waitRoom(context.Background()) }()
	drain(o)
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(waitTimeout):
		t.Fatal("waitRoom still waiting after a drain")
	}
}
