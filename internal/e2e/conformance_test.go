package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// endedRecords reads <state_dir>/leases.jsonl: lease id → its ended
// record as raw fields, for the leases that have one.
func (b *Broker) endedRecords() map[string]map[string]any {
	b.t.Helper()
	out := map[string]map[string]any{}
	f, err := os.Open(filepath.Join(b.Dir, "state", "leases.jsonl"))
	if err != nil {
		b.t.Fatalf("opening the lease journal: %v", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var rec map[string]any
		if json.Unmarshal(sc.Bytes(), &rec) == nil && rec["kind"] == "ended" {
			id, _ := rec["lease_id"].(string)
			out[id] = rec
		}
	}
	return out
}

// endedReasons is lease id → the reason of its ended record.
func (b *Broker) endedReasons() map[string]string {
	b.t.Helper()
	out := map[string]string{}
	for id, rec := range b.endedRecords() {
		out[id], _ = rec["reason"].(string)
	}
	return out
}

// waitEnded waits until the journal holds an ended record for every lease
// in want, then checks each one's reason.
func (b *Broker) waitEnded(want map[string]string, within time.Duration) {
	b.t.Helper()
	var got map[string]string
	eventually(b.t, within, func() string { return "ended records for " + toJSON(want) + ", have " + toJSON(got) }, func() bool {
		got = b.endedReasons()
		for id := range want {
			if _, ok := got[id]; !ok {
				return false
			}
		}
		return true
	})
	for id, reason := range want {
		if got[id] != reason {
			b.t.Errorf("lease %s is journaled as ended for %q, want %q", id, got[id], reason)
		}
	}
}

// leasePID is the pid GET /leases reports for a lease.
func (b *Broker) leasePID(id string) int {
	b.t.Helper()
	l, ok := b.lease(id)
	if !ok || l.PID <= 0 {
		b.t.Fatalf("lease %s has no pid in GET /leases: %+v", id, l)
	}
	return int(l.PID)
}

// An instance that exits the moment its shutdown frame arrives may be gone
// before spawnd would otherwise have heard why: every teardown must still be
// journaled with its own reason.
func TestTheJournalRecordsWhyEachLeaseEnded(t *testing.T) {
	b := startBroker(t, Options{StateDir: true, NoNexusEntry: true, YAML: fmt.Sprintf(`idle_timeout: 2s
max_turn_duration: 1500ms
binaries:
  nexus:
    path: %q
    env: {NEXUS_ECHO_SLOW_TURN: "1s", NEXUS_ECHO_EXIT_ON_SHUTDOWN: "1"}
`, bin("nexus-echo"))})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	released := b.claim(brokerclient.ClaimRequest{})
	if err := b.Client.Release(ctx, released.LeaseID); err != nil {
		t.Fatal(err)
	}
	crashed := b.claim(brokerclient.ClaimRequest{})
	if err := syscall.Kill(b.leasePID(crashed.LeaseID), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	wedged := b.claim(brokerclient.ClaimRequest{})
	startSlowTurn(t, b.dial(wedged, brokerclient.DialOptions{}))
	idle := b.claim(brokerclient.ClaimRequest{})

	b.waitEnded(map[string]string{
		released.LeaseID: "manual release",
		crashed.LeaseID:  "crashed",
		wedged.LeaseID:   "turn timeout",
		idle.LeaseID:     "idle",
	}, 15*time.Second)
	if n := b.SpawndLog.count(regexp.MustCompile(`sending SIGTERM`)); n != 0 {
		t.Errorf("%d teardowns were escalated; every instance here exits on its shutdown frame at once, which is the case under test", n)
	}
	// The ordering the reasons rest on, whatever the race above did: spawnd
	// began each teardown, and so held its reason, before the instance was
	// asked to stop.
	for _, id := range []string{released.LeaseID, wedged.LeaseID, idle.LeaseID} {
		began := logTime(t, b.SpawndLog.String(), `msg="terminating instance" lease_id=`+id)
		instLog, err := os.ReadFile(filepath.Join(b.Dir, "state", "logs", id+".log"))
		if err != nil {
			t.Fatal(err)
		}
		if asked := logTime(t, string(instLog), `msg="broker requested shutdown`); asked.Before(began) {
			t.Errorf("lease %s: the instance was asked to stop at %s, before spawnd began its teardown at %s",
				id, asked.Format(time.StampMilli), began.Format(time.StampMilli))
		}
	}
}

// logTime is the time of the first slog line of log containing needle.
func logTime(t *testing.T, log, needle string) time.Time {
	t.Helper()
	m := regexp.MustCompile(`(?m)^time=(\S+) .*` + regexp.QuoteMeta(needle)).FindStringSubmatch(log)
	if m == nil {
		t.Fatalf("no log line containing %s in:\n%s", needle, log)
	}
	at, err := time.Parse(time.RFC3339Nano, m[1])
	if err != nil {
		t.Fatal(err)
	}
	return at
}

// A SIGHUP that changes idle_timeout or max_turn_duration moves the deadlines
// of the leases that already exist, at once: from disabled to 2s, from an
// hour to 2s, and a turn already running from an hour to 2s.
func TestAReloadMovesTheDeadlinesOfLiveLeases(t *testing.T) {
	b := startBroker(t, Options{NoNexusEntry: true, YAML: fmt.Sprintf(`idle_timeout: 0s
max_turn_duration: 1h
binaries:
  nexus:
    path: %q
    env: {NEXUS_ECHO_SLOW_TURN: "1s"}
`, bin("nexus-echo"))})
	original, err := os.ReadFile(b.ConfigPath)
	if err != nil {
		t.Fatal(err)
	}
	applied := regexp.MustCompile(`msg="config reload applied"`)
	reload := func(idle, turn string) {
		t.Helper()
		text := regexp.MustCompile(`(?m)^idle_timeout: .*$`).ReplaceAllString(string(original), "idle_timeout: "+idle)
		text = regexp.MustCompile(`(?m)^max_turn_duration: .*$`).ReplaceAllString(text, "max_turn_duration: "+turn)
		if err := os.WriteFile(b.ConfigPath, []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
		n := b.GatewayLog.count(applied)
		_ = b.gateway.cmd.Process.Signal(syscall.SIGHUP)
		eventually(t, 10*time.Second, func() string { return "reload applied" }, func() bool { return b.GatewayLog.count(applied) > n })
	}
	reaped := func(claim *brokerclient.Claim, started span, want string) {
		t.Helper()
		drained, reason := b.waitDraining(claim.LeaseID, 10*time.Second)
		if reason != want {
			t.Fatalf("lease %s released as %q, want %q", claim.LeaseID, reason, want)
		}
		within(t, "lease "+claim.LeaseID, started, 2*time.Second, drained)
	}

	var quiet *brokerclient.Claim
	activated := around(func() { quiet = b.claim(brokerclient.ClaimRequest{}) })
	reload("2s", "1h")
	reaped(quiet, activated, "idle")

	reload("1h", "1h")
	activated = around(func() { quiet = b.claim(brokerclient.ClaimRequest{}) })
	reload("2s", "1h")
	reaped(quiet, activated, "idle")

	reload("1h", "1h")
	busy := b.claim(brokerclient.ClaimRequest{})
	started := startSlowTurn(t, b.dial(busy, brokerclient.DialOptions{}))
	reload("1h", "2s")
	reaped(busy, started, "turn timeout")
}

// "<= 0 = unlimited" is reported as 0, never as the negative number written.
func TestNegativeCapsAreUnlimitedAndReportedAsZero(t *testing.T) {
	b := startBroker(t, Options{YAML: "max_concurrent: -5\nmax_queue_depth: -1\n"})
	b.claim(brokerclient.ClaimRequest{})
	b.claim(brokerclient.ClaimRequest{})
	_, body := b.get("/leases")
	var v map[string]any
	if err := json.Unmarshal([]byte(body), &v); err != nil {
		t.Fatalf("GET /leases = %s", body)
	}
	if v["max_concurrent"] != 0.0 || v["max_queue_depth"] != 0.0 || v["slots_in_use"] != 2.0 {
		t.Errorf("GET /leases aggregates = max_concurrent %v, max_queue_depth %v, slots_in_use %v; want 0, 0, 2",
			v["max_concurrent"], v["max_queue_depth"], v["slots_in_use"])
	}
	m := b.metrics()
	if m["nexus_broker_max_concurrent"] != 0 || m["nexus_broker_max_queue_depth"] != 0 || m["nexus_broker_slots_in_use"] != 2 {
		t.Errorf("gauges: max_concurrent %v, max_queue_depth %v, slots_in_use %v; want 0, 0, 2",
			m["nexus_broker_max_concurrent"], m["nexus_broker_max_queue_depth"], m["nexus_broker_slots_in_use"])
	}
}

// A temp-config directory that cannot be written (here: removed under a
// running spawnd, as a temp cleaner does) answers 500 "writing temp config",
// counted as a broker-side failure rather than an exec failure, and leaves
// nothing behind.
func TestAnUnwritableTempConfigDirAnswers500WritingTempConfig(t *testing.T) {
	tmp := filepath.Join(t.TempDir(), "tmp")
	if err := os.Mkdir(tmp, 0o700); err != nil {
		t.Fatal(err)
	}
	b := startBroker(t, Options{StateDir: true, Env: []string{"TMPDIR=" + tmp}})
	dirs, err := filepath.Glob(filepath.Join(tmp, "nexus-spawnd-*"))
	if err != nil || len(dirs) != 1 {
		t.Fatalf("nexus-spawnd's temp-config directory under TMPDIR: %v %v", dirs, err)
	}
	if err := os.RemoveAll(dirs[0]); err != nil {
		t.Fatal(err)
	}
	e := b.claimErr(brokerclient.ClaimRequest{})
	if e == nil || e.Status != 500 || e.Message != "writing temp config" {
		t.Fatalf("claim with no temp-config directory = %v, want 500 writing temp config", e)
	}
	m := b.metrics()
	if m[`nexus_broker_claims_total{outcome="internal"}`] != 1 || m[`nexus_broker_claims_total{outcome="spawn_failed"}`] != 0 ||
		m[`nexus_broker_spawn_failures_total{reason="exec"}`] != 0 {
		t.Errorf("claims_total internal %v, spawn_failed %v, spawn_failures_total exec %v; want 1, 0, 0",
			m[`nexus_broker_claims_total{outcome="internal"}`], m[`nexus_broker_claims_total{outcome="spawn_failed"}`],
			m[`nexus_broker_spawn_failures_total{reason="exec"}`])
	}
	if _, inUse := b.slots(); inUse != 0 || len(b.Instances()) != 0 {
		t.Errorf("after the failed claim: slots_in_use %d, instances %v", inUse, b.Instances())
	}
	b.SpawndLog.wait(t, regexp.MustCompile(`level=ERROR msg="spawning instance failed" .*error="writing temp config: `), time.Second)
}

// A graceful close gives the peer five seconds to echo the close frame
// before the connection is dropped, and drops it as soon as it does.
func TestAGracefulCloseWaitsFiveSecondsForTheEcho(t *testing.T) {
	b := startBroker(t, Options{})
	// closedAfter releases the lease and returns how long the broker kept
	// the connection open after its close frame reached the client.
	closedAfter := func(echo bool) time.Duration {
		t.Helper()
		claim := b.claim(brokerclient.ClaimRequest{})
		conn := b.dial(claim, brokerclient.DialOptions{})
		ws := conn.Underlying()
		if !echo {
			ws.SetCloseHandler(func(int, string) error { return nil }) // read the close frame, answer nothing
		}
		b.GatewayLog.wait(t, regexp.MustCompile(`msg="client connected" lease_id=`+claim.LeaseID), 10*time.Second)
		go func() { _ = b.Client.Release(context.Background(), claim.LeaseID) }()
		_ = ws.SetReadDeadline(time.Now().Add(30 * time.Second))
		for {
			_, _, err := ws.ReadMessage()
			var ce *websocket.CloseError
			if errors.As(err, &ce) {
				if ce.Code != websocket.CloseGoingAway || ce.Text != "lease closed" {
					t.Fatalf("close = %d %q, want 1001 lease closed", ce.Code, ce.Text)
				}
				break
			}
			if err != nil {
				t.Fatalf("reading until the close frame: %v", err)
			}
		}
		got := time.Now()
		raw := ws.UnderlyingConn()
		_ = raw.SetReadDeadline(time.Now().Add(30 * time.Second))
		if _, err := io.Copy(io.Discard, raw); err != nil && !strings.Contains(err.Error(), "reset") {
			t.Fatalf("waiting for the broker to drop the connection: %v", err)
		}
		return time.Since(got)
	}
	if d := closedAfter(false); d < 4500*time.Millisecond || d > 8*time.Second {
		t.Errorf("without an echo the broker dropped the connection %s after its close frame, want about 5s", d)
	}
	if d := closedAfter(true); d > 2*time.Second {
		t.Errorf("after an echo the broker kept the connection %s, want it dropped at once", d)
	}
}
