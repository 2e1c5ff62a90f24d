package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/sockdir"
	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// TestConfigKeysRefusedAtBoot: the spec's "Running the broker" keys whose
// bad values refuse the boot, each naming the key, before anything listens.
// The gateway launches its own spawnd, as `nexus-broker -config` does.
func TestConfigKeysRefusedAtBoot(t *testing.T) {
	runDir := filepath.Join(sockdir.New(t, "nxk"), "run")
	dir := t.TempDir()
	base := fmt.Sprintf("listen_addr: \"127.0.0.1:%d\"\nspawnd:\n  run_dir: %q\n", freePort(t), runDir)
	entry := fmt.Sprintf("binaries:\n  nexus:\n    path: %q\n", bin("nexus-echo"))
	for _, c := range []struct {
		name, yaml string
		wants      []string
	}{
		// A zero grace would make a new session's id unreportable.
		{"session_report_grace zero", entry + "session_report_grace: 0\n", []string{"session_report_grace: must be positive"}},
		{"session_report_grace negative", entry + "session_report_grace: -1s\n", []string{"session_report_grace: must be positive"}},
		{"ready_timeout zero", entry + "ready_timeout: 0\n", []string{"ready_timeout: must be positive"}},
		{"ready_timeout unparseable", entry + "ready_timeout: soon\n", []string{"ready_timeout", `"soon"`}},
		{"nexus_binary_path empty", `nexus_binary_path: ""` + "\n", []string{"nexus_binary_path", "remove the key"}},
		{"nexus_binary_path beside binaries.nexus", entry + fmt.Sprintf("nexus_binary_path: %q\n", bin("nexus-echo")), []string{"nexus_binary_path", "binaries.nexus.path"}},
		// The dial-back variables are the broker's own on every spawn.
		{"inherit_env naming a dial-back variable", entry + "inherit_env: [HOME, NEXUS_BROKER_SPAWN_SECRET]\n",
			[]string{"inherit_env[1]: NEXUS_BROKER_SPAWN_SECRET is set by the broker on every spawn"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := writeConfig(t, dir, base+c.yaml)
			code, out := runToExit(t, nil, "nexus-broker", "-config", cfg)
			refused(t, c.name, code, out, c.wants...)
			if strings.Contains(out, "nexus-broker listening") {
				t.Errorf("%s: the gateway listened before refusing:\n%s", c.name, out)
			}
		})
	}
}

// TestNexusBinaryPathIsDeprecatedNotRemoved: the alias still spawns, and
// the boot (and every reload of such a file) says it is deprecated.
func TestNexusBinaryPathIsDeprecatedNotRemoved(t *testing.T) {
	b := startBroker(t, Options{NoNexusEntry: true, YAML: fmt.Sprintf("nexus_binary_path: %q\n", bin("nexus-echo"))})
	deprecated := regexp.MustCompile(`level=WARN msg="nexus_binary_path is deprecated: declare it as binaries.nexus.path instead. Its value was folded into the \\"nexus\\" registry entry for this boot." path=`)
	b.GatewayLog.wait(t, deprecated, time.Second)
	claim := b.claim(brokerclient.ClaimRequest{})
	conn := b.dial(claim, brokerclient.DialOptions{})
	if got := say(t, conn, "hi"); got != "echo #1: hi" {
		t.Fatalf("an instance of the aliased binary answered %q", got)
	}
	_ = b.gateway.cmd.Process.Signal(syscall.SIGHUP)
	b.GatewayLog.wait(t, regexp.MustCompile(`msg="config reload applied; no reloadable key changed"`), 10*time.Second)
	if n := b.GatewayLog.count(deprecated); n != 2 {
		t.Errorf("deprecation WARNs after boot and one reload = %d, want 2:\n%s", n, b.GatewayLog)
	}
}

// TestAdvertiseAddrBootWarnings: a wildcard bind with no advertise_addr,
// and a TLS scheme this broker does not serve, each log the spec's boot
// WARN with upstream's attributes (run the make-run way, the gateway
// launching its spawnd).
func TestAdvertiseAddrBootWarnings(t *testing.T) {
	for _, c := range []struct {
		name, advertise string
		want            string
	}{
		{"wildcard bind", "", `level=WARN msg="advertise_addr is not set and listen_addr names no host: [^"]*" listen_addr=:(\d+)\n`},
		{"TLS scheme", "advertise_addr: \"wss://broker-1.example.com\"\n",
			`level=WARN msg="advertise_addr names a TLS scheme but this broker serves cleartext: [^"]*" advertise_addr=wss://broker-1.example.com listen_addr=:(\d+)\n`},
	} {
		t.Run(c.name, func(t *testing.T) {
			b := newBroker(t, Options{Launch: true})
			text, err := os.ReadFile(b.ConfigPath)
			if err != nil {
				t.Fatal(err)
			}
			wide := strings.Replace(string(text), `listen_addr: "127.0.0.1:`, `listen_addr: ":`, 1) + c.advertise
			if err := os.WriteFile(b.ConfigPath, []byte(wide), 0o600); err != nil {
				t.Fatal(err)
			}
			b.StartGateway()
			b.GatewayLog.wait(t, regexp.MustCompile(c.want), time.Second)
		})
	}
}

// TestUnusableControlSocketRefusesTheBoot: a control_socket the gateway
// cannot create refuses its boot, naming the key and the path, before it
// announces itself (unset, the same failure in the run directory is a WARN).
func TestUnusableControlSocketRefusesTheBoot(t *testing.T) {
	b := startBroker(t, Options{})
	b.KillGateway(syscall.SIGTERM)
	gone := filepath.Join(sockdir.New(t, "nxg"), "gone")
	out := refusedBoot(t, b, "a control_socket in a missing directory", func(text string) string {
		return fmt.Sprintf("control_socket: %q\n", filepath.Join(gone, "control.sock")) + text
	}, "control_socket", gone, "no such file or directory")
	if strings.Contains(out, "nexus-broker listening") {
		t.Errorf("the gateway announced itself before refusing:\n%s", out)
	}
}
