package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/a2aproject/a2a-go/v2/a2a"

	"github.com/nexus-broker/nexus-broker/internal/echo"
	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// poolConfig is the engine config the test pools boot with; a claim
// carrying it byte for byte is served warm.
const poolConfig = "engine:\n  name: pooled\n"

// poolYAML declares pool name on entry binary, min_idle warm instances
// booted from a config file holding poolConfig, and returns the YAML and
// that file's path.
func poolYAML(t *testing.T, name, binary string, minIdle int) (string, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), name+".yaml")
	if err := os.WriteFile(path, []byte(poolConfig), 0o600); err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("  - name: %s\n    binary: %s\n    config_file: %q\n    min_idle: %d\n", name, binary, path, minIdle), path
}

// warm is the warm leases ready now: active, draining not begun, and none
// of the leases the test claimed.
func (b *Broker) warm(claimed ...string) []leaseView {
	b.t.Helper()
	var out []leaseView
	for _, l := range b.leases().Leases {
		if l.State == "active" && !slices.Contains(claimed, l.LeaseID) {
			out = append(out, l)
		}
	}
	return out
}

// waitWarm waits until exactly n warm leases are ready and returns them.
func (b *Broker) waitWarm(n int, claimed ...string) []leaseView {
	b.t.Helper()
	var ws []leaseView
	eventually(b.t, 30*time.Second, func() string { return fmt.Sprintf("%d warm leases, have %s", n, toJSON(b.leases())) }, func() bool {
		ws = b.warm(claimed...)
		return len(ws) == n
	})
	return ws
}

func ids(ls []leaseView) []string {
	out := make([]string, len(ls))
	for i, l := range ls {
		out[i] = l.LeaseID
	}
	return out
}

