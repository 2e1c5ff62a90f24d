package e2e

import (
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/nexus-broker/nexus-broker/internal/echo"
	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

type echoPayload struct {
	Type string `json:"type"`
	N    int    `json:"n"`
}

// TestFloodArrivesWholeAndInOrder: a client pipelining 20 000 frames while
// reading gets every one back, in order, with seq and no holes.
func TestFloodArrivesWholeAndInOrder(t *testing.T) {
	const n = 20000
	b := startBroker(t, Options{})
	conn := b.dial(b.claim(brokerclient.ClaimRequest{}), brokerclient.DialOptions{})
	writeErr := make(chan error, 1)
	go func() {
		for i := 0; i < n; i++ {
			if err := conn.Send(echoPayload{Type: "echo", N: i}); err != nil {
				writeErr <- err
				return
			}
		}
		writeErr <- nil
	}()
	_ = conn.Underlying().SetReadDeadline(time.Now().Add(3 * time.Minute))
	var prevSeq uint64
	for i := 0; i < n; i++ {
		f, err := conn.Next()
		if err != nil {
			t.Fatalf("after %d of %d frames: %v", i, n, err)
		}
		var p echoPayload
		if err := json.Unmarshal(f.Payload, &p); err != nil || p.Type != "echo" || p.N != i {
			t.Fatalf("frame %d: %s", i, f.Payload)
		}
		if prevSeq != 0 && f.Seq != prevSeq+1 {
			t.Fatalf("seq jumped from %d to %d at frame %d", prevSeq, f.Seq, i)
		}
		prevSeq = f.Seq
	}
	if err := <-writeErr; err != nil {
		t.Fatal(err)
	}
	m := b.metrics()
	for _, r := range []string{"undecodable", "no_instance", "instance_buffer_full", "client_buffer_full", "lease_gone"} {
		if v := m[fmt.Sprintf(`nexus_broker_frames_dropped_total{reason=%q}`, r)]; v != 0 {
			t.Errorf("frames_dropped_total{%s} = %v", r, v)
		}
	}
}

// readTurn reads until status idle, returning the frames' seqs and raw bytes.
func readTurn(t *testing.T, conn *brokerclient.Conn) (seqs []uint64, raw []string) {
	t.Helper()
	_ = conn.Underlying().SetReadDeadline(time.Now().Add(60 * time.Second))
	for {
		_, data, err := conn.Underlying().ReadMessage()
		if err != nil {
			t.Fatalf("reading: %v", err)
		}
		f, err := brokerframe.Decode(data)
		if err != nil {
			t.Fatal(err)
		}
		if f.Signal == brokerframe.SignalStreamGap {
			t.Fatalf("unexpected gap: %s", data)
		}
		if f.Seq > conn.LastSeq {
			conn.LastSeq = f.Seq
		}
		seqs, raw = append(seqs, f.Seq), append(raw, string(data))
		var p brokerframe.IO
		if json.Unmarshal(f.Payload, &p) == nil && p.Type == brokerframe.IOStatus && p.State == brokerframe.StateIdle {
			return seqs, raw
		}
	}
}

// readN reads exactly n frames.
func readN(t *testing.T, conn *brokerclient.Conn, n int) []brokerframe.Frame {
	t.Helper()
	_ = conn.Underlying().SetReadDeadline(time.Now().Add(60 * time.Second))
	out := make([]brokerframe.Frame, 0, n)
	for len(out) < n {
		f, err := conn.Next()
		if err != nil {
			t.Fatalf("after %d of %d frames: %v", len(out), n, err)
		}
		out = append(out, f)
	}
	return out
}

func TestResumeFromSeqReplaysExactlyTheMissingFrames(t *testing.T) {
	b := startBroker(t, Options{})
	claim := b.claim(brokerclient.ClaimRequest{})
	conn := b.dial(claim, brokerclient.DialOptions{})
	if err := conn.Send(brokerframe.IO{Type: "input", Content: "/big 100"}); err != nil {
		t.Fatal(err)
	}
	seqs, raw := readTurn(t, conn)
	for i := 1; i < len(seqs); i++ {
		if seqs[i] != seqs[i-1]+1 {
			t.Fatalf("hole between %d and %d", seqs[i-1], seqs[i])
		}
	}
	last := seqs[len(seqs)-1]
	bySeq := map[uint64]string{}
	for i, s := range seqs {
		bySeq[s] = raw[i]
	}
	for _, from := range []uint64{seqs[0] - 1, seqs[0] + 10, last - 1, last} {
		from := from
		c := b.dial(claim, brokerclient.DialOptions{FromSeq: &from})
		want := int(last - from)
		got := readN(t, c, want)
		for i, f := range got {
			if f.Seq != from+uint64(i)+1 {
				t.Fatalf("from_seq=%d: frame %d has seq %d", from, i, f.Seq)
			}
			if enc, _ := brokerframe.Encode(f); string(enc) != bySeq[f.Seq] {
				t.Fatalf("from_seq=%d: replayed frame %d differs:\n%s\n%s", from, f.Seq, enc, bySeq[f.Seq])
			}
		}
		// Nothing else was pending: the next frame is live output.
		if err := c.Send(brokerframe.IO{Type: "echo"}); err != nil {
			t.Fatal(err)
		}
		f := readN(t, c, 1)[0]
		if f.Seq != last+1 {
			t.Fatalf("from_seq=%d: after the replay came seq %d, want live %d", from, f.Seq, last+1)
		}
		enc, _ := brokerframe.Encode(f)
		bySeq[f.Seq] = string(enc)
		last++
		c.Close()
	}
	// A from_seq the broker cannot parse is treated as absent: the socket
	// opens on the live stream, as a first connect does, and is not refused.
	for _, bad := range []string{"soon", "-3", "1e3"} {
		ws, _, err := websocket.DefaultDialer.Dial(claim.WSURL+"?from_seq="+bad, nil)
		if err != nil {
			t.Fatalf("from_seq=%s: %v", bad, err)
		}
		in, _ := brokerframe.Encode(brokerframe.Frame{LeaseID: claim.LeaseID, Signal: brokerframe.SignalIO, Payload: []byte(`{"type":"echo"}`)})
		if err := ws.WriteMessage(websocket.TextMessage, in); err != nil {
			t.Fatal(err)
		}
		_ = ws.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, data, err := ws.ReadMessage()
		if err != nil {
			t.Fatalf("from_seq=%s: %v", bad, err)
		}
		f, err := brokerframe.Decode(data)
		if err != nil || f.Seq != last+1 || f.Signal != brokerframe.SignalIO {
			t.Fatalf("from_seq=%s: first frame %s (%v), want live seq %d", bad, data, err, last+1)
		}
		last++
		ws.Close()
	}
}

func TestEvictionSendsAGapNamingTheMissingRange(t *testing.T) {
	b := startBroker(t, Options{YAML: "client_replay_buffer_bytes: 3000\n"})
	claim := b.claim(brokerclient.ClaimRequest{})
	conn := b.dial(claim, brokerclient.DialOptions{})
	if err := conn.Send(brokerframe.IO{Type: "input", Content: "/big 200"}); err != nil {
		t.Fatal(err)
	}
	seqs, _ := readTurn(t, conn)
	last := seqs[len(seqs)-1]
	conn.Close()

	from := uint64(5)
	c := b.dial(claim, brokerclient.DialOptions{FromSeq: &from})
	_ = c.Underlying().SetReadDeadline(time.Now().Add(30 * time.Second))
	_, data, err := c.Underlying().ReadMessage()
	if err != nil {
		t.Fatal(err)
	}
	var gap struct {
		Seq     uint64                `json:"seq"`
		Signal  string                `json:"signal"`
		Payload brokerframe.StreamGap `json:"payload"`
	}
	if err := json.Unmarshal(data, &gap); err != nil || gap.Signal != "stream-gap" || gap.Seq != 0 {
		t.Fatalf("first frame = %s, want an unsequenced stream-gap", data)
	}
	p := gap.Payload
	if p.Reason != "evicted" || p.RequestedFromSeq != 5 || p.MissingFromSeq != 6 || p.MissingThroughSeq <= 6 || p.MissingThroughSeq >= last {
		t.Fatalf("gap = %+v (stream ends at %d)", p, last)
	}
	rest := readN(t, c, int(last-p.MissingThroughSeq))
	for i, f := range rest {
		if f.Seq != p.MissingThroughSeq+uint64(i)+1 {
			t.Fatalf("after the gap frame %d has seq %d, want %d", i, f.Seq, p.MissingThroughSeq+uint64(i)+1)
		}
	}
	c.Close()

	// A from_seq ahead of the stream: the restarted gap, no range, then all.
	ahead := last + 1000
	c2 := b.dial(claim, brokerclient.DialOptions{FromSeq: &ahead})
	_, data, err = c2.Underlying().ReadMessage()
	if err != nil || !strings.Contains(string(data), `"payload":{"reason":"restarted","requested_from_seq":`+fmt.Sprint(ahead)+`}`) {
		t.Fatalf("ahead-of-stream first frame = %s %v", data, err)
	}
	m := b.metrics()
	if m[`nexus_broker_replay_gaps_total{reason="evicted"}`] != 1 || m[`nexus_broker_replay_gaps_total{reason="restarted"}`] != 1 {
		t.Fatalf("replay_gaps_total: %v %v", m[`nexus_broker_replay_gaps_total{reason="evicted"}`], m[`nexus_broker_replay_gaps_total{reason="restarted"}`])
	}
}

// TestAStalledClientLosesTheOldestFramesAndTheGatewaySaysSo: a client that
// stops reading falls more than client_replay_buffer_bytes behind; what it
// loses is counted as client_buffer_full and logged in upstream's words.
func TestAStalledClientLosesTheOldestFramesAndTheGatewaySaysSo(t *testing.T) {
	b := startBroker(t, Options{YAML: "client_replay_buffer_bytes: 3000\n"})
	claim := b.claim(brokerclient.ClaimRequest{})
	ws := dialSmallBuffer(t, claim.WSURL)
	writeInput(t, ws, claim.LeaseID, "/big 50000")
	b.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="peer send buffer full, dropping frame" lease_id=`+claim.LeaseID+` signal=io frames=[1-9]`), 60*time.Second)
	if v := b.metrics()[`nexus_broker_frames_dropped_total{reason="client_buffer_full"}`]; v == 0 {
		t.Fatal("frames_dropped_total{client_buffer_full} = 0 after a logged loss")
	}
}

// client_replay_buffer_bytes: 0 keeps no frame but still numbers every
// one: a resume from 0 is told the whole stream is gone, replays nothing,
// and the live stream carries on from the next number.
func TestAZeroReplayBufferKeepsSequencingAndReplaysNothing(t *testing.T) {
	b := startBroker(t, Options{YAML: "client_replay_buffer_bytes: 0\n"})
	claim := b.claim(brokerclient.ClaimRequest{})
	conn := b.dial(claim, brokerclient.DialOptions{})
	if err := conn.Send(brokerframe.IO{Type: "input", Content: "hello"}); err != nil {
		t.Fatal(err)
	}
	seqs, _ := readTurn(t, conn)
	for i := 1; i < len(seqs); i++ {
		if seqs[i] != seqs[i-1]+1 {
			t.Fatalf("seqs %v are not consecutive", seqs)
		}
	}
	last := seqs[len(seqs)-1]
	conn.Close()

	zero := uint64(0)
	c := b.dial(claim, brokerclient.DialOptions{FromSeq: &zero})
	_ = c.Underlying().SetReadDeadline(time.Now().Add(30 * time.Second))
	_, data, err := c.Underlying().ReadMessage()
	want := fmt.Sprintf(`"signal":"stream-gap","payload":{"reason":"evicted","requested_from_seq":0,"missing_from_seq":1,"missing_through_seq":%d}`, last)
	if err != nil || !strings.Contains(string(data), want) {
		t.Fatalf("first frame of a resume from 0 = %s %v, want the gap %s", data, err, want)
	}
	if err := c.Send(brokerframe.IO{Type: "input", Content: "again"}); err != nil {
		t.Fatal(err)
	}
	if next, _ := readTurn(t, c); next[0] != last+1 {
		t.Fatalf("after the gap came seq %d, want the live stream's %d: nothing replayed", next[0], last+1)
	}
}

func TestAMebibyteOfTinyDeltasReplaysWhole(t *testing.T) {
	b := startBroker(t, Options{})
	claim := b.claim(brokerclient.ClaimRequest{})
	conn := b.dial(claim, brokerclient.DialOptions{})
	// ~172 bytes per encoded delta: 5900 of them fill most of the MiB.
	if err := conn.Send(brokerframe.IO{Type: "input", Content: "/big 5900"}); err != nil {
		t.Fatal(err)
	}
	seqs, raw := readTurn(t, conn)
	total := 0
	for _, r := range raw {
		total += len(r)
	}
	if total < 900<<10 || total > 1<<20 {
		t.Fatalf("the turn encoded to %d bytes; adjust the delta count to land just under 1 MiB", total)
	}
	conn.Close()
	zero := seqs[0] - 1
	c := b.dial(claim, brokerclient.DialOptions{FromSeq: &zero})
	got := readN(t, c, len(seqs))
	for i, f := range got {
		if enc, _ := brokerframe.Encode(f); string(enc) != raw[i] {
			t.Fatalf("replayed frame %d differs", i)
		}
	}
}

func TestNewestClientWinsAndTheOlderIsClosedWith4501(t *testing.T) {
	b := startBroker(t, Options{})
	claim := b.claim(brokerclient.ClaimRequest{})
	first := b.dial(claim, brokerclient.DialOptions{})
	second := b.dial(claim, brokerclient.DialOptions{})
	if code, text := closeCode(t, first); code != 4501 || text != "superseded by a newer client connection" {
		t.Fatalf("older client closed with %d %q", code, text)
	}
	if got := say(t, second, "still here"); got != "echo #1: still here" {
		t.Fatalf("answer on the newer connection = %q", got)
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="this connection displaced the lease's previous client[^"]*" lease_id=`+claim.LeaseID+` principal_id="" credential=anonymous reason="superseded by a newer client connection" close_status=4501`), time.Second)
	if v := b.metrics()["nexus_broker_client_evictions_total"]; v != 1 {
		t.Fatalf("client_evictions_total = %v", v)
	}
}

