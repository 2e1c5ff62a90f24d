package spawnd

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/nexus-broker/nexus-broker/internal/config/core"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// Ranges of these tests: one each, and one block per test process, so
// neither the tests nor two runs on one host (the lock on a range is
// host-wide) share one.
var (
	tenancyLo      = 300000 + os.Getpid()%5000*100
	tenancyRange   = uidRange(0, 9)
	tenancyOneUID  = uidRange(10, 10)
	tenancyLockLo  = uidRange(20, 29)
	tenancyOverlap = uidRange(25, 35)
)

func uidRange(from, to int) string { return fmt.Sprintf("%d-%d", tenancyLo+from, tenancyLo+to) }

// homesParent is a directory every uid may traverse (t.TempDir's parent
// is 0700), for homes_dir.
func homesParent(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "spawnd-homes-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

func tenancyYAML(uidRange, homes string) string {
	return fmt.Sprintf("tenancy: {uid_range: %q, homes_dir: %q, sandbox: none}\n", uidRange, homes)
}

func (h *harness) spawnAs(id, principal string) *fakeConn {
	h.t.Helper()
	if _, err := h.client.Spawn(h.ctx(), &spawnpb.SpawnRequest{LeaseId: id, Entry: "nexus", Config: []byte("core: {}\n"), Principal: principal}); err != nil {
		h.t.Fatalf("Spawn(%s as %q): %v", id, principal, err)
	}
	return h.accept()
}

// Every principal's instances run under a uid of its own, with the gid of
// that number, no supplementary group and its own 0700 home; the uid is
// kept across restarts and never given to another.
func TestTenancyGivesEachPrincipalItsOwnUID(t *testing.T) {
	requireRoot(t)
	homes := filepath.Join(homesParent(t), "homes")
	h := newHarness(t, defaultYAML+tenancyYAML(tenancyRange, homes))
	alice := h.spawnAs("lease-a1", "alice")
	bob := h.spawnAs("lease-b1", "bob")
	for name, f := range map[string]*fakeConn{"alice": alice, "bob": bob} {
		r := f.report
		home := filepath.Join(homes, fmt.Sprint(r.UID))
		if r.UID < tenancyLo || r.UID > tenancyLo+9 || r.GID != r.UID || len(r.Groups) != 0 {
			t.Errorf("%s runs as uid %d gid %d groups %v; want a uid of %s, its own gid, no groups", name, r.UID, r.GID, r.Groups, tenancyRange)
		}
		if got := f.env()["HOME"]; got != home || r.Cwd != home {
			t.Errorf("%s: HOME %q, cwd %q; want %s", name, got, r.Cwd, home)
		}
		var st syscall.Stat_t
		if err := syscall.Lstat(home, &st); err != nil || int(st.Uid) != r.UID || st.Mode&0o7777 != 0o700 {
			t.Errorf("%s's home: %v, uid %d mode %04o; want uid %d, 0700", name, err, st.Uid, st.Mode&0o7777, r.UID)
		}
	}
	if alice.report.UID == bob.report.UID {
		t.Fatalf("alice and bob share uid %d", alice.report.UID)
	}
	if strings.Contains(h.logs.text(), "so their instances run as root") {
		t.Error("with tenancy: the boot warns that instances without run_as run as root")
	}
	var st syscall.Stat_t
	if err := syscall.Lstat(homes, &st); err != nil || st.Uid != 0 || st.Mode&0o7777 != 0o711 {
		t.Errorf("homes_dir: %v, uid %d mode %04o; want root, 0711", err, st.Uid, st.Mode&0o7777)
	}
	if again := h.spawnAs("lease-a2", "alice"); again.report.UID != alice.report.UID {
		t.Errorf("alice's second instance runs as uid %d, her first as %d", again.report.UID, alice.report.UID)
	}

	h.stop()
	h.start()
	if after := h.spawnAs("lease-a3", "alice"); after.report.UID != alice.report.UID {
		t.Errorf("after a restart alice runs as uid %d, before as %d", after.report.UID, alice.report.UID)
	}
	carol := h.spawnAs("lease-c1", "carol")
	if u := carol.report.UID; u == alice.report.UID || u == bob.report.UID {
		t.Errorf("carol was given uid %d, already alice's or bob's", u)
	}
}

// A spent range refuses a new principal as RESOURCE_EXHAUSTED naming it,
// and still serves those it has.
func TestTenancyRangeExhausted(t *testing.T) {
	requireRoot(t)
	h := newHarness(t, defaultYAML+tenancyYAML(tenancyOneUID, filepath.Join(homesParent(t), "homes")))
	h.spawnAs("lease-a1", "alice")
	_, err := h.client.Spawn(h.ctx(), &spawnpb.SpawnRequest{LeaseId: "lease-b1", Entry: "nexus", Config: []byte("x"), Principal: "bob"})
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "no uid left in tenancy.uid_range") {
		t.Fatalf("Spawn for a new principal past the range = %v, want ResourceExhausted: no uid left", err)
	}
	h.spawnAs("lease-a2", "alice")
}