// TestPooledClaimIsTheWarmInstance: a claim with the pool's config and no
// session_id is answered by the warm instance: the lease id it was spawned
// with, the session id it reported, and frames relay; its idle clock
// starts at the hand-out. Another config is a cold claim.
func TestPooledClaimIsTheWarmInstance(t *testing.T) {
	pools, _ := poolYAML(t, "default", "nexus", 1)
	b := startBroker(t, Options{YAML: "max_concurrent: 4\npools:\n" + pools})
	w := b.waitWarm(1)[0]
	if w.SessionID == "" {
		t.Fatalf("the warm lease reported no session id: %+v", w)
	}
	before := time.Now().UTC()
	c := b.claim(brokerclient.ClaimRequest{Config: poolConfig})
	if c.LeaseID != w.LeaseID || c.SessionID != w.SessionID {
		t.Fatalf("claim answered lease %s session %s, want the warm %s %s", c.LeaseID, c.SessionID, w.LeaseID, w.SessionID)
	}
	if !strings.HasSuffix(c.WSURL, "/lease/"+w.LeaseID) {
		t.Fatalf("ws_url %s", c.WSURL)
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="claim served by a warm instance" lease_id=`+w.LeaseID+` pool=default`), 5*time.Second)
	if l, _ := b.lease(c.LeaseID); l.State != "active" {
		t.Fatalf("claimed lease %+v", l)
	}
	var row struct {
		Leases []struct {
			LeaseID      string    `json:"lease_id"`
			LastActivity time.Time `json:"last_activity"`
		} `json:"leases"`
	}
	if err := b.Client.Get(context.Background(), "/leases", &row); err != nil {
		t.Fatal(err)
	}
	for _, l := range row.Leases {
		if l.LeaseID == c.LeaseID && l.LastActivity.Before(before.Add(-time.Second)) {
			t.Fatalf("last_activity %s, before the hand-out at %s", l.LastActivity, before)
		}
	}
	conn := b.dial(c, brokerclient.DialOptions{})
	if got := say(t, conn, "warm"); got != "echo #1: warm" {
		t.Fatalf("answer = %q", got)
	}
	cold := b.claim(brokerclient.ClaimRequest{Config: "engine:\n  name: other\n"})
	if cold.LeaseID == w.LeaseID || slices.Contains(ids(b.warm(c.LeaseID, cold.LeaseID)), cold.LeaseID) {
		t.Fatal("another config was served warm")
	}
}

// TestPoolRefillsAfterAClaim: after a claim takes a warm instance, the
// pool is back to min_idle with a new one.
func TestPoolRefillsAfterAClaim(t *testing.T) {
	pools, _ := poolYAML(t, "default", "nexus", 2)
	b := startBroker(t, Options{YAML: "max_concurrent: 4\npools:\n" + pools})
	before := ids(b.waitWarm(2))
	c := b.claim(brokerclient.ClaimRequest{Config: poolConfig})
	if !slices.Contains(before, c.LeaseID) {
		t.Fatalf("claimed %s, not one of the warm %v", c.LeaseID, before)
	}
	after := ids(b.waitWarm(2, c.LeaseID))
	fresh := 0
	for _, id := range after {
		if !slices.Contains(before, id) {
			fresh++
		}
	}
	if fresh != 1 {
		t.Fatalf("warm before %v, after the claim of %s %v: want one new", before, c.LeaseID, after)
	}
}

// TestWarmInstancesSurviveKill9 kills -9 spawnd, then the gateway, with
// warm instances and one handed out: each time the same warm leases are
// back (spawnd re-adopts them, the gateway restores them as warm, counting
// toward min_idle), none is lost and none spawned again; the handed-out
// one stays its claimant's and is never handed out again, and two claims
// get the two warm ones.
func TestWarmInstancesSurviveKill9(t *testing.T) {
	pools, _ := poolYAML(t, "default", "nexus", 2)
	b := startBroker(t, Options{StateDir: true, YAML: "max_concurrent: 5\npools:\n" + pools})
	b.waitWarm(2)
	first := b.claim(brokerclient.ClaimRequest{Config: poolConfig})
	firstConn := b.dial(first, brokerclient.DialOptions{})
	if a := say(t, firstConn, "before"); a != "echo #1: before" {
		t.Fatalf("answer = %q", a)
	}
	warm := ids(b.waitWarm(2, first.LeaseID))
	pids := b.Instances()

	b.KillSpawnd(syscall.SIGKILL)
	b.StartSpawnd()
	b.SpawndLog.wait(t, regexp.MustCompile(`msg="instance re-adopted"`), 30*time.Second)
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="following nexus-spawnd's instance exits"(?s:.*)msg="following nexus-spawnd's instance exits"`), 30*time.Second)
	if got := ids(b.waitWarm(2, first.LeaseID)); !sameSet(got, warm) {
		t.Fatalf("warm after spawnd's kill -9 %v, want %v", got, warm)
	}

	b.KillGateway(syscall.SIGKILL)
	b.StartGateway()
	b.waitStates(append([]string{first.LeaseID}, warm...), "active", 30*time.Second)
	if got := ids(b.waitWarm(2, first.LeaseID)); !sameSet(got, warm) {
		t.Fatalf("warm after the gateway's kill -9 %v, want %v", got, warm)
	}
	if after := b.Instances(); len(after) != len(pids) {
		t.Fatalf("instances before %v, after %v: warm instances were spawned again", pids, after)
	}
	var got []string
	for range 2 {
		c := b.claim(brokerclient.ClaimRequest{Config: poolConfig})
		got = append(got, c.LeaseID)
		conn := b.dial(c, brokerclient.DialOptions{})
		if a := say(t, conn, "back"); a != "echo #1: back" {
			t.Fatalf("answer = %q", a)
		}
	}
	if got[0] == got[1] || !slices.Contains(warm, got[0]) || !slices.Contains(warm, got[1]) {
		t.Fatalf("claims got %v, want each of the restored %v once", got, warm)
	}
	from := firstConn.LastSeq
	again := b.dial(first, brokerclient.DialOptions{FromSeq: &from})
	_ = again.Underlying().SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, data, err := again.Underlying().ReadMessage(); err != nil || !strings.Contains(string(data), `"stream-gap"`) {
		t.Fatalf("first frame on the restored claimed lease = %s %v", data, err)
	}
	if a := say(t, again, "after"); a != "echo #2: after (earlier: before)" {
		t.Fatalf("the lease handed out before the kills answered %q", a)
	}
}

func sameSet(a, b []string) bool {
	a, b = slices.Clone(a), slices.Clone(b)
	slices.Sort(a)
	slices.Sort(b)
	return slices.Equal(a, b)
}

