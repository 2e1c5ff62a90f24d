package spawnd

import (
	"os"
	"os/user"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// nobody is the credential the run_as tests drop to.
const nobody = 65534

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("run_as needs a privileged nexus-spawnd; run the tests as root (CI does)")
	}
}

// TestRunAsWithEnvHome: the broker-level run_as applies to an entry that
// declares none; the instance runs as nobody:nobody with no supplementary
// groups, in the HOME its entry sets, and can read its 0600 config.
func TestRunAsWithEnvHome(t *testing.T) {
	requireRoot(t)
	home := filepath.Join(worldDir(t), "home")
	if err := os.Mkdir(home, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(home, nobody, nobody); err != nil {
		t.Fatal(err)
	}
	h := newHarness(t, `
state_dir: STATE
run_as: {uid: 65534, gid: 65534}
binaries:
  nexus:
    path: FAKE
    args: [-report, REPORT]
    env: {HOME: `+home+`}
`)
	h.logs.await(t, "binary registry entry", "name", "nexus", "run_as", "65534:65534", "run_as_home", home)
	_, f := h.spawn("lease-nobody", "nexus")
	r := f.report
	if r.UID != nobody || r.GID != nobody || len(r.Groups) != 0 {
		t.Errorf("instance runs as uid %d gid %d groups %v, want %d:%d and no groups", r.UID, r.GID, r.Groups, nobody, nobody)
	}
	if env := f.env(); env["HOME"] != home || r.Cwd != home {
		t.Errorf("HOME = %q, cwd = %q, want both %q", env["HOME"], r.Cwd, home)
	}
	if r.Config != "core: {}\n" || r.ConfigMode != 0o600 {
		t.Errorf("the instance read config %q mode %v, want its claim's config mode 0600", r.Config, r.ConfigMode)
	}
	h.logs.await(t, "instance spawned", "lease_id", "lease-nobody", "run_as", "65534:65534")
}

// TestRunAsPasswdHome: without env.HOME the instance gets the passwd home
// of its uid. nobody's (/nonexistent) usually does not exist; the instance
// then starts in "/".
func TestRunAsPasswdHome(t *testing.T) {
	requireRoot(t)
	u, err := user.LookupId("65534")
	if err != nil {
		t.Skipf("uid 65534 has no passwd entry here: %v", err)
	}
	h := newHarness(t, `
state_dir: STATE
binaries:
  nexus:
    path: FAKE
    args: [-report, REPORT]
    run_as: {uid: 65534, gid: 65534}
`)
	h.logs.await(t, "binary registry entry", "name", "nexus", "run_as", "65534:65534", "run_as_home", u.HomeDir)
	_, f := h.spawn("lease-passwd", "nexus")
	if got := f.env()["HOME"]; got != u.HomeDir {
		t.Errorf("HOME = %q, want the passwd home %q", got, u.HomeDir)
	}
	if want := workingDir(u.HomeDir); f.report.Cwd != want {
		t.Errorf("cwd = %q, want %q", f.report.Cwd, want)
	}
	if f.report.UID != nobody || f.report.GID != nobody || len(f.report.Groups) != 0 {
		t.Errorf("instance runs as %d:%d groups %v", f.report.UID, f.report.GID, f.report.Groups)
	}
}

// TestRunAsWithoutPrivilege plays a nexus-spawnd without CAP_SETUID and
// CAP_SETGID: one WARN at boot, and a spawn of a run_as entry refused at
// once, naming the credential.
func TestRunAsWithoutPrivilege(t *testing.T) {
	status0 := filepath.Join(t.TempDir(), "status")
	if err := os.WriteFile(status0, []byte("Name:\tnexus-spawnd\nCapEff:\t0000000000000000\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	real := procSelfStatus
	procSelfStatus = status0
	t.Cleanup(func() { procSelfStatus = real })

	h := newHarness(t, `
state_dir: STATE
binaries:
  nexus:
    path: FAKE
    args: [-report, REPORT]
  vision:
    path: FAKE
    run_as: {uid: 65534, gid: 65534}
    env: {HOME: /}
`)
	h.logs.await(t, "run_as is configured but nexus-spawnd lacks CAP_SETUID and CAP_SETGID, so every spawn of these entries will be refused; "+
		"run nexus-spawnd as root (or grant it both capabilities) or remove run_as", "entries", "vision")
	_, err := h.client.Spawn(h.ctx(), &spawnpb.SpawnRequest{LeaseId: "lease-denied", Entry: "vision"})
	if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "65534:65534") {
		t.Errorf("Spawn = %v, want PermissionDenied naming 65534:65534", err)
	}
	h.logs.await(t, "spawning instance refused: run_as needs CAP_SETUID and CAP_SETGID, which nexus-spawnd does not hold; "+
		"run it as root or grant both capabilities, or remove run_as from the entry",
		"lease_id", "lease-denied", "entry", "vision", "run_as", "65534:65534", "level", "ERROR")
	h.spawn("lease-own-uid", "nexus") // entries without run_as still spawn
}
