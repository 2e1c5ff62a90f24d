package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/a2aproject/a2a-go/v2/a2a"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// wsTurn runs one turn over the plain WebSocket path: send input, read
// until status idle. It returns the time to the turn's first frame and to
// its end.
func wsTurn(c *brokerclient.Conn, text string) (first, whole time.Duration, err error) {
	_ = c.Underlying().SetReadDeadline(time.Now().Add(rttDeadline))
	start := time.Now()
	if err := c.Send(brokerframe.IO{Type: brokerframe.IOInput, Content: text}); err != nil {
		return 0, 0, err
	}
	for {
		f, err := c.Next()
		if err != nil {
			return 0, 0, err
		}
		if first == 0 {
			first = time.Since(start)
		}
		var p brokerframe.IO
		if json.Unmarshal(f.Payload, &p) == nil && p.Type == brokerframe.IOStatus && p.State == brokerframe.StateIdle {
			return first, time.Since(start), nil
		}
	}
}

// BenchmarkA2ATurn: a blocking SendMessage round trip, and the times to the
// first streamed event (the task's snapshot) and to the first that reflects
// the instance (WORKING), on a warm conversation of a broker with a
// state_dir (every change written before it is streamed), next to the same
// turn over the plain WebSocket path in the same run. Targets: the round
// trip and the first WORKING each within 1.5× of their WebSocket
// counterpart at p50. A GetTask round trip is reported beside them: the
// cost of one A2A HTTP exchange, which is what the A2A turn adds to the
// WebSocket one. The A2A client skips the tests' openapi.json check, which
// would be timed with it.
func BenchmarkA2ATurn(b *testing.B) {
	benchPreflight(b)
	br := a2aBroker(b, "idle_timeout: 0s\n", Options{StateDir: true})
	ctx, cancel := context.WithTimeout(context.Background(), rttDeadline)
	defer cancel()
	claim, err := br.Client.Claim(ctx, brokerclient.ClaimRequest{Config: benchConfig})
	if err != nil {
		b.Fatal(err)
	}
	ws := dialBench(b, claim.WSURL)
	c := a2aClientAs(b, br, "support", a2a.TransportProtocolJSONRPC, unchecked)
	// Warm both: the instance of each path is booted and has answered once.
	if _, _, err := wsTurn(ws, "warm"); err != nil {
		b.Fatal(err)
	}
	if _, err := c.SendMessage(ctx, userMsg("bench", "warm")); err != nil {
		b.Fatal(err)
	}
	var send, get, stream, streamSnap, streamFirst, wsWhole, wsFirst []time.Duration
	for b.Loop() {
		start := time.Now()
		res, err := c.SendMessage(ctx, userMsg("bench", "hello there"))
		if err != nil {
			b.Fatal(err)
		}
		if task, ok := res.(*a2a.Task); !ok || task.Status.State != a2a.TaskStateCompleted {
			b.Fatalf("SendMessage answered %+v", res)
		}
		send = append(send, time.Since(start))

		start = time.Now()
		if _, err := c.GetTask(ctx, &a2a.GetTaskRequest{ID: res.(*a2a.Task).ID}); err != nil {
			b.Fatal(err)
		}
		get = append(get, time.Since(start))

		start = time.Now()
		var snap, first time.Duration
		for ev, err := range c.SendStreamingMessage(ctx, userMsg("bench", "hello there")) {
			if err != nil {
				b.Fatal(err)
			}
			if _, ok := ev.(*a2a.Task); ok && snap == 0 {
				snap = time.Since(start)
			}
			if su, ok := ev.(*a2a.TaskStatusUpdateEvent); ok && first == 0 && su.Status.State == a2a.TaskStateWorking {
				first = time.Since(start)
			}
		}
		stream = append(stream, time.Since(start))
		streamSnap, streamFirst = append(streamSnap, snap), append(streamFirst, first)

		f, w, err := wsTurn(ws, "hello there")
		if err != nil {
			b.Fatal(err)
		}
		wsFirst, wsWhole = append(wsFirst, f), append(wsWhole, w)
	}
	s50, w50, f50, wf50 := pct(send, 50), pct(wsWhole, 50), pct(streamFirst, 50), pct(wsFirst, 50)
	b.ReportMetric(ms(s50), "send-p50-ms")
	b.ReportMetric(ms(pct(send, 99)), "send-p99-ms")
	b.ReportMetric(ms(pct(get, 50)), "gettask-p50-ms")
	b.ReportMetric(ms(pct(stream, 50)), "stream-p50-ms")
	b.ReportMetric(ms(pct(streamSnap, 50)), "first-event-p50-ms")
	b.ReportMetric(ms(f50), "first-working-p50-ms")
	b.ReportMetric(ms(w50), "ws-turn-p50-ms")
	b.ReportMetric(ms(wf50), "ws-first-frame-p50-ms")
	b.ReportMetric(float64(s50)/float64(w50), "ratio-p50")
	b.ReportMetric(float64(f50)/float64(wf50), "first-ratio-p50")
	verdict(b, "blocking SendMessage within 1.5× of the WebSocket turn at p50", float64(s50) <= 1.5*float64(w50),
		"send p50 %.3f ms vs WebSocket %.3f ms = %.2f×; one GetTask exchange %.3f ms; %d samples each",
		ms(s50), ms(w50), float64(s50)/float64(w50), ms(pct(get, 50)), len(send))
	verdict(b, "first streamed WORKING within 1.5× of the first WebSocket frame at p50", float64(f50) <= 1.5*float64(wf50),
		"first WORKING %.3f ms vs first WebSocket frame %.3f ms = %.2f×; first event (the snapshot) %.3f ms",
		ms(f50), ms(wf50), float64(f50)/float64(wf50), ms(pct(streamSnap, 50)))
}