func TestAnInstanceThatAnswersAndExitsStillDeliversItsAnswer(t *testing.T) {
	b := startBroker(t, Options{NoNexusEntry: true, YAML: fmt.Sprintf("binaries:\n  nexus:\n    path: %q\n    env: {NEXUS_ECHO_CRASH: after-answer}\n", bin("nexus-echo"))})
	for i := 0; i < 5; i++ { // the race it guards against is timing-dependent
		claim := b.claim(brokerclient.ClaimRequest{})
		conn := b.dial(claim, brokerclient.DialOptions{})
		if got := say(t, conn, "last words"); got != "echo #1: last words" {
			t.Fatalf("answer = %q", got)
		}
		if code, text := closeCode(t, conn); code != 4500 || text != "instance crashed" {
			t.Fatalf("closed with %d %q, want 4500 instance crashed", code, text)
		}
		b.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="instance exited unexpectedly; treating as crash" lease_id=`+claim.LeaseID+` error="exit status 5" exit_code=5`), time.Second)
		b.GatewayLog.wait(t, regexp.MustCompile(`level=INFO msg="lease removed after crash" lease_id=`+claim.LeaseID+` reason=crashed`), time.Second)
	}
	b.waitNoInstances(10 * time.Second)
	if _, inUse := b.slots(); inUse != 0 {
		t.Fatalf("slots_in_use = %d after crashes", inUse)
	}
}

func TestOnlyIOTravelsClientToInstanceAndBarePayloadsAreWrapped(t *testing.T) {
	b := startBroker(t, Options{})
	claim := b.claim(brokerclient.ClaimRequest{})
	conn := b.dial(claim, brokerclient.DialOptions{})
	for _, sig := range []string{"shutdown", "register", "ready"} {
		if err := conn.WriteRaw([]byte(fmt.Sprintf(`{"version":1,"lease_id":%q,"signal":%q}`, claim.LeaseID, sig))); err != nil {
			t.Fatal(err)
		}
	}
	// Neither a frame nor a payload, and a frame naming another lease: both
	// dropped, counted and logged in upstream's words.
	for _, raw := range []string{`not a frame`, `{"version":1,"lease_id":"another-lease","signal":"io","payload":{"type":"input","content":"stray"}}`} {
		if err := conn.WriteRaw([]byte(raw)); err != nil {
			t.Fatal(err)
		}
	}
	if err := conn.WriteRaw([]byte(`{"type":"input","content":"bare"}`)); err != nil {
		t.Fatal(err)
	}
	_ = conn.Underlying().SetReadDeadline(time.Now().Add(30 * time.Second))
	if got, err := conn.Answer(); err != nil || got != "echo #1: bare" {
		t.Fatalf("bare payload answer = %q %v", got, err)
	}
	if n := len(b.Instances()); n != 1 {
		t.Fatalf("a client-sent shutdown reached the instance: %d instances alive", n)
	}
	m := b.metrics()
	for reason, want := range map[string]float64{"client_control": 3, "undecodable": 1, "lease_mismatch": 1} {
		if v := m[`nexus_broker_frames_dropped_total{reason="`+reason+`"}`]; v != want {
			t.Errorf("%s drops = %v, want %v", reason, v, want)
		}
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="dropping undecodable frame" lease_id=`+claim.LeaseID+` error=".+"`), time.Second)
	b.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="dropping frame with mismatched lease" bound_lease=`+claim.LeaseID+` frame_lease=another-lease`), time.Second)
}

// TestAnInstanceFrameWithoutLeaseIDIsTheSocketsLease: the envelope's
// lease_id may be absent; an instance's frame without one belongs to the
// lease its socket registered for and reaches the client, as upstream
// forwards it, and nothing is counted or logged as dropped.
func TestAnInstanceFrameWithoutLeaseIDIsTheSocketsLease(t *testing.T) {
	b := startBroker(t, Options{NoNexusEntry: true, YAML: fmt.Sprintf("binaries:\n  nexus:\n    path: %q\n    env: {%s: \"1\"}\n", bin("nexus-echo"), echo.EnvOmitLeaseID)})
	claim := b.claim(brokerclient.ClaimRequest{})
	conn := b.dial(claim, brokerclient.DialOptions{})
	if got := say(t, conn, "hi"); got != "echo #1: hi" {
		t.Fatalf("answer = %q", got)
	}
	if v := b.metrics()[`nexus_broker_frames_dropped_total{reason="lease_mismatch"}`]; v != 0 {
		t.Fatalf("lease_mismatch drops = %v", v)
	}
	if strings.Contains(b.GatewayLog.String(), "mismatched lease") {
		t.Fatalf("a frame without lease_id was logged as mismatched:\n%s", b.GatewayLog)
	}
}

func TestGatewayShutdownClosesClientsWith1001AndKeepsInstances(t *testing.T) {
	b := startBroker(t, Options{})
	conn := b.dial(b.claim(brokerclient.ClaimRequest{}), brokerclient.DialOptions{})
	before := b.Instances()
	go b.KillGateway(15) // SIGTERM
	if code, text := closeCode(t, conn); code != 1001 {
		t.Fatalf("client closed with %d %q on broker shutdown, want 1001", code, text)
	}
	if after := b.Instances(); len(after) != len(before) || len(after) != 1 {
		t.Fatalf("instances before %v, after gateway shutdown %v", before, after)
	}
}

func TestADeadClientIsDetachedAndTheLeaseSurvives(t *testing.T) {
	b := startBroker(t, Options{})
	// Restart the gateway with short liveness intervals (test-only hook).
	b.KillGateway(15)
	b.StartGateway("NEXUS_BROKER_TEST_LIVENESS=300ms,1500ms")
	b.GatewayLog.wait(t, regexp.MustCompile(`restored lease|nexus-broker listening`), 5*time.Second)
	claim := b.claim(brokerclient.ClaimRequest{})
	conn := b.dial(claim, brokerclient.DialOptions{})
	// Stop reading: gorilla answers pings only from a read loop, so this
	// client now answers nothing.
	start := time.Now()
	b.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="peer stopped answering pings; closing its socket so the lease detaches[^"]*" lease_id=`+claim.LeaseID+` peer=client silent_for=\d+(\.\d+)?s deadline=1\.5s error=".*i/o timeout"`), 10*time.Second)
	if d := time.Since(start); d < 1400*time.Millisecond || d > 3*time.Second {
		t.Fatalf("detached after %s, want within [timeout, timeout+2 intervals] = [1.5s, ~2.1s]", d)
	}
	_ = conn.Underlying().SetReadDeadline(time.Now().Add(5 * time.Second))
	for {
		_, err := conn.Next()
		if err == nil {
			continue
		}
		var ce *websocket.CloseError
		if errors.As(err, &ce) && ce.Code != 1001 {
			t.Fatalf("close %d %q, want 1001 peer unresponsive", ce.Code, ce.Text)
		}
		break
	}
	again := b.dial(claim, brokerclient.DialOptions{})
	if got := say(t, again, "back"); got != "echo #1: back" {
		t.Fatalf("after reconnect: %q", got)
	}
}