// TestPoolThatFailsToBootBacksOff: a pool whose instances exit before
// ready backs off (100ms, then 200ms...), logging why with its name; its
// claims are cold spawns, and another pool is unaffected.
func TestPoolThatFailsToBootBacksOff(t *testing.T) {
	broken, _ := poolYAML(t, "broken", "doomed", 1)
	good, _ := poolYAML(t, "good", "nexus", 1)
	b := startBroker(t, Options{YAML: fmt.Sprintf("  doomed:\n    path: %q\n    env: {NEXUS_ECHO_EXIT_BEFORE_READY: \"1\"}\nmax_concurrent: 4\npools:\n%s%s",
		bin("nexus-echo"), broken, good)})
	for _, delay := range []string{"100ms", "200ms", "400ms"} {
		b.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="a warm instance of the pool failed to boot; backing off[^"]*" pool=broken binary=doomed error="instance exited before signalling ready: exit status \d+" failures=\d+ retry_in=`+delay), 30*time.Second)
	}
	w := b.waitWarm(1)[0]
	if w.Binary != "nexus" {
		t.Fatalf("warm %+v", w)
	}
	// The broken pool's claim is a cold spawn, which fails as that entry
	// does; the good pool still serves warm.
	_, err := b.Client.Claim(context.Background(), brokerclient.ClaimRequest{Binary: "doomed", Config: poolConfig})
	var api *brokerclient.APIError
	if !errors.As(err, &api) || api.Status != 502 {
		t.Fatalf("a claim of the broken pool = %v, want the cold spawn's 502", err)
	}
	if c := b.claim(brokerclient.ClaimRequest{Config: poolConfig}); c.LeaseID != w.LeaseID {
		t.Fatalf("the good pool's claim got %s, want %s", c.LeaseID, w.LeaseID)
	}
}

