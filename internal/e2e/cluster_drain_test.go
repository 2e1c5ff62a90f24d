package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/sockdir"
	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// clusterView is GET /cluster as a test reads it.
type clusterView struct {
	Brokers []struct {
		BrokerID      string     `json:"broker_id"`
		Self          bool       `json:"self"`
		AdvertiseAddr string     `json:"advertise_addr"`
		LastHeartbeat *time.Time `json:"last_heartbeat"`
		Reachable     bool       `json:"reachable"`
		SlotsInUse    int        `json:"slots_in_use"`
		MaxConcurrent int        `json:"max_concurrent"`
		Binaries      []string   `json:"binaries"`
		Version       string     `json:"version"`
		Routed        bool       `json:"routed"`
		Draining      bool       `json:"draining"`
	} `json:"brokers"`
}

func (b *Broker) clusterView() clusterView {
	b.t.Helper()
	status, body := b.get("/cluster")
	if status != 200 {
		b.t.Fatalf("GET /cluster on %s: %d %s", b.Base, status, body)
	}
	var v clusterView
	if err := json.Unmarshal([]byte(body), &v); err != nil {
		b.t.Fatal(err)
	}
	return v
}

// drained reports whether GET /cluster on b lists broker id, and as
// draining.
func (b *Broker) drained(id string) (listed, draining bool) {
	for _, x := range b.clusterView().Brokers {
		if x.BrokerID == id {
			return true, x.Draining
		}
	}
	return false, false
}

// control runs nexus-broker -drain or -undrain against b's config.
func (b *Broker) control(verb string) string {
	b.t.Helper()
	out, err := exec.Command(bin("nexus-broker"), "-"+verb, "-config", b.ConfigPath).CombinedOutput()
	if err != nil {
		b.t.Fatalf("nexus-broker -%s: %v\n%s", verb, err, out)
	}
	return string(out)
}