// The principal is the gateway's hostile word: bounded, NUL-free, and never
// a path.
func TestTenancyPrincipalIsNeverAPath(t *testing.T) {
	requireRoot(t)
	parent := homesParent(t)
	homes := filepath.Join(parent, "homes")
	h := newHarness(t, defaultYAML+tenancyYAML(tenancyRange, homes))
	for _, p := range []string{"a\x00b", strings.Repeat("p", maxPrincipalLen+1)} {
		_, err := h.client.Spawn(h.ctx(), &spawnpb.SpawnRequest{LeaseId: "lease-x", Entry: "nexus", Principal: p})
		if status.Code(err) != codes.InvalidArgument {
			t.Errorf("Spawn as principal %.20q… = %v, want InvalidArgument", p, err)
		}
	}
	f := h.spawnAs("lease-dots", "../../etc")
	if want := filepath.Join(homes, fmt.Sprint(f.report.UID)); f.env()["HOME"] != want {
		t.Errorf("principal ../../etc has HOME %q, want %s", f.env()["HOME"], want)
	}
	if entries, _ := os.ReadDir(parent); len(entries) != 1 {
		t.Errorf("homes_dir's parent holds %v, want homes alone", entries)
	}
}

// A home planted for a uid before its principal claims (a symlink, or a
// directory of another owner) is refused, and nothing is followed or
// chowned.
func TestTenancyPlantedHomeIsRefused(t *testing.T) {
	requireRoot(t)
	parent := homesParent(t)
	homes := filepath.Join(parent, "homes")
	if err := os.Mkdir(homes, 0o711); err != nil {
		t.Fatal(err)
	}
	target := filepath.Join(parent, "target")
	if err := os.Mkdir(target, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, filepath.Join(homes, fmt.Sprint(tenancyLo))); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(homes, fmt.Sprint(tenancyLo+1)), 0o700); err != nil {
		t.Fatal(err)
	}
	h := newHarness(t, defaultYAML+tenancyYAML(tenancyRange, homes))
	for _, who := range []string{"alice", "bob"} {
		_, err := h.client.Spawn(h.ctx(), &spawnpb.SpawnRequest{LeaseId: "lease-" + who, Entry: "nexus", Config: []byte("x"), Principal: who})
		if status.Code(err) != codes.Internal || !strings.Contains(err.Error(), "home") {
			t.Errorf("Spawn for %s into a planted home = %v, want a home failure", who, err)
		}
	}
	var st syscall.Stat_t
	if err := syscall.Lstat(target, &st); err != nil || st.Uid != 0 {
		t.Errorf("the symlink's target was touched: uid %d (%v)", st.Uid, err)
	}
}

