package echo

import (
	"context"
	"sync"
	"testing"

	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// BenchmarkEchoRelay measures the verbatim-echo path from a received frame
// to an encoded frame queued for the socket, the per-frame cost every relay
// benchmark of the broker pays inside the instance.
func BenchmarkEchoRelay(b *testing.B) {
	ctx, cancel := context.WithCancel(context.Background())
	out := newOutbox(outboxLimit)
	send := &sender{leaseID: testLease, out: out, log: discard}
	echoes := newEchoes(send, ctx.Done())
	ag := newAgent(nil, send, echoes, knobs{}, discard, nil)
	l := &link{leaseID: testLease, out: out, log: discard, onIO: ag.handle}
	frame, err := brokerframe.Encode(brokerframe.Frame{LeaseID: testLease, Signal: brokerframe.SignalIO,
		Payload: []byte(`{"type":"echo","content":"the quick brown fox jumps over the lazy dog","n":5}`)})
	if err != nil {
		b.Fatal(err)
	}
	var workers sync.WaitGroup
	workers.Go(func() { echoes.run(ctx) })
	workers.Go(func() { // the socket writer, whose writes all succeed
		var batch [][]byte
		for {
			select {
			case <-ctx.Done():
				return
			case <-out.ready:
			}
			batch = out.take(batch[:0])
			out.finish(nil)
			clear(batch)
		}
	})
	b.ReportAllocs()
	b.SetBytes(int64(len(frame)))
	for b.Loop() {
		l.dispatch(frame)
	}
	cancel()
	workers.Wait()
}
