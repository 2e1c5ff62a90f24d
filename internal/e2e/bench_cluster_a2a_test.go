package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/a2aproject/a2a-go/v2/a2a"
	"github.com/a2aproject/a2a-go/v2/a2aclient"
)

// a2aTimes is one A2A turn's blocking SendMessage round trip, and the time
// to the first streamed WORKING and to the stream's end.
func a2aTimes(b *testing.B, ctx context.Context, c *a2aclient.Client, conv string) (send, working, stream time.Duration) {
	start := time.Now()
	if _, err := c.SendMessage(ctx, userMsg(conv, "hello there")); err != nil {
		b.Fatal(err)
	}
	send = time.Since(start)
	start = time.Now()
	for ev, err := range c.SendStreamingMessage(ctx, userMsg(conv, "hello there")) {
		if err != nil {
			b.Fatal(err)
		}
		if su, ok := ev.(*a2a.TaskStatusUpdateEvent); ok && working == 0 && su.Status.State == a2a.TaskStateWorking {
			working = time.Since(start)
		}
	}
	return send, working, time.Since(start)
}

// BenchmarkClusterA2A: two warm conversations held by broker a, one used
// through a (direct to the owner) and one through b (carried over NATS),
// in the same run: the blocking SendMessage round trip, the first streamed
// WORKING and the whole stream.
func BenchmarkClusterA2A(b *testing.B) {
	benchPreflight(b)
	bs := a2aCluster(b, "idle_timeout: 0s\n", "", "a", "b")
	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	owner := a2aClientAs(b, bs["a"], "support", a2a.TransportProtocolJSONRPC, unchecked)
	entry := a2aClientAs(b, bs["b"], "support", a2a.TransportProtocolJSONRPC, unchecked)
	for _, conv := range []string{"direct", "carried"} {
		if _, err := owner.SendMessage(ctx, userMsg(conv, "warm")); err != nil {
			b.Fatal(err)
		}
	}
	var ds, dw, dt, cs, cw, ct []time.Duration
	for b.Loop() {
		s, w, t := a2aTimes(b, ctx, owner, "direct")
		ds, dw, dt = append(ds, s), append(dw, w), append(dt, t)
		s, w, t = a2aTimes(b, ctx, entry, "carried")
		cs, cw, ct = append(cs, s), append(cw, w), append(ct, t)
	}
	for _, m := range []struct {
		name             string
		direct, nonOwner []time.Duration
	}{{"send", ds, cs}, {"first-working", dw, cw}, {"stream", dt, ct}} {
		b.ReportMetric(ms(pct(m.direct, 50)), "owner-"+m.name+"-p50-ms")
		b.ReportMetric(ms(pct(m.nonOwner, 50)), "non-owner-"+m.name+"-p50-ms")
		b.ReportMetric(float64(pct(m.nonOwner, 50))/float64(pct(m.direct, 50)), m.name+"-ratio")
	}
}