// TestWarmInstancesYieldTheirSlots: a claim that finds the slots held by
// cold leases and a warm instance ends the warm one and proceeds at once,
// never queueing (queue_wait_timeout 0 would refuse it); a claim queued
// meanwhile gets the next freed slot before any refill, and the pool
// refills once one frees.
func TestWarmInstancesYieldTheirSlots(t *testing.T) {
	pools, _ := poolYAML(t, "default", "nexus", 1)
	b := startBroker(t, Options{YAML: "max_concurrent: 2\nqueue_wait_timeout: 0s\npools:\n" + pools})
	w := b.waitWarm(1)[0]
	a := b.claim(brokerclient.ClaimRequest{})
	c := b.claim(brokerclient.ClaimRequest{})
	if c.LeaseID == w.LeaseID || a.LeaseID == w.LeaseID {
		t.Fatal("a cold config was served warm")
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="a warm instance gives its slot up to a claim" lease_id=`+w.LeaseID), 5*time.Second)
	eventually(t, 15*time.Second, func() string { return toJSON(b.leases()) }, func() bool {
		_, there := b.lease(w.LeaseID)
		return !there
	})
	if len(b.warm(a.LeaseID, c.LeaseID)) != 0 {
		t.Fatal("the pool refilled with no free slot")
	}
	if err := b.Client.Release(context.Background(), a.LeaseID); err != nil {
		t.Fatal(err)
	}
	b.waitWarm(1, c.LeaseID)
}

// TestAYieldedSlotIsFreeAtSpawnd: with spawnd.max_leases equal to
// max_concurrent, a claim that ends a warm instance for its slot spawns
// only once spawnd has answered that instance's Terminate (its ceiling
// excludes a lease being torn down from then), so spawnd never refuses
// it; each round the pool refills and the next claim yields it again.
func TestAYieldedSlotIsFreeAtSpawnd(t *testing.T) {
	pools, _ := poolYAML(t, "default", "nexus", 1)
	b := startBroker(t, Options{YAML: "max_concurrent: 2\nqueue_wait_timeout: 0s\npools:\n" + pools, SpawndYAML: "  max_leases: 2\n"})
	held := b.claim(brokerclient.ClaimRequest{})
	for round := range 10 {
		w := b.waitWarm(1, held.LeaseID)[0]
		c, err := b.Client.Claim(context.Background(), brokerclient.ClaimRequest{Config: "engine:\n  name: cold\n"})
		if err != nil {
			t.Fatalf("round %d: the claim the warm %s yielded to: %v\n%s", round, w.LeaseID, err, b.GatewayLog)
		}
		if c.LeaseID == w.LeaseID {
			t.Fatal("a cold config was served warm")
		}
		if err := b.Client.Release(context.Background(), c.LeaseID); err != nil {
			t.Fatal(err)
		}
	}
	if strings.Contains(b.GatewayLog.String(), "nexus-spawnd is at its own bound") {
		t.Fatalf("spawnd refused a spawn:\n%s", b.GatewayLog)
	}
}

// TestAQueuedClaimGetsAFreedSlotBeforeARefill: with the pool's instance
// yielded and a claim queued, a released slot goes to that claim; the pool
// refills only from the next one.
func TestAQueuedClaimGetsAFreedSlotBeforeARefill(t *testing.T) {
	pools, _ := poolYAML(t, "default", "nexus", 1)
	b := startBroker(t, Options{YAML: "max_concurrent: 2\nqueue_wait_timeout: 60s\npools:\n" + pools})
	b.waitWarm(1)
	a := b.claim(brokerclient.ClaimRequest{})
	c := b.claim(brokerclient.ClaimRequest{}) // the warm instance yields
	queued := make(chan *brokerclient.Claim, 1)
	go func() {
		got, err := b.Client.Claim(context.Background(), brokerclient.ClaimRequest{Config: "engine:\n  name: queued\n"})
		if err != nil {
			t.Errorf("the queued claim: %v", err)
		}
		queued <- got
	}()
	eventually(t, 15*time.Second, func() string { return toJSON(b.leases()) }, func() bool { return b.leases().QueueDepth == 1 })
	if err := b.Client.Release(context.Background(), a.LeaseID); err != nil {
		t.Fatal(err)
	}
	q := <-queued
	if q == nil {
		t.FailNow()
	}
	if v := b.leases(); v.SlotsInUse != 2 || len(b.warm(c.LeaseID, q.LeaseID)) != 0 {
		t.Fatalf("after the queued claim: %s; a refill took a slot", toJSON(v))
	}
	if err := b.Client.Release(context.Background(), c.LeaseID); err != nil {
		t.Fatal(err)
	}
	b.waitWarm(1, q.LeaseID)
}

// TestReloadRetiresAChangedPool: a SIGHUP after the pool's config file
// changed retires its warm instance and boots the new config's; the old
// config is then a cold claim.
func TestReloadRetiresAChangedPool(t *testing.T) {
	pools, path := poolYAML(t, "default", "nexus", 1)
	b := startBroker(t, Options{YAML: "max_concurrent: 4\npools:\n" + pools})
	old := b.waitWarm(1)[0]
	const next = "engine:\n  name: pooled-v2\n"
	if err := os.WriteFile(path, []byte(next), 0o600); err != nil {
		t.Fatal(err)
	}
	_ = b.gateway.cmd.Process.Signal(syscall.SIGHUP)
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="config reload applied" .*changed=[^ ]*pools`), 10*time.Second)
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="lease released" lease_id=`+old.LeaseID+` reason="pool reloaded"`), 15*time.Second)
	w := b.waitWarm(1)[0]
	if w.LeaseID == old.LeaseID {
		t.Fatal("the old warm instance is still there")
	}
	if c := b.claim(brokerclient.ClaimRequest{Config: poolConfig}); c.LeaseID == w.LeaseID || c.LeaseID == old.LeaseID {
		t.Fatalf("the old config was served warm: %s", c.LeaseID)
	}
	if c := b.claim(brokerclient.ClaimRequest{Config: next}); c.LeaseID != w.LeaseID {
		t.Fatalf("the new config's claim got %s, want %s", c.LeaseID, w.LeaseID)
	}
}

// TestConcurrentClaimsNeverShareAWarmLease: claims racing for a pool each
// get a lease of their own, every warm one handed out at most once.
func TestConcurrentClaimsNeverShareAWarmLease(t *testing.T) {
	pools, _ := poolYAML(t, "default", "nexus", 3)
	b := startBroker(t, Options{YAML: "max_concurrent: 12\npools:\n" + pools})
	warm := ids(b.waitWarm(3))
	const n = 8
	got := make([]string, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := b.Client.Claim(context.Background(), brokerclient.ClaimRequest{Config: poolConfig})
			if err != nil {
				t.Errorf("claim %d: %v", i, err)
				return
			}
			got[i] = c.LeaseID
		}()
	}
	wg.Wait()
	seen := map[string]bool{}
	hits := 0
	for _, id := range got {
		if id == "" || seen[id] {
			t.Fatalf("claims got %v: one lease twice", got)
		}
		seen[id] = true
		if slices.Contains(warm, id) {
			hits++
		}
	}
	if hits == 0 {
		t.Fatalf("no claim of %v was served by the warm %v", got, warm)
	}
}

// poolAuthYAML is the pool tests' auth: alice and bob, and ops, the
// operator (the harness's bearer, which sees warm leases).
const poolAuthYAML = `auth:
  validators:
    - type: static
      tokens:
        - {token: tok-alice, principal: alice}
        - {token: tok-bob, principal: bob}
        - {token: tok-ops, principal: ops, scopes: "nexus.broker.admin"}
