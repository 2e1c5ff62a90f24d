package e2e

import (
	"fmt"
	"regexp"
	"sync"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

func TestConcurrentReleasesCollapseIntoOneTeardown(t *testing.T) {
	b := startBroker(t, Options{YAML: "release_grace: 1s\n"})
	claim := b.claim(brokerclient.ClaimRequest{})
	var wg sync.WaitGroup
	statuses := make(chan int, 8)
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			status, _ := b.do("POST", "/release/"+claim.LeaseID, "")
			statuses <- status
		}()
	}
	wg.Wait()
	close(statuses)
	ok := 0
	for s := range statuses {
		switch s {
		case 200:
			ok++
		case 404: // arrived after the lease was gone: idempotent
		default:
			t.Fatalf("a concurrent release answered %d", s)
		}
	}
	if ok == 0 {
		t.Fatal("no release answered 200")
	}
	b.waitNoInstances(10 * time.Second)
	re := regexp.MustCompile(`msg="terminating instance" lease_id=` + claim.LeaseID)
	b.SpawndLog.wait(t, re, 5*time.Second) // spawnd's stderr reaches us asynchronously
	b.SpawndLog.wait(t, regexp.MustCompile(`msg="instance exited" lease_id=`+claim.LeaseID), 5*time.Second)
	if n := b.SpawndLog.count(re); n != 1 {
		t.Fatalf("spawnd terminated the lease %d times, want once", n)
	}
}

func TestAnInstanceIgnoringShutdownIsEscalated(t *testing.T) {
	b := startBroker(t, Options{NoNexusEntry: true, YAML: fmt.Sprintf(`release_grace: 500ms
binaries:
  nexus:
    path: %q
    env: {NEXUS_ECHO_IGNORE_SHUTDOWN: "1"}
`, bin("nexus-echo"))})
	claim := b.claim(brokerclient.ClaimRequest{})
	start := time.Now()
	if status, _ := b.do("POST", "/release/"+claim.LeaseID, ""); status != 200 {
		t.Fatalf("release = %d", status)
	}
	if d := time.Since(start); d < 500*time.Millisecond {
		t.Fatalf("release returned after %s, before release_grace", d)
	}
	b.SpawndLog.wait(t, regexp.MustCompile(`instance did not exit within release_grace; sending SIGTERM to its process group"? lease_id=`+claim.LeaseID), time.Second)
	b.SpawndLog.wait(t, regexp.MustCompile(`instance did not exit after SIGTERM; sending SIGKILL to its process group"? lease_id=`+claim.LeaseID), time.Second)
	b.waitNoInstances(5 * time.Second)
	// SIGKILL follows SIGTERM a fixed 2s later, whatever release_grace is.
	log := b.SpawndLog.String()
	term := logTime(t, log, `sending SIGTERM to its process group" lease_id=`+claim.LeaseID)
	kill := logTime(t, log, `sending SIGKILL to its process group" lease_id=`+claim.LeaseID)
	if d := kill.Sub(term); d < 1900*time.Millisecond || d > 3*time.Second {
		t.Errorf("SIGKILL came %s after SIGTERM, want the fixed 2s", d)
	}
}
