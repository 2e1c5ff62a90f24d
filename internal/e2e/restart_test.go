package e2e

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

func TestGatewayKill9RestoresAndReattachesEveryLease(t *testing.T) {
	b := startBroker(t, Options{})
	const n = 3
	var claims []*brokerclient.Claim
	var lastSeq []uint64
	for i := 0; i < n; i++ {
		c := b.claim(brokerclient.ClaimRequest{})
		conn := b.dial(c, brokerclient.DialOptions{})
		if got := say(t, conn, fmt.Sprintf("before %d", i)); got != fmt.Sprintf("echo #1: before %d", i) {
			t.Fatalf("answer = %q", got)
		}
		claims, lastSeq = append(claims, c), append(lastSeq, conn.LastSeq)
	}
	pids := b.Instances()

	b.KillGateway(syscall.SIGKILL)
	b.StartGateway()
	ids := make([]string, n)
	for i, c := range claims {
		ids[i] = c.LeaseID
	}
	// Restored as spawning, then active once each instance redials with its
	// secret (nexus-echo's backoff is at most 5s).
	b.waitStates(ids, "active", 20*time.Second)
	if after := b.Instances(); len(after) != len(pids) {
		t.Fatalf("instances before %v, after %v", pids, after)
	}
	for i, c := range claims {
		from := lastSeq[i]
		conn := b.dial(c, brokerclient.DialOptions{FromSeq: &from})
		// The old numbering is void: the socket opens with a restarted gap.
		_ = conn.Underlying().SetReadDeadline(time.Now().Add(10 * time.Second))
		_, data, err := conn.Underlying().ReadMessage()
		if err != nil || !strings.Contains(string(data), `"signal":"stream-gap"`) || !strings.Contains(string(data), `"reason":"restarted"`) {
			t.Fatalf("lease %d: first frame after restart = %s %v", i, data, err)
		}
		if got := say(t, conn, "after"); got != fmt.Sprintf("echo #2: after (earlier: before %d)", i) {
			t.Fatalf("lease %d after the restart: %q", i, got)
		}
	}
	m := b.metrics()
	if m[`nexus_broker_restored_leases_total{outcome="restored"}`] != n || m[`nexus_broker_restored_leases_total{outcome="reattached"}`] != n {
		t.Fatalf("restored_leases_total: %v", m)
	}
	if _, inUse := b.slots(); inUse != n {
		t.Fatalf("slots_in_use after restore = %d, want %d", inUse, n)
	}
	for _, c := range claims {
		if status, _ := b.do("POST", "/release/"+c.LeaseID, ""); status != 200 {
			t.Fatalf("release = %d", status)
		}
	}
	b.waitNoInstances(15 * time.Second)
	if _, inUse := b.slots(); inUse != 0 {
		t.Fatalf("slots_in_use = %d", inUse)
	}
}