`

// TestWarmLeaseUnreachableUnderAuth: with auth:, a warm lease is nobody's:
// no ticket, no connect, no release, not in a caller's own listing, only
// in the operator's; handed out, it is its claimant's alone.
func TestWarmLeaseUnreachableUnderAuth(t *testing.T) {
	pools, _ := poolYAML(t, "default", "nexus", 1)
	b := startBroker(t, Options{Token: "tok-ops", YAML: "max_concurrent: 4\n" + poolAuthYAML + "pools:\n" + pools})
	w := b.waitWarm(1)[0]
	unknown := func(who, token, what string, operator bool) {
		t.Helper()
		for _, r := range []struct{ method, path string }{{"POST", "/ticket/" + w.LeaseID}, {"POST", "/release/" + w.LeaseID}, {"GET", "/lease/" + w.LeaseID}} {
			if status, body := b.doAs(token, r.method, r.path, ""); status != 404 || !strings.Contains(body, "unknown lease") {
				t.Errorf("%s: %s %s %s = %d %s, want 404 unknown lease", what, who, r.method, r.path, status, body)
			}
		}
		if _, body := b.doAs(token, "GET", "/leases", ""); strings.Contains(body, w.LeaseID) != operator {
			t.Errorf("%s: %s's GET /leases lists it: %v, want %v: %s", what, who, !operator, operator, body)
		}
	}
	unknown("alice", "tok-alice", "warm", false)
	unknown("ops", "tok-ops", "warm", true) // an operator sees it, and reaches it no more
	alice := &brokerclient.Client{Base: b.Base, Token: "tok-alice"}
	c, err := alice.Claim(context.Background(), brokerclient.ClaimRequest{Config: poolConfig})
	if err != nil || c.LeaseID != w.LeaseID || c.Ticket == "" {
		t.Fatalf("alice's claim = %+v %v, want the warm %s with a ticket", c, err, w.LeaseID)
	}
	unknown("bob", "tok-bob", "handed to alice", false)
	conn := b.dial(c, brokerclient.DialOptions{Ticket: c.Ticket})
	if got := say(t, conn, "mine"); got != "echo #1: mine" {
		t.Fatalf("answer = %q", got)
	}
}

// TestARestartRetiresTheWarmInstancesOfAChangedPool: a gateway restarted
// after the pool's config file changed adopts none of the old config's
// warm instances: it retires them and boots the new config's.
func TestARestartRetiresTheWarmInstancesOfAChangedPool(t *testing.T) {
	pools, path := poolYAML(t, "default", "nexus", 1)
	b := startBroker(t, Options{StateDir: true, YAML: "max_concurrent: 4\npools:\n" + pools})
	old := b.waitWarm(1)[0]
	b.KillGateway(syscall.SIGKILL)
	const next = "engine:\n  name: pooled-v2\n"
	if err := os.WriteFile(path, []byte(next), 0o600); err != nil {
		t.Fatal(err)
	}
	b.StartGateway()
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="retiring a warm instance of a pool no longer in force" lease_id=`+old.LeaseID), 10*time.Second)
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="lease released" lease_id=`+old.LeaseID+` reason="pool reloaded"`), 15*time.Second)
	w := b.waitWarm(1)[0]
	if c := b.claim(brokerclient.ClaimRequest{Config: next}); c.LeaseID != w.LeaseID || w.LeaseID == old.LeaseID {
		t.Fatalf("the new config's claim got %s, want the new warm %s (old %s)", c.LeaseID, w.LeaseID, old.LeaseID)
	}
}

// TestABootingWarmInstanceYieldsItsSlot: a claim that finds the slots
// held by a cold lease and a warm instance still booting ends the boot
// and proceeds at once (queue_wait_timeout 0 would refuse a queued one);
// the instance is gone, and the pool is not backed off for it.
func TestABootingWarmInstanceYieldsItsSlot(t *testing.T) {
	pools, _ := poolYAML(t, "slow", "slow", 1)
	b := startBroker(t, Options{YAML: fmt.Sprintf("  slow:\n    path: %q\n    env: {NEXUS_ECHO_BOOT_DELAY: \"60s\"}\nmax_concurrent: 2\nqueue_wait_timeout: 0s\npools:\n%s",
		bin("nexus-echo"), pools)})
	eventually(t, 15*time.Second, func() string { return toJSON(b.leases()) }, func() bool {
		v := b.leases()
		return len(v.Leases) == 1 && v.Leases[0].State == "spawning"
	})
	booting := b.leases().Leases[0].LeaseID
	a := b.claim(brokerclient.ClaimRequest{})
	c := b.claim(brokerclient.ClaimRequest{})
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="a warm instance gives its slot up to a claim" lease_id=`+booting), 5*time.Second)
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="lease released" lease_id=`+booting+` reason="yielded to a claim"`), 15*time.Second)
	eventually(t, 15*time.Second, func() string { return toJSON(b.Instances()) }, func() bool { return len(b.Instances()) == 2 })
	if strings.Contains(b.GatewayLog.String(), "backing off") {
		t.Fatalf("a yielded boot backed the pool off:\n%s", b.GatewayLog)
	}
	for _, cl := range []*brokerclient.Claim{a, c} {
		if got := say(t, b.dial(cl, brokerclient.DialOptions{}), "x"); got != "echo #1: x" {
			t.Fatalf("answer = %q", got)
		}
	}
}

// TestAWarmProfileStartsConversationsWarm: a conversation of an agents:
// profile with warm: starts on the profile's warm instance, through the
// A2A door's claim, and the pool refills.
func TestAWarmProfileStartsConversationsWarm(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "warmed.yaml")
	if err := os.WriteFile(cfg, []byte(poolConfig), 0o600); err != nil {
		t.Fatal(err)
	}
	b := startBroker(t, Options{YAML: fmt.Sprintf("max_concurrent: 4\nagents:\n  warmed: {config: %q, warm: 1, card: {name: W, description: D, version: \"1\"}}\n", cfg)})
	w := b.waitWarm(1)[0]
	if w.Pool != "warmed" {
		t.Fatalf("the warm lease is %+v, want the warmed profile's pool", w)
	}
	c := a2aClient(t, b, "warmed", a2a.TransportProtocolJSONRPC)
	if got := answerOf(t, sendTask(t, c, userMsg("conv-warm", "hello"))); got != "echo #1: hello" {
		t.Fatalf("answer %q", got)
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="claim served by a warm instance" lease_id=`+w.LeaseID+` pool=warmed session_id=`+w.SessionID), 5*time.Second)
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="a2a turn started an agent instance" profile=warmed context_id=conv-warm session_id=`+w.SessionID+` lease_id=`+w.LeaseID), 5*time.Second)
	if hits := b.poolHits("warmed"); hits != 1 {
		t.Errorf("pool warmed hits = %v, want 1", hits)
	}
	if l, ok := b.lease(w.LeaseID); !ok || l.Pool != "" {
		t.Errorf("the conversation's lease is listed as %+v (%v), without a pool once handed out", l, ok)
	}
	b.waitWarm(1, w.LeaseID)
}

var handOutFailedRE = regexp.MustCompile(`msg="handing a warm instance out failed[^"]*" lease_id=(\S+) pool=default`)

