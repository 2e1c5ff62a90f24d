package spawnd

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

func stateYAML(stateDir string) string {
	return "state_dir: " + stateDir + "\nbinaries:\n  nexus: {path: " + fakeBin + "}\n"
}

func TestSpawnKeyAndBrokerIDPersist(t *testing.T) {
	stateDir := filepath.Join(t.TempDir(), "state")
	first, _, err := boot(t, stateYAML(stateDir))
	if err != nil {
		t.Fatal(err)
	}
	for path, want := range map[string]os.FileMode{
		stateDir:                             0o700 | os.ModeDir,
		filepath.Join(stateDir, "spawn-key"): 0o600,
		filepath.Join(stateDir, "broker-id"): 0o600,
	} {
		if info, err := os.Stat(path); err != nil || info.Mode() != want {
			t.Errorf("%s: %v (%v), want mode %v", path, info.Mode(), err, want)
		}
	}
	key, err := os.ReadFile(filepath.Join(stateDir, "spawn-key"))
	if err != nil || len(key) != spawnKeySize || !bytes.Equal(key, first.key) {
		t.Fatalf("spawn-key file = %x (%v), want the %d bytes in use", key, err, spawnKeySize)
	}
	firstStatus, err := first.Status(context.Background(), &spawnpb.StatusRequest{})
	if err != nil || firstStatus.BrokerId == "" || firstStatus.Pid != int64(os.Getpid()) {
		t.Fatalf("Status = %v (%v)", firstStatus, err)
	}
	if err := first.Close(); err != nil {
		t.Fatal(err)
	}

	second, _, err := boot(t, stateYAML(stateDir))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(second.key, first.key) || secretFor(second.key, "lease-x") != secretFor(first.key, "lease-x") {
		t.Error("a restart changed the spawn-key, so no surviving instance could reattach")
	}
	if second.brokerID != firstStatus.BrokerId {
		t.Errorf("broker id after restart = %q, want %q", second.brokerID, firstStatus.BrokerId)
	}
}

func TestSpawnKeyRefusals(t *testing.T) {
	for _, tc := range []struct {
		name string
		key  []byte
		mode os.FileMode
		want string
	}{
		{"wrong size", []byte("short"), 0o600, "holds 5 bytes, not 32"},
		{"readable by others", bytes.Repeat([]byte{1}, spawnKeySize), 0o644, "with mode 0644; want owner uid 0 and mode 0600"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			stateDir := t.TempDir()
			path := filepath.Join(stateDir, "spawn-key")
			if err := os.WriteFile(path, tc.key, tc.mode); err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(path, tc.mode); err != nil {
				t.Fatal(err)
			}
			if _, _, err := boot(t, stateYAML(stateDir)); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("New = %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

// TestWithoutStateDir: the key and the broker id live in memory, fresh per
// boot, and a configured broker_id wins.
func TestWithoutStateDir(t *testing.T) {
	yaml := "binaries:\n  nexus: {path: " + fakeBin + "}\n"
	first, logs, err := boot(t, yaml)
	if err != nil {
		t.Fatal(err)
	}
	logs.await(t, "state_dir is not set: leases are kept in memory only, so after a nexus-spawnd restart no running instance "+
		"is re-adopted or can prove its identity again, and resumes are not checked against the binary that created their session; "+
		"set state_dir to keep them")
	second, _, err := boot(t, yaml)
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Equal(first.key, second.key) || len(first.key) != spawnKeySize {
		t.Error("two boots without state_dir share a spawn-key")
	}
	if first.brokerID == second.brokerID {
		t.Error("two boots without state_dir share a broker id")
	}
	named, _, err := boot(t, "broker_id: broker-eu-1\n"+yaml)
	if err != nil || named.brokerID != "broker-eu-1" {
		t.Errorf("configured broker_id: got %q (%v)", named.brokerID, err)
	}
}

// TestStateDirIsPrivate: a state_dir the operator created open to others is
// tightened to 0700 with a WARN; one another uid owns, or a symlink in its
// place, refuses the boot naming it, and nothing is written through it.
func TestStateDirIsPrivate(t *testing.T) {
	loose := filepath.Join(t.TempDir(), "loose")
	if err := os.Mkdir(loose, 0o755); err != nil {
		t.Fatal(err)
	}
	if _, logs, err := boot(t, stateYAML(loose)); err != nil {
		t.Fatal(err)
	} else {
		logs.await(t, "state_dir was open to other users; tightened to 0700 (it holds the spawn-key, the lease journal and instance output)",
			"state_dir", loose, "was", "0755")
	}
	if st, _ := os.Stat(loose); st.Mode().Perm() != 0o700 {
		t.Errorf("state_dir mode after boot = %v, want 0700", st.Mode().Perm())
	}

	if os.Geteuid() != 0 {
		t.Skip("needs root to give a directory to another uid")
	}
	foreign := filepath.Join(t.TempDir(), "foreign")
	if err := os.Mkdir(foreign, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(foreign, 65534, 65534); err != nil {
		t.Fatal(err)
	}
	if _, _, err := boot(t, stateYAML(foreign)); err == nil || !strings.Contains(err.Error(), foreign+" is owned by uid 65534 with mode 0700") {
		t.Errorf("boot on a foreign-owned state_dir = %v, want refused naming it", err)
	}
	link := filepath.Join(t.TempDir(), "link")
	if err := os.Symlink(loose, link); err != nil {
		t.Fatal(err)
	}
	if _, _, err := boot(t, stateYAML(link)); err == nil || !strings.Contains(err.Error(), link+" is not a directory") {
		t.Errorf("boot on a symlinked state_dir = %v, want refused naming it", err)
	}
	if ents, _ := os.ReadDir(foreign); len(ents) != 0 {
		t.Errorf("something was written into the foreign state_dir: %v", ents)
	}
}