func TestARestoredLeaseNobodyReattachesIsReaped(t *testing.T) {
	b := startBroker(t, Options{StateDir: true, YAML: "reattach_window: 1s\nrelease_grace: 1s\n"})
	claim := b.claim(brokerclient.ClaimRequest{})
	b.KillGateway(syscall.SIGKILL)
	// Freeze the instance so it cannot redial the new gateway.
	pids := b.Instances()
	for _, pid := range pids {
		_ = syscall.Kill(pid, syscall.SIGSTOP)
	}
	b.StartGateway()
	if st := b.leaseStates()[claim.LeaseID]; st != "spawning" {
		t.Fatalf("restored lease state = %q, want spawning", st)
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`level=INFO msg="restored lease from the journal; awaiting instance reattach" lease_id=`+claim.LeaseID+
		` pid=[1-9][0-9]* session_id=`+claim.SessionID+` binary=nexus principal_id=""`), 10*time.Second)
	b.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="no instance reattached to a restored lease within reattach_window; reaping it" lease_id=`+claim.LeaseID+
		` pid=[1-9][0-9]* reattach_window=1s`), 10*time.Second)
	b.waitNoInstances(15 * time.Second) // SIGKILL reaches a stopped process group
	if v := b.metrics()[`nexus_broker_restored_leases_total{outcome="reaped"}`]; v != 1 {
		t.Fatalf("reaped = %v", v)
	}
	b.waitEnded(map[string]string{claim.LeaseID: "reattach timeout"}, 5*time.Second)
}

func TestSIGHUPReload(t *testing.T) {
	b := startBroker(t, Options{})
	original, err := os.ReadFile(b.ConfigPath)
	if err != nil {
		t.Fatal(err)
	}
	hup := func() { _ = b.gateway.cmd.Process.Signal(syscall.SIGHUP) }

	// Adding an entry makes it listed and claimable without a restart.
	added := string(original) + fmt.Sprintf("  vision:\n    path: %q\n    label: Vision\nmax_concurrent: 3\n", bin("nexus-echo"))
	if err := os.WriteFile(b.ConfigPath, []byte(added), 0o600); err != nil {
		t.Fatal(err)
	}
	hup()
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="config reload applied" .*changed=binaries,max_concurrent`), 10*time.Second)
	if _, body := b.get("/binaries"); !strings.Contains(body, `{"name":"vision","label":"Vision"}`) {
		t.Fatalf("GET /binaries after reload = %s", body)
	}
	claim := b.claim(brokerclient.ClaimRequest{Binary: "vision"})
	if max, _ := b.slots(); max != 3 {
		t.Fatalf("max_concurrent after reload = %d", max)
	}

	// A broken file is rejected whole, boot-only edits in it included (a
	// rejected reload reports nothing as ignored), and the config in force
	// keeps serving.
	movedPort := regexp.MustCompile(`listen_addr: "127.0.0.1:\d+"`).ReplaceAllString(added, `listen_addr: "127.0.0.1:1"`)
	broken := strings.Replace(movedPort, bin("nexus-echo")+"\"\n    label", "/nonexistent/nexus\"\n    label", 1)
	if err := os.WriteFile(b.ConfigPath, []byte(broken), 0o600); err != nil {
		t.Fatal(err)
	}
	hup()
	b.GatewayLog.wait(t, regexp.MustCompile(`level=ERROR msg="config reload rejected; the configuration already in force is unchanged" .*vision`), 10*time.Second)
	bootOnlyWarn := regexp.MustCompile(`level=WARN msg="config reload: these keys changed in the file but are only read at boot[^"]*" path=\S+ keys=`)
	if b.GatewayLog.count(bootOnlyWarn) != 0 {
		t.Errorf("a rejected reload reported boot-only keys as ignored:\n%s", b.GatewayLog)
	}
	second := b.claim(brokerclient.ClaimRequest{Binary: "vision"})

	// Boot-only keys are reported and ignored, in the spec's order; the rest
	// still applies, queue_wait_timeout included: at the lowered cap a claim
	// is now refused at once instead of waiting 30 s.
	bootOnly := strings.Replace(movedPort, "max_concurrent: 3\n", "max_concurrent: 2\n", 1) +
		"idle_timeout: 7m\nqueue_wait_timeout: 0s\nauth: {validators: [{type: static, tokens: [{token: t, principal: p}]}]}\n"
	if err := os.WriteFile(b.ConfigPath, []byte(bootOnly), 0o600); err != nil {
		t.Fatal(err)
	}
	hup()
	b.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="config reload: these keys changed in the file but are only read at boot[^"]*" path=\S+ keys=listen_addr,auth\n`), 10*time.Second)
	b.GatewayLog.wait(t, regexp.MustCompile(`level=INFO msg="config reload applied" path=\S+ changed=max_concurrent,idle_timeout,queue_wait_timeout binaries=2 agents=0 max_concurrent=2 idle_timeout=7m0s queue_wait_timeout=0s release_grace=10s ready_timeout=30s\n`), 10*time.Second)
	start := time.Now()
	_, err = b.Client.Claim(context.Background(), brokerclient.ClaimRequest{Config: "engine: {}\n"})
	var api *brokerclient.APIError
	if !errors.As(err, &api) || api.Status != 503 || api.Message != "no capacity" {
		t.Errorf("a claim at the reloaded cap with queue_wait_timeout 0 = %v, want 503 no capacity", err)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("the refusal took %s: the reloaded queue_wait_timeout was not applied", took)
	}
	if err := b.Client.Release(context.Background(), second.LeaseID); err != nil {
		t.Fatal(err)
	}

	// A reload that changes nothing reloadable says so.
	hup()
	b.GatewayLog.wait(t, regexp.MustCompile(`level=INFO msg="config reload applied; no reloadable key changed" path=\S+\n`), 10*time.Second)

	// Live leases were never touched.
	conn := b.dial(claim, brokerclient.DialOptions{})
	if got := say(t, conn, "still"); got != "echo #1: still" {
		t.Fatalf("lease across reloads: %q", got)
	}
	m := b.metrics()
	if m[`nexus_broker_config_reloads_total{outcome="applied"}`] != 3 || m[`nexus_broker_config_reloads_total{outcome="rejected"}`] != 1 {
		t.Fatalf("config_reloads_total: %v", m)
	}
}