// TestAHandOutTheJournalCannotRecordIsRefused: with the state_dir's disk
// full, a hand-out spawnd cannot record is refused with the journal's 503
// and Retry-After, never answered 200; that warm instance is retired and,
// once space returns, never handed to a claim.
func TestAHandOutTheJournalCannotRecordIsRefused(t *testing.T) {
	dir := t.TempDir()
	state := filepath.Join(dir, "state")
	smallTmpfs(t, state, "2m")
	pools, _ := poolYAML(t, "default", "nexus", 3)
	b := startBroker(t, Options{Dir: dir, StateDir: true, YAML: "max_concurrent: 8\npools:\n" + pools})
	b.waitWarm(3)
	filler := filepath.Join(state, "filler")
	fill(t, filler)

	// The journal's last page may still take a record or a few: hand-outs
	// answered 200 meanwhile are recorded.
	var claimed []string
	for tries := 0; !handOutFailedRE.MatchString(b.GatewayLog.String()); tries++ {
		if tries == 30 {
			t.Fatalf("30 claims and no hand-out refused with the journal's disk full:\n%s", b.GatewayLog)
		}
		resp, err := http.Post(b.Base+"/claim", "application/json", strings.NewReader(fmt.Sprintf(`{"config":%q}`, poolConfig)))
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		switch resp.StatusCode {
		case http.StatusOK:
			var c brokerclient.Claim
			if err := json.Unmarshal(body, &c); err != nil {
				t.Fatal(err)
			}
			claimed = append(claimed, c.LeaseID)
		case http.StatusServiceUnavailable:
			if resp.Header.Get("Retry-After") == "" || strings.TrimSpace(string(body)) != `{"error":"lease journal unavailable"}` {
				t.Fatalf("refusal: Retry-After %q, body %s", resp.Header.Get("Retry-After"), body)
			}
		default:
			t.Fatalf("claim with the disk full: %d %s", resp.StatusCode, body)
		}
	}
	refused := handOutFailedRE.FindStringSubmatch(b.GatewayLog.String())[1]
	if slices.Contains(claimed, refused) {
		t.Fatalf("%s was answered 200 and refused", refused)
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="lease released" lease_id=`+refused+` reason="hand-out not recorded"`), 15*time.Second)

	if err := os.Remove(filler); err != nil {
		t.Fatal(err)
	}
	b.SpawndLog.wait(t, regexp.MustCompile(`the lease journal was rewritten from memory`), 10*time.Second)
	for range 4 {
		eventually(t, 30*time.Second, func() string { return "a warm instance again" }, func() bool { return len(b.warm(claimed...)) > 0 })
		c := b.claim(brokerclient.ClaimRequest{Config: poolConfig})
		if c.LeaseID == refused || slices.Contains(claimed, c.LeaseID) {
			t.Fatalf("claim got %s: refused %s, handed out before %v", c.LeaseID, refused, claimed)
		}
		claimed = append(claimed, c.LeaseID)
	}
}

// TestAHandOutSpawndRefusesSpawnsCold: a warm instance whose session is
// another principal's (its entry reports a fixed id, which alice's claim
// of the pool's first instance made hers) is refused to bob by spawnd's
// hand-out (FailedPrecondition); bob's claim is then no 503 but a cold
// claim with a session of its own, and that warm instance is retired.
func TestAHandOutSpawndRefusesSpawnsCold(t *testing.T) {
	reported := filepath.Join(t.TempDir(), "reported-session")
	if err := os.WriteFile(reported, []byte("sess-alices"), 0o644); err != nil {
		t.Fatal(err)
	}
	pools, _ := poolYAML(t, "default", "fixed", 1)
	b := startBroker(t, Options{Token: "tok-ops", YAML: fmt.Sprintf(`  fixed:
    path: %q
    env: {%s: %q}
max_concurrent: 4
%spools:
%s`, bin("nexus-echo"), echo.EnvReportSessionFrom, reported, poolAuthYAML, pools)})
	alice := &brokerclient.Client{Base: b.Base, Token: "tok-alice"}
	bob := &brokerclient.Client{Base: b.Base, Token: "tok-bob"}
	req := brokerclient.ClaimRequest{Binary: "fixed", Config: poolConfig}
	first := b.waitWarm(1)[0]
	a, err := alice.Claim(context.Background(), req)
	if err != nil || a.LeaseID != first.LeaseID || a.SessionID != "sess-alices" {
		t.Fatalf("alice's claim = %+v %v, want the warm %s with sess-alices", a, err, first.LeaseID)
	}
	w := b.waitWarm(1, a.LeaseID)[0] // it reported sess-alices too
	if err := os.WriteFile(reported, []byte("sess-bobs"), 0o644); err != nil {
		t.Fatal(err)
	}
	c, err := bob.Claim(context.Background(), req)
	if err != nil || c.LeaseID == w.LeaseID || c.SessionID != "sess-bobs" {
		t.Fatalf("bob's claim = %+v %v, want a cold claim (not %s) with sess-bobs", c, err, w.LeaseID)
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="nexus-spawnd refused to hand a warm instance out[^"]*" lease_id=`+w.LeaseID+` pool=default error=".*belongs to another principal"`), 5*time.Second)
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="lease released" lease_id=`+w.LeaseID+` reason="hand-out refused"`), 15*time.Second)
}

// TestWarmLeasesAreExemptFromIdleUntilClaimed: a warm lease outlives
// idle_timeout (a cold lease claimed after it is reaped first), and once
// handed out is reaped at idle_timeout from its hand-out.
func TestWarmLeasesAreExemptFromIdleUntilClaimed(t *testing.T) {
	pools, _ := poolYAML(t, "default", "nexus", 1)
	b := startBroker(t, Options{YAML: "max_concurrent: 4\nidle_timeout: 1s\npools:\n" + pools})
	w := b.waitWarm(1)[0]
	cold := b.claim(brokerclient.ClaimRequest{})
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="releasing idle lease" lease_id=`+cold.LeaseID), 10*time.Second)
	if l, ok := b.lease(w.LeaseID); !ok || l.State != "active" {
		t.Fatalf("the warm lease after a later one idled out: %+v %v", l, ok)
	}
	if strings.Contains(b.GatewayLog.String(), `msg="releasing idle lease" lease_id=`+w.LeaseID) {
		t.Fatal("the warm lease was reaped as idle")
	}
	handedOut := time.Now()
	if c := b.claim(brokerclient.ClaimRequest{Config: poolConfig}); c.LeaseID != w.LeaseID {
		t.Fatalf("claimed %s, want %s", c.LeaseID, w.LeaseID)
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="releasing idle lease" lease_id=`+w.LeaseID), 10*time.Second)
	if took := time.Since(handedOut); took < time.Second {
		t.Fatalf("reaped %s after its hand-out, before idle_timeout", took)
	}
}

// TestMaxAgeRecyclesAWarmInstance: a warm instance nobody claimed within
// max_age is retired and replaced.
func TestMaxAgeRecyclesAWarmInstance(t *testing.T) {
	pools, _ := poolYAML(t, "default", "nexus", 1)
	b := startBroker(t, Options{YAML: "max_concurrent: 4\npools:\n" + pools + "    max_age: 1s\n"})
	w := b.waitWarm(1)[0]
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="lease released" lease_id=`+w.LeaseID+` reason="pool max_age"`), 15*time.Second)
	if next := b.waitWarm(1)[0]; next.LeaseID == w.LeaseID {
		t.Fatal("not replaced")
	}
}