func TestCapacityUnderAFiftyClaimBurst(t *testing.T) {
	b := startBroker(t, Options{YAML: "max_concurrent: 5\nqueue_wait_timeout: 3s\nmax_queue_depth: 20\n"})
	var wg sync.WaitGroup
	results := make(chan error, 50)
	for i := 0; i < 50; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := b.Client.Claim(t.Context(), brokerclient.ClaimRequest{Config: "a: 1"})
			if err == nil {
				err = b.Client.Release(t.Context(), c.LeaseID)
			}
			results <- err
		}()
	}
	wg.Wait()
	close(results)
	served, refused := 0, map[string]int{}
	for err := range results {
		var ae *brokerclient.APIError
		switch {
		case err == nil:
			served++
		case errors.As(err, &ae) && ae.Status == 503 && (ae.Message == "capacity queue full" || ae.Message == "capacity wait timed out" || ae.Message == "no capacity"):
			refused[ae.Message]++
		default:
			t.Errorf("unexpected answer: %v", err)
		}
	}
	t.Logf("served %d, refused %v", served, refused)
	if served < 5 || refused["capacity queue full"] == 0 {
		t.Fatalf("served %d, refused %v: want at least 5 served and some queue-full refusals", served, refused)
	}
	b.waitNoInstances(20 * time.Second)
	if _, inUse := b.slots(); inUse != 0 {
		t.Fatalf("slots_in_use = %d", inUse)
	}
	m := b.metrics()
	if int(m[`nexus_broker_claims_total{outcome="accepted"}`]) != served || int(m[`nexus_broker_claims_total{outcome="queue_full"}`]) != refused["capacity queue full"] {
		t.Fatalf("claims_total disagrees with what clients saw: %v", m)
	}
}

