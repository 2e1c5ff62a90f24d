package echo

import (
	"testing"

	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// BenchmarkEchoRelay measures the verbatim-echo path from a received frame
// to an encoded frame queued for the socket, the per-frame cost every relay
// benchmark of the broker pays inside the instance.
func BenchmarkEchoRelay(b *testing.B) {
	out := newOutbox(outboxLimit)
	send := &sender{leaseID: testLease, out: out, log: discard}
	ag := newAgent(nil, send, knobs{}, discard, nil)
	l := &link{leaseID: testLease, out: out, log: discard, onIO: ag.handle}
	frame, err := brokerframe.Encode(brokerframe.Frame{LeaseID: testLease, Signal: brokerframe.SignalIO,
		Payload: []byte(`{"type":"echo","content":"the quick brown fox jumps over the lazy dog","n":5}`)})
	if err != nil {
		b.Fatal(err)
	}
	var batch [][]byte
	b.ReportAllocs()
	b.SetBytes(int64(len(frame)))
	for i := 0; b.Loop(); i++ {
		l.dispatch(frame)
		if i%64 == 63 {
			batch = out.take(batch[:0])
			out.finish(nil)
			clear(batch)
		}
	}
}