// TestARetiredSlotIsFreeAtSpawnd: with spawnd.max_leases equal to
// max_concurrent and the other slot held, the slot of a warm instance
// retired at max_age is taken by its pool's refill only once spawnd has
// answered that instance's Terminate, so spawnd never refuses the refill's
// spawn; each round the replacement is retired in turn.
func TestARetiredSlotIsFreeAtSpawnd(t *testing.T) {
	pools, _ := poolYAML(t, "default", "nexus", 1)
	b := startBroker(t, Options{YAML: "max_concurrent: 2\npools:\n" + pools + "    max_age: 1s\n", SpawndYAML: "  max_leases: 2\n"})
	held := b.claim(brokerclient.ClaimRequest{Config: "engine:\n  name: cold\n"})
	var prev string
	for round := range 6 {
		w := b.waitWarm(1, held.LeaseID, prev)[0]
		b.GatewayLog.wait(t, regexp.MustCompile(`msg="lease released" lease_id=`+w.LeaseID+` reason="pool max_age"`), 15*time.Second)
		if s := b.GatewayLog.String(); strings.Contains(s, "nexus-spawnd is at its own bound") {
			t.Fatalf("round %d: spawnd refused the refill of the retired %s:\n%s", round, w.LeaseID, s)
		}
		prev = w.LeaseID
	}
}

