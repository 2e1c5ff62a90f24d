package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"testing"

	"github.com/nexus-broker/nexus-broker/internal/sockdir"
)

// TestRunAsTheGatewayUIDRefusesTheBoot: with the gateway apart from spawnd
// (spawnd.gateway_uid), an entry whose run_as is the gateway's uid could
// call spawnd as the gateway, so nexus-spawnd refuses to boot, naming the
// entry and the key, and creates nothing.
func TestRunAsTheGatewayUIDRefusesTheBoot(t *testing.T) {
	if os.Getuid() == 65534 {
		t.Skip("the test puts the gateway at uid 65534, apart from spawnd's")
	}
	dir := t.TempDir()
	runDir := filepath.Join(sockdir.New(t, "nxr"), "run")
	cfg := filepath.Join(dir, "broker.yaml")
	yaml := fmt.Sprintf(`listen_addr: "127.0.0.1:%d"
spawnd:
  run_dir: %q
  gateway_uid: 65534
binaries:
  nexus:
    path: %q
    run_as: {uid: 65534, gid: 65534}
    env: {HOME: /}
`, freePort(t), runDir, bin("nexus-echo"))
	if err := os.WriteFile(cfg, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(bin("nexus-spawnd"), "-config", cfg).CombinedOutput()
	if err == nil {
		t.Fatalf("nexus-spawnd booted with run_as equal to spawnd.gateway_uid; output:\n%s", out)
	}
	// Upstream's record of a config that does not load.
	want := regexp.MustCompile(`level=ERROR msg="failed to load config" path=` + regexp.QuoteMeta(cfg) +
		` error="broker config: binaries: nexus: run_as uid 65534 is spawnd.gateway_uid, the only uid nexus-spawnd takes requests from`)
	if !want.Match(out) {
		t.Fatalf("nexus-spawnd output:\n%s\nwant it to match %s", out, want)
	}
	if _, err := os.Stat(filepath.Join(runDir, "spawnd.json")); err == nil {
		t.Fatal("a refused boot published spawnd.json")
	}
}