// BenchmarkA2AConcurrentContexts: 50 conversations at once, each its own
// instance, two turns each; no task may be lost.
func BenchmarkA2AConcurrentContexts(b *testing.B) {
	benchPreflight(b)
	const contexts = 50
	br := a2aBroker(b, "max_concurrent: 64\nidle_timeout: 0s\n", Options{})
	c := a2aClientAs(b, br, "support", a2a.TransportProtocolJSONRPC, unchecked)
	var wall []time.Duration
	lost := 0
	for i := 0; b.Loop(); i++ {
		start := time.Now()
		var wg sync.WaitGroup
		var mu sync.Mutex
		for n := range contexts {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
				defer cancel()
				conv := fmt.Sprintf("c%d-%d", i, n)
				for turn := 1; turn <= 2; turn++ {
					res, err := c.SendMessage(ctx, userMsg(conv, "hi"))
					task, ok := res.(*a2a.Task)
					if err != nil || !ok || task.Status.State != a2a.TaskStateCompleted ||
						task.Artifacts[0].Parts[0].Text() != fmt.Sprintf("echo #%d: hi", turn)+map[bool]string{true: " (earlier: hi)"}[turn == 2] {
						mu.Lock()
						lost++
						mu.Unlock()
						b.Logf("context %s turn %d: %v %+v", conv, turn, err, res)
					}
				}
			}()
		}
		wg.Wait()
		wall = append(wall, time.Since(start))
		for _, l := range br.leases().Leases {
			br.do("POST", "/release/"+l.LeaseID, "")
		}
	}
	b.ReportMetric(float64(lost), "tasks-lost")
	b.ReportMetric(ms(pct(wall, 50)), "wall-p50-ms")
	verdict(b, "50 concurrent contexts with no task lost", lost == 0, "%d of %d tasks lost per round; %d rounds; wall p50 %.0f ms",
		lost, 2*contexts, len(wall), ms(pct(wall, 50)))
}