func TestSpawndShutdownLeavesInstancesForTheNextOne(t *testing.T) {
	b := startBroker(t, Options{StateDir: true})
	journal := filepath.Join(b.Dir, "state", "leases.jsonl")
	index := filepath.Join(b.Dir, "state", "session-binaries.jsonl")
	b.SpawndLog.wait(t, regexp.MustCompile(`level=INFO msg="lease journal opened" path=`+regexp.QuoteMeta(journal)+` live_leases=0 skipped_records=0`), 5*time.Second)
	b.SpawndLog.wait(t, regexp.MustCompile(`level=INFO msg="session binary index opened" path=`+regexp.QuoteMeta(index)+` bindings=0 skipped_records=0`), 5*time.Second)
	claim := b.claim(brokerclient.ClaimRequest{})
	conn := b.dial(claim, brokerclient.DialOptions{})

	// A stray SIGHUP (pkill -HUP -f nexus-broker matches spawnd too) is
	// logged and ignored.
	_ = b.spawnd.cmd.Process.Signal(syscall.SIGHUP)
	b.SpawndLog.wait(t, regexp.MustCompile(`SIGHUP ignored: send it to nexus-broker`), 5*time.Second)
	if b.spawnd.exited() {
		t.Fatal("spawnd died of a SIGHUP")
	}

	pids := b.Instances()
	b.KillSpawnd(syscall.SIGTERM)
	if after := b.Instances(); len(after) != 1 || after[0] != pids[0] {
		t.Fatalf("instances after spawnd's SIGTERM: %v, want %v", after, pids)
	}
	if got := say(t, conn, "spawnd is down"); got != "echo #1: spawnd is down" {
		t.Fatalf("the stream stopped with spawnd: %q", got)
	}
	// A record torn by a crash mid-write is skipped, and said so once in
	// upstream's words; the whole ones are read.
	f, err := os.OpenFile(journal, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteString(`{"kind":"minted","lease_id":"torn`); err != nil {
		t.Fatal(err)
	}
	_ = f.Close()
	b.StartSpawnd()
	b.SpawndLog.wait(t, regexp.MustCompile(`msg="instance re-adopted" lease_id=`+claim.LeaseID), 10*time.Second)
	b.SpawndLog.wait(t, regexp.MustCompile(`level=WARN msg="skipped unreadable lease journal records; the broker was most likely killed mid-write" path=`+regexp.QuoteMeta(journal)+` skipped=1 read=[1-9]\d*\n`), time.Second)
	b.SpawndLog.wait(t, regexp.MustCompile(`level=INFO msg="lease journal opened" path=`+regexp.QuoteMeta(journal)+` live_leases=1 skipped_records=1`), time.Second)
	if status, _ := b.do("POST", "/release/"+claim.LeaseID, ""); status != 200 {
		t.Fatalf("release through the new spawnd = %d", status)
	}
	b.waitNoInstances(10 * time.Second)
}

// TestAnIgnoredBootOnlyEditStaysPendingAcrossAGatewayRestart: a SIGHUP that
// carried a listen_addr edit ignored it, so a gateway restarted on that
// file would listen where spawnd's instances do not dial back: it is
// refused, naming the key. With the edit reverted it attaches and serves.
func TestAnIgnoredBootOnlyEditStaysPendingAcrossAGatewayRestart(t *testing.T) {
	b := startBroker(t, Options{})
	original, err := os.ReadFile(b.ConfigPath)
	if err != nil {
		t.Fatal(err)
	}
	moved := regexp.MustCompile(`listen_addr: "127.0.0.1:\d+"`).ReplaceAllString(string(original), fmt.Sprintf(`listen_addr: "127.0.0.1:%d"`, freePort(t)))
	if err := os.WriteFile(b.ConfigPath, []byte(moved), 0o600); err != nil {
		t.Fatal(err)
	}
	_ = b.gateway.cmd.Process.Signal(syscall.SIGHUP)
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="config reload applied; no reloadable key changed"`), 10*time.Second)
	b.KillGateway(syscall.SIGTERM)
	code, out := runToExit(t, b.env, "nexus-broker", "-config", b.ConfigPath, "-launch-spawnd=false")
	refused(t, "a gateway on the ignored listen_addr edit", code, out, "listen_addr, which nexus-spawnd reads only at boot")

	if err := os.WriteFile(b.ConfigPath, original, 0o600); err != nil {
		t.Fatal(err)
	}
	b.StartGateway()
	conn := b.dial(b.claim(brokerclient.ClaimRequest{}), brokerclient.DialOptions{})
	if got := say(t, conn, "back"); got != "echo #1: back" {
		t.Fatalf("after the revert: %q", got)
	}
}