// TestClusterDrain: three brokers, each with only its own NATS
// permissions. nexus-broker -drain on A (through its control socket, at
// the control_socket A's config names, outside its run directory):
// A's /readyz says draining, a claim on A is refused while A's lease keeps
// streaming (through A and through B), GET /cluster on every broker shows
// A draining, and a full B offers its claims to C only, though A has a
// free slot: with C full too, the claim times out and A still runs its one
// instance. -undrain ends it. A broker stopped cleanly then leaves GET
// /cluster at once.
func TestClusterDrain(t *testing.T) {
	ids := []string{"a", "b", "c"}
	ns := permittedNATS(t, ids...)
	// A's control socket is in a directory of its own, as the deploy/
	// units have it (a gateway that cannot write spawnd's run directory).
	ctlSock := filepath.Join(sockdir.New(t, "nxg"), "control.sock")
	join := permittedMember(ns)
	member := func(id string) (string, []string) {
		yaml, env := join(id)
		if id == "a" {
			yaml = fmt.Sprintf("control_socket: %q\n", ctlSock) + yaml
		}
		return yaml, env
	}
	bs := startMembers(t, member, Options{YAML: clusterAuthYAML + "max_concurrent: 2\nqueue_wait_timeout: 1s\n", Token: "alice-token"}, ids...)
	a, b, c := bs["a"], bs["b"], bs["c"]
	if st, err := os.Lstat(ctlSock); err != nil || st.Mode().Type() != os.ModeSocket || st.Mode().Perm() != 0o600 {
		t.Fatalf("A's control_socket %s: %v, %v; want a socket of mode 0600", ctlSock, st, err)
	}
	if _, err := os.Lstat(filepath.Join(a.RunDir, "control.sock")); !os.IsNotExist(err) {
		t.Fatalf("control.sock in A's run directory: %v; want none with control_socket set", err)
	}
	held := a.claim(brokerclient.ClaimRequest{})
	conn := dialVia(t, a, held.LeaseID, brokerclient.DialOptions{Token: "alice-token"})
	if got := say(t, conn, "before"); got != "echo #1: before" {
		t.Fatalf("the lease on A answered %q", got)
	}

	if out := a.control("drain"); !strings.Contains(out, "draining") {
		t.Fatalf("nexus-broker -drain said %q", out)
	}
	status, body := a.get("/readyz")
	if status != 503 || !strings.Contains(body, `"status":"draining"`) {
		t.Fatalf("GET /readyz on a draining A: %d %s, want 503 draining", status, body)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := a.Client.Claim(ctx, brokerclient.ClaimRequest{Config: "engine:\n  name: example\n"})
	var api *brokerclient.APIError
	if !errors.As(err, &api) || api.Status != 503 || !strings.Contains(api.Message, "draining") {
		t.Fatalf("a claim on a draining A: %v, want 503 naming the drain", err)
	}
	if got := say(t, conn, "during"); !strings.HasPrefix(got, "echo #2: during") {
		t.Fatalf("A's lease while A drains answered %q", got)
	}
	viaB := dialVia(t, b, held.LeaseID, brokerclient.DialOptions{Token: "alice-token"})
	if got := say(t, viaB, "via b"); !strings.HasPrefix(got, "echo #3: via b") {
		t.Fatalf("A's lease through B while A drains answered %q", got)
	}
	for _, x := range []*Broker{a, b, c} {
		eventually(t, 10*time.Second, func() string { return "GET /cluster on " + x.Base + " showing A draining" }, func() bool {
			_, draining := x.drained("a")
			return draining
		})
	}
	v := a.clusterView()
	if len(v.Brokers) != 3 || v.Brokers[0].BrokerID != "a" || !v.Brokers[0].Self || v.Brokers[0].SlotsInUse != 1 {
		t.Fatalf("GET /cluster on A: %+v; want A first (self, 1 slot used), then B and C", v.Brokers)
	}
	for _, x := range v.Brokers[1:] {
		if x.AdvertiseAddr != bs[x.BrokerID].Addr || x.LastHeartbeat == nil || !x.Reachable || !x.Routed || x.MaxConcurrent != 2 ||
			x.Version == "" || len(x.Binaries) != 1 || x.Binaries[0] != "nexus" || x.Draining {
			t.Errorf("GET /cluster on A lists %+v; want %s's advertise_addr, a heartbeat, reachable, routed, 2 slots, a version, binaries [nexus], not draining", x, bs[x.BrokerID].Addr)
		}
	}
	if code, _ := b.doAs("bob-token", "GET", "/cluster", ""); code != 403 {
		t.Fatalf("GET /cluster with a token lacking the admin scope: %d, want 403", code)
	}

	// B fills, then offers: to C only.
	for i := 0; i < 4; i++ {
		b.claim(brokerclient.ClaimRequest{})
	}
	if na, nb, nc := len(a.Instances()), len(b.Instances()), len(c.Instances()); na != 1 || nb != 2 || nc != 2 {
		t.Fatalf("after four claims on B: A runs %d, B %d, C %d instances; want 1, 2, 2 (none offered to the draining A)", na, nb, nc)
	}
	_, err = b.Client.Claim(ctx, brokerclient.ClaimRequest{Config: "engine:\n  name: example\n"})
	if !errors.As(err, &api) || api.Status != 503 {
		t.Fatalf("a claim with B and C full and A draining: %v, want 503", err)
	}
	if n := len(a.Instances()); n != 1 {
		t.Fatalf("the draining A runs %d instances, want its 1", n)
	}

	if out := a.control("undrain"); !strings.Contains(out, "serving") {
		t.Fatalf("nexus-broker -undrain said %q", out)
	}
	if status, body := a.get("/readyz"); status != 200 {
		t.Fatalf("GET /readyz on an undrained A: %d %s", status, body)
	}
	a.claim(brokerclient.ClaimRequest{})

	c.KillGateway(syscall.SIGTERM)
	eventually(t, 2*time.Second, func() string { return "C leaving B's GET /cluster" }, func() bool {
		listed, _ := b.drained("c")
		return !listed
	})
}

// TestClusterRememberedOwnerIs503AfterARestart: B restarts while A is
// away (stopped cleanly, its lease left running in its spawnd). B has not
// heard A since its boot, and NATS says nobody subscribes to A's subjects,
// but A is in B's membership record: A's lease is 503 through B, not 404.
// A lease id naming a broker B never heard is still 404.
func TestClusterRememberedOwnerIs503AfterARestart(t *testing.T) {
	_, bs := startCluster(t, "", "", "a", "b")
	a, b := bs["a"], bs["b"]
	held := a.claim(brokerclient.ClaimRequest{})
	a.KillGateway(syscall.SIGTERM)
	b.KillGateway(syscall.SIGTERM)
	b.StartGateway(clusterSecretEnv + "=" + clusterSecret)
	if status, body := b.do("POST", "/ticket/"+held.LeaseID, ""); status != 503 || !strings.Contains(body, "lease owner unavailable") {
		t.Fatalf("A's lease through a restarted B that remembers A: %d %s, want 503 lease owner unavailable", status, body)
	}
	if status, body := b.do("POST", "/ticket/0123456789abcdef0123456789abcdef-zzz", ""); status != 404 {
		t.Fatalf("a lease of a broker never heard: %d %s, want 404", status, body)
	}
}

// TestClusterSlowPeerIsSkippedAfterOfferTimeout: a full A offers a claim to
// B, which looks free (its heartbeats are current) but whose gateway is
// stopped. B does not accept within cluster.offer_timeout, so A moves on
// (here: to its own queue, which times out after queue_wait_timeout) and
// answers at once instead of waiting out the spawn's bounds on B.
func TestClusterSlowPeerIsSkippedAfterOfferTimeout(t *testing.T) {
	ns := startNATS(t, 0, nil)
	slowBeat := func(id string) (string, []string) { return clusterYAMLEvery(id, ns.ClientURL(), "1s"), nil }
	bs := startMembers(t, slowBeat, Options{YAML: "max_concurrent: 1\nqueue_wait_timeout: 1s\n"}, "a", "b")
	a, b := bs["a"], bs["b"]
	a.claim(brokerclient.ClaimRequest{})
	if err := b.gateway.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.gateway.cmd.Process.Signal(syscall.SIGCONT) })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_, err := a.Client.Claim(ctx, brokerclient.ClaimRequest{Config: "engine:\n  name: example\n"})
	var api *brokerclient.APIError
	if !errors.As(err, &api) || api.Status != 503 || api.Message != "capacity wait timed out" {
		t.Fatalf("a claim on a full A whose only peer is stopped: %v, want 503 capacity wait timed out", err)
	}
	a.GatewayLog.wait(t, regexp.MustCompile(`did not accept an offered claim within cluster.offer_timeout.*peer=b`), 5*time.Second)
}