// TestClusterAFullBrokerServesItsOwnWarmInstance: in cluster mode a claim
// on a broker whose slots are full, one held by a warm instance of the
// claim's pool, is handed that instance rather than offered to a peer.
func TestClusterAFullBrokerServesItsOwnWarmInstance(t *testing.T) {
	pools, _ := poolYAML(t, "default", "nexus", 1)
	_, bs := startCluster(t, "max_concurrent: 2\npools:\n"+pools, "", "a", "b")
	a := bs["a"]
	var w leaseView // A's; GET /leases in cluster mode lists every broker's
	eventually(t, 30*time.Second, func() string { return toJSON(a.leases()) }, func() bool {
		for _, l := range a.warm() {
			if strings.HasSuffix(l.LeaseID, "-a") {
				w = l
				return true
			}
		}
		return false
	})
	cold := a.claim(brokerclient.ClaimRequest{})
	if owner := cold.LeaseID[strings.LastIndexByte(cold.LeaseID, '-')+1:]; owner != "a" {
		t.Fatalf("a claim on A with a free slot is %s's", owner)
	}
	if c := a.claim(brokerclient.ClaimRequest{Config: poolConfig}); c.LeaseID != w.LeaseID {
		t.Fatalf("the pooled claim on a full A got %s, want A's warm %s", c.LeaseID, w.LeaseID)
	}
}