// Each machine check of tenancy: fails the boot naming its key.
func TestTenancyBootErrors(t *testing.T) {
	requireRoot(t)
	parent := homesParent(t)
	loose := filepath.Join(parent, "loose")
	if err := os.Mkdir(loose, 0o755); err != nil {
		t.Fatal(err)
	}
	theirs := filepath.Join(parent, "theirs")
	if err := os.Mkdir(theirs, 0o711); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(theirs, 65534, 65534); err != nil {
		t.Fatal(err)
	}
	ok := filepath.Join(parent, "homes")
	newHarness(t, defaultYAML+tenancyYAML(tenancyLockLo, filepath.Join(parent, "held"))) // holds tenancyLockLo
	for _, tc := range []struct{ name, yaml, want string }{
		{"a passwd account", tenancyYAML("65530-65540", ok), "tenancy.uid_range: 65530-65540 holds id 65534 of "},
		{"systemd's dynamic users", tenancyYAML("61000-61200", ok), "tenancy.uid_range: 61000-61200 overlaps systemd's dynamic users"},
		{"the gateway's uid", tenancyYAML(tenancyRange, ok) + fmt.Sprintf("spawnd: {gateway_uid: %d}\n", tenancyLo+3), fmt.Sprintf("holds uid %d, the gateway's", tenancyLo+3)},
		{"the socket group", tenancyYAML(tenancyRange, ok) + fmt.Sprintf("spawnd: {socket_gid: %d}\n", tenancyLo+4), fmt.Sprintf("holds gid %d, spawnd.socket_gid", tenancyLo+4)},
		{"another spawnd's range", tenancyYAML(tenancyOverlap, ok), "overlaps the range another nexus-spawnd of this host holds"},
		{"a loose homes_dir", tenancyYAML(tenancyRange, loose), "tenancy.homes_dir: " + loose + " is owned by uid 0 with mode 0755"},
		{"another's homes_dir", tenancyYAML(tenancyRange, theirs), "tenancy.homes_dir: " + theirs + " is owned by uid 65534"},
		{"homes_dir without a parent", tenancyYAML(tenancyRange, filepath.Join(parent, "no", "homes")), "tenancy.homes_dir: creating"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "broker.yaml")
			yaml := fmt.Sprintf("state_dir: %q\nbinaries: {nexus: {path: %q}}\n", filepath.Join(t.TempDir(), "state"), fakeBin) + tc.yaml
			if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
				t.Fatal(err)
			}
			cfg, err := core.Load(path)
			if err != nil {
				t.Fatal(err)
			}
			d, err := New(path, cfg, slog.New(slog.DiscardHandler))
			if err == nil {
				d.Close()
				t.Fatalf("booted; want %q", tc.want)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("boot error %q, want %q", err, tc.want)
			}
		})
	}
}

// A uid whose record cannot be made durable is not given: the claim is
// refused naming the file, nothing is allocated (the principal has no uid,
// the next principal gets that uid), and the file once it works again holds
// what memory holds. The write fails for real: state_dir is a full tmpfs.
func TestTenancyUIDIsGivenOnlyOnceDurable(t *testing.T) {
	requireRoot(t)
	state := filepath.Join(t.TempDir(), "state")
	if err := os.Mkdir(state, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", state, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "size=64k,mode=0700"); err != nil {
		t.Fatalf("mounting a tmpfs: %v", err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(state, unix.MNT_DETACH); err != nil {
			t.Error(err)
		}
	})
	path := filepath.Join(state, uidsFile)
	quiet := slog.New(slog.DiscardHandler)
	uids, err := openUIDs(path, quiet)
	if err != nil {
		t.Fatal(err)
	}
	lo := uint32(tenancyLo)
	tn := &tenancy{lo: lo, hi: lo + 9, next: uint64(lo), uids: uids}
	filler, err := os.Create(filepath.Join(state, "filler"))
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := filler.Write(make([]byte, pageSize)); err != nil {
			break
		}
	}
	filler.Close()

	for try := 1; try <= 2; try++ {
		uid, err := tn.uidFor("alice")
		if err == nil || !strings.Contains(err.Error(), "recording uid "+fmt.Sprint(lo)+" for a new principal in "+uidsFile+" failed, so the claim is refused") {
			t.Fatalf("try %d: alice's first claim on a full state_dir = uid %d, %v; want it refused", try, uid, err)
		}
	}
	if r, ok := uids.Get("alice"); ok {
		t.Fatalf("alice holds uid %d in memory although its record is not durable", r.UID)
	}
	if err := os.Remove(filler.Name()); err != nil {
		t.Fatal(err)
	}
	want := map[string]uint32{"bob": lo, "alice": lo + 1}
	for _, p := range []string{"bob", "alice"} {
		if uid, err := tn.uidFor(p); err != nil || uid != want[p] {
			t.Errorf("%s's claim once writes work = uid %d, %v; want %d", p, uid, err, want[p])
		}
	}
	uids.Close()
	again, err := openUIDs(path, quiet)
	if err != nil {
		t.Fatal(err)
	}
	defer again.Close()
	got := map[string]uint32{}
	for _, r := range again.All() {
		got[r.Principal] = r.UID
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("after a restart the file gives %v, want %v", got, want)
	}
}