// TestClusterForgetAfterErrorsNameTheKey: a cluster.forget_after shorter
// than three heartbeat intervals is a rejected SIGHUP naming the key, the
// broker serving on; at boot it is a refused boot naming it.
func TestClusterForgetAfterErrorsNameTheKey(t *testing.T) {
	_, bs := startCluster(t, "", "", "a")
	a := bs["a"]
	text, err := os.ReadFile(a.ConfigPath)
	if err != nil {
		t.Fatal(err)
	}
	bad := strings.Replace(string(text), "  heartbeat_interval: 100ms\n", "  heartbeat_interval: 100ms\n  forget_after: 200ms\n", 1)
	if err := os.WriteFile(a.ConfigPath, []byte(bad), 0o600); err != nil {
		t.Fatal(err)
	}
	if got := a.reload(t); !strings.HasPrefix(got, "rejected") {
		t.Fatalf("a SIGHUP with forget_after 200ms: %s", got)
	}
	const want = "cluster.forget_after: 200ms is shorter than three heartbeat intervals (300ms)"
	if !strings.Contains(unquoted(a.GatewayLog.String()), want) {
		t.Fatalf("the rejected reload does not say %q:\n%s", want, a.GatewayLog)
	}
	if status, _ := a.get("/readyz"); status != 200 {
		t.Fatalf("after the rejected reload /readyz is %d", status)
	}
	a.KillGateway(syscall.SIGTERM)
	code, out := runToExit(t, append(append([]string{}, a.env...), clusterSecretEnv+"="+clusterSecret), "nexus-broker", "-config", a.ConfigPath, "-launch-spawnd=false")
	refused(t, "a boot with forget_after 200ms", code, out, want)
}
