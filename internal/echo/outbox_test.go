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

func TestOutboxEvictsOldestFirstWhileDisconnected(t *testing.T) {
	o := newOutbox(10)
	for _, f := range []string{"aaaa", "bbbb", "cc", "ddd"} { // 13 bytes: "aaaa" must go
		o.push([]byte(f))
	}
	o.push([]byte("e"))
	o.push([]byte("this frame alone is over the limit"))
	if n := o.connect(); n != 5 {
		t.Fatalf("connect reported %d dropped, want 5", n)
	}
	if got := drain(o); got != `["this frame alone is over the limit"]` {
		t.Fatalf("an oversized frame: %s", got)
	}
	if n := o.connect(); n != 0 {
		t.Fatalf("a second connect reported %d dropped again", n)
	}
	o.disconnect()
	for _, f := range []string{"aaaa", "bbbb", "cc", "ddd"} {
		o.push([]byte(f))
	}
	if got, n := drain(o), o.connect(); got != `["bbbb" "cc" "ddd"]` || n != 1 {
		t.Fatalf("over the limit: %s, %d dropped", got, n)
	}
}

func TestOutboxNeverEvictsWhileConnected(t *testing.T) {
	o := newOutbox(10)
	o.connect()
	for _, f := range []string{"aaaa", "bbbb", "cc", "ddd"} {
		o.push([]byte(f))
	}
	if got := drain(o); got != `["aaaa" "bbbb" "cc" "ddd"]` {
		t.Fatalf("a connected outbox over its limit evicted: %s", got)
	}
	// What a slow broker left queued past the limit is trimmed once the
	// link goes down, and reported at the next connect.
	for _, f := range []string{"aaaa", "bbbb", "cc", "ddd"} {
		o.push([]byte(f))
	}
	o.disconnect()
	if n := o.connect(); n != 1 {
		t.Fatalf("disconnect over the limit: %d dropped, want 1", n)
	}
	if got := drain(o); got != `["bbbb" "cc" "ddd"]` {
		t.Fatalf("after the disconnect: %s", got)
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