// TestClientFramesAreHeldWhileTheInstanceRedials: input sent while the
// instance's socket is down is delivered once it re-registers, not dropped.
func TestClientFramesAreHeldWhileTheInstanceRedials(t *testing.T) {
	b := startBroker(t, Options{})
	claim := b.claim(brokerclient.ClaimRequest{})
	conn := b.dial(claim, brokerclient.DialOptions{})
	if err := conn.Send(brokerframe.IO{Type: "input", Content: "/drop 1s"}); err != nil {
		t.Fatal(err)
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="instance disconnected" lease_id=`+claim.LeaseID), 10*time.Second)
	for i := 0; i < 3; i++ {
		if err := conn.Send(echoPayload{Type: "echo", N: i}); err != nil {
			t.Fatal(err)
		}
	}
	// The held echoes come back after the instance redials, in order, after
	// the /drop turn's own buffered answer.
	_ = conn.Underlying().SetReadDeadline(time.Now().Add(20 * time.Second))
	next := 0
	for next < 3 {
		f, err := conn.Next()
		if err != nil {
			t.Fatalf("waiting for held frame %d: %v", next, err)
		}
		var p echoPayload
		if json.Unmarshal(f.Payload, &p) == nil && p.Type == "echo" {
			if p.N != next {
				t.Fatalf("held frames out of order: got %d, want %d", p.N, next)
			}
			next++
		}
	}
	if v := b.metrics()[`nexus_broker_frames_dropped_total{reason="no_instance"}`]; v != 0 {
		t.Fatalf("no_instance drops = %v", v)
	}
}
