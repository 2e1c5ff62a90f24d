package e2e

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// smallTmpfs mounts a tmpfs of size bytes, mode 0700, at dir (created), and
// unmounts it in the test's cleanup, after the processes registered later
// are gone.
func smallTmpfs(t *testing.T, dir string, size string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mount("tmpfs", dir, "tmpfs", syscall.MS_NOSUID|syscall.MS_NODEV, "size="+size+",mode=0700"); err != nil {
		t.Skipf("mounting a tmpfs needs root: %v", err)
	}
	t.Cleanup(func() {
		if err := syscall.Unmount(dir, syscall.MNT_DETACH); err != nil {
			t.Errorf("unmounting %s: %v", dir, err)
		}
	})
}

// fill writes a file at path until its filesystem is full, returning its
// size.
func fill(t *testing.T, path string) int64 {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	chunk := make([]byte, 4096)
	var n int64
	for {
		w, err := f.Write(chunk)
		n += int64(w)
		if errors.Is(err, syscall.ENOSPC) {
			return n
		}
		if err != nil {
			t.Fatal(err)
		}
	}
}

// rawClaim posts a claim and returns its status, Retry-After and body.
func (b *Broker) rawClaim() (int, string, string) {
	b.t.Helper()
	resp, err := http.Post(b.Base+"/claim", "application/json", strings.NewReader(`{"config":"engine:\n  name: example\n"}`))
	if err != nil {
		b.t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header.Get("Retry-After"), string(body)
}

// TestAFullStateDirLosesNoLeaseAndOrphansNoInstance: with the journal's disk
// full, a claim the journal cannot record is refused 503 with Retry-After
// (never answered 200 and lost), /readyz says why, a release still works;
// once space returns the journal is rewritten, and after kill -9 of both
// processes every lease answered is re-adopted and no instance runs that
// no lease holds.
func TestAFullStateDirLosesNoLeaseAndOrphansNoInstance(t *testing.T) {
	dir := t.TempDir()
	state := filepath.Join(dir, "state")
	smallTmpfs(t, state, "2m")
	b := startBroker(t, Options{Dir: dir, StateDir: true, YAML: "release_grace: 1s\nmax_concurrent: 0\n"})

	var live []string
	for range 3 {
		live = append(live, b.claim(brokerclient.ClaimRequest{}).LeaseID)
	}
	filler := filepath.Join(state, "filler")
	fill(t, filler)

	// The journal's last page may still hold a record or a few: claims
	// answered 200 meanwhile are recorded. The first the journal cannot
	// record fails it.
	refused := 0
	for tries := 0; refused == 0; tries++ {
		if tries == 30 {
			t.Fatalf("30 claims answered 200 with the journal's disk full")
		}
		code, retry, body := b.rawClaim()
		switch code {
		case http.StatusOK:
			var c struct {
				LeaseID string `json:"lease_id"`
			}
			if err := json.Unmarshal([]byte(body), &c); err != nil {
				t.Fatal(err)
			}
			live = append(live, c.LeaseID)
		case http.StatusServiceUnavailable:
			if retry == "" || strings.TrimSpace(body) != `{"error":"lease journal unavailable"}` {
				t.Fatalf("refusal: Retry-After %q, body %s", retry, body)
			}
			refused++
		default:
			t.Fatalf("claim with the disk full: %d %s", code, body)
		}
	}
	// Failed, the journal refuses every claim until it is rewritten.
	for range 3 {
		if code, retry, body := b.rawClaim(); code != http.StatusServiceUnavailable || retry == "" {
			t.Fatalf("claim with the journal failed: %d (Retry-After %q) %s", code, retry, body)
		}
		refused++
	}
	if got := b.metrics()[`nexus_broker_claims_total{outcome="journal_unavailable"}`]; got != float64(refused) {
		t.Fatalf(`claims_total{outcome="journal_unavailable"} = %v, want %d`, got, refused)
	}
	eventually(t, 10*time.Second, func() string { return "/readyz 503 naming the journal" }, func() bool {
		code, body := b.get("/readyz")
		return code == http.StatusServiceUnavailable && strings.Contains(body, `"journal: no space left on device"`)
	})
	if !regexp.MustCompile(`spawning instance refused: the lease journal cannot record it.*state_dir=`).MatchString(b.SpawndLog.String()) {
		t.Fatalf("spawnd's log does not name the state_dir of a refused spawn:\n%s", b.SpawndLog)
	}

	// A release proceeds with the journal down.
	gone := live[0]
	live = live[1:]
	if code, body := b.do("POST", "/release/"+gone, ""); code != http.StatusOK {
		t.Fatalf("release with the journal failed: %d %s", code, body)
	}
	eventually(t, 15*time.Second, func() string { return "released instance gone" }, func() bool { return len(b.Instances()) == len(live) })

	// Space returns: the journal is rewritten, /readyz and claims recover.
	if err := os.Remove(filler); err != nil {
		t.Fatal(err)
	}
	b.SpawndLog.wait(t, regexp.MustCompile(`the lease journal was rewritten from memory`), 10*time.Second)
	eventually(t, 10*time.Second, func() string { return "/readyz 200" }, func() bool {
		code, _ := b.get("/readyz")
		return code == http.StatusOK
	})
	live = append(live, b.claim(brokerclient.ClaimRequest{}).LeaseID)

	// kill -9 of both: every lease answered comes back, nothing else runs.
	b.KillGateway(syscall.SIGKILL)
	b.KillSpawnd(syscall.SIGKILL)
	b.StartSpawnd()
	b.StartGateway()
	b.waitStates(live, "active", 30*time.Second)
	var listed []string
	for _, l := range b.leases().Leases {
		listed = append(listed, l.LeaseID)
	}
	slices.Sort(listed)
	slices.Sort(live)
	if !slices.Equal(listed, live) {
		t.Fatalf("after the restart the broker holds %v, want the leases answered %v", listed, live)
	}
	if pids := b.Instances(); len(pids) != len(live) {
		t.Fatalf("%d instances run for %d leases: orphans", len(pids), len(live))
	}
}
