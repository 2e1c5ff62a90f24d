package e2e

import (
	"os"
	"path/filepath"
	"regexp"
	"syscall"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc"
)

// TestAReleaseAnsweredWhileSpawndIsStoppedIsDoneAfterTheGatewayDies: with
// spawnd SIGSTOPped a release is answered at once; the gateway is then
// killed before spawnd wakes, and the release is carried out all the same
// (journaled as a manual release), with no gateway running at all.
func TestAReleaseAnsweredWhileSpawndIsStoppedIsDoneAfterTheGatewayDies(t *testing.T) {
	b := startBroker(t, Options{StateDir: true, YAML: "release_grace: 1s\n"})
	claim := b.claim(brokerclient.ClaimRequest{})
	kept := b.claim(brokerclient.ClaimRequest{})
	spawnd := b.spawnd.cmd.Process.Pid
	if err := syscall.Kill(spawnd, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	continued := false
	t.Cleanup(func() {
		if !continued {
			_ = syscall.Kill(spawnd, syscall.SIGCONT)
		}
	})
	eventually(t, 15*time.Second, func() string { return "the gateway sees spawnd not answering" }, func() bool {
		code, _ := b.get("/readyz")
		return code == 503
	})
	answered := time.Now()
	if code, body := b.do("POST", "/release/"+claim.LeaseID, ""); code != 200 {
		t.Fatalf("release with spawnd stopped: %d %s", code, body)
	}
	if took := time.Since(answered); took > 5*time.Second {
		t.Fatalf("the release took %v to answer with spawnd stopped", took)
	}
	b.KillGateway(syscall.SIGKILL)
	if err := syscall.Kill(spawnd, syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	continued = true

	b.waitEnded(map[string]string{claim.LeaseID: "manual release"}, 20*time.Second)
	eventually(t, 10*time.Second, func() string { return "one instance left, the lease not released" }, func() bool { return len(b.Instances()) == 1 })
	b.SpawndLog.wait(t, regexp.MustCompile(`msg="carrying out a release the gateway handed over" lease_id=`+claim.LeaseID), time.Second)
	dir := filepath.Join(b.RunDir, spawnrpc.ReleasesDir)
	eventually(t, 5*time.Second, func() string { return dir + " empty once the lease is gone" }, func() bool {
		left, err := os.ReadDir(dir)
		return err == nil && len(left) == 0
	})

	b.StartGateway()
	b.waitStates([]string{kept.LeaseID}, "active", 20*time.Second)
	if _, ok := b.lease(claim.LeaseID); ok {
		t.Fatalf("the released lease is back after the restart")
	}
}

// TestASpawndWithoutStateDirEndsItsInstancesAsItStops: nothing could adopt
// them, so a spawnd stopping without state_dir ends its instances rather
// than leave them redialling a gateway that cannot know them.
func TestASpawndWithoutStateDirEndsItsInstancesAsItStops(t *testing.T) {
	b := startBroker(t, Options{})
	b.claim(brokerclient.ClaimRequest{})
	b.claim(brokerclient.ClaimRequest{})
	if n := len(b.Instances()); n != 2 {
		t.Fatalf("%d instances for 2 leases", n)
	}
	b.KillSpawnd(syscall.SIGTERM)
	if left := b.Instances(); len(left) != 0 {
		t.Fatalf("a spawnd without state_dir stopped and left instances %v running", left)
	}
	b.SpawndLog.wait(t, regexp.MustCompile(`msg="nexus-spawnd is stopping without a state_dir, so no successor could adopt its instances: ending them" leases=2`), time.Second)
}
