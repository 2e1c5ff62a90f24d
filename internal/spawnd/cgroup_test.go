package spawnd

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// Fixtures as a systemd host shows them: a unified (v2-only) host, a hybrid
// one (v1 controllers, v2 at /sys/fs/cgroup/unified), and a container whose
// cgroup namespace root is a subtree.
const (
	unifiedMounts = `24 30 0:22 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
28 24 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
`
	hybridMounts = `31 24 0:27 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
32 31 0:28 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw,nsdelegate
35 31 0:31 / /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:14 - cgroup cgroup rw,memory
`
	nsMounts = `40 30 0:37 /system.slice/box.service /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw
`
)

func TestOwnCgroupDir(t *testing.T) {
	for _, tt := range []struct {
		name, self, mounts, want string
	}{
		{"unified", "0::/system.slice/nexus-spawnd.service\n", unifiedMounts, "/sys/fs/cgroup/system.slice/nexus-spawnd.service"},
		{"hybrid", "12:memory:/system.slice/nexus-spawnd.service\n1:name=systemd:/system.slice/nexus-spawnd.service\n0::/system.slice/nexus-spawnd.service\n",
			hybridMounts, "/sys/fs/cgroup/unified/system.slice/nexus-spawnd.service"},
		{"namespace root", "0::/system.slice/box.service/inner\n", nsMounts, "/sys/fs/cgroup/inner"},
		{"v1 only", "12:memory:/x\n1:name=systemd:/x\n", hybridMounts, ""},
		{"no cgroup2 mount", "0::/x\n", "35 31 0:31 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n", ""},
		{"garbage", "0::relative\n", unifiedMounts, ""},
	} {
		if got := ownCgroupDir([]byte(tt.self), []byte(tt.mounts)); got != tt.want {
			t.Errorf("%s: ownCgroupDir = %q, want %q", tt.name, got, tt.want)
		}
	}
}

// TestCgroupRootAutoDetection: spawnd's own cgroup is used only when systemd
// marked it delegated (Delegate=yes sets the delegate attribute); an
// undelegated one leaves containment to process groups.
func TestCgroupRootAutoDetection(t *testing.T) {
	fixtures := t.TempDir()
	own := filepath.Join(fixtures, "sys", "fs", "cgroup", "system.slice", "nexus-spawnd.service")
	if err := os.MkdirAll(own, 0o755); err != nil {
		t.Fatal(err)
	}
	self, mounts := filepath.Join(fixtures, "cgroup"), filepath.Join(fixtures, "mountinfo")
	if err := os.WriteFile(self, []byte("0::/system.slice/nexus-spawnd.service\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	mountinfo := "28 24 0:26 / " + filepath.Join(fixtures, "sys", "fs", "cgroup") + " rw - cgroup2 cgroup2 rw\n"
	if err := os.WriteFile(mounts, []byte(mountinfo), 0o600); err != nil {
		t.Fatal(err)
	}
	procSelfCgroup, procSelfMountinfo = self, mounts
	t.Cleanup(func() { procSelfCgroup, procSelfMountinfo = "/proc/self/cgroup", "/proc/self/mountinfo" })

	if got, err := findCgroupRoot(""); err != nil || got != "" {
		t.Fatalf("undelegated: findCgroupRoot = %q, %v; want none", got, err)
	}
	if err := unix.Setxattr(own, "user.delegate", []byte("1"), 0); err != nil {
		t.Skipf("the test's filesystem takes no user.* attributes: %v", err)
	}
	if got, err := findCgroupRoot(""); err != nil || got != own {
		t.Fatalf("delegated: findCgroupRoot = %q, %v; want %s", got, err, own)
	}
	// A configured root must be cgroup v2, whatever the detection says.
	if _, err := findCgroupRoot(own); err == nil {
		t.Fatalf("findCgroupRoot(%s) accepted a directory that is not on cgroup v2", own)
	}
}

// TestLimitsWithoutCgroupsAreRefused: a limit is never silently unenforced.
func TestLimitsWithoutCgroupsAreRefused(t *testing.T) {
	s := &settings{entries: map[string]*entry{"vision": {name: "vision", limits: map[string]string{"memory_max": "1048576"}}}}
	err := (*cgroupTree)(nil).admit(s)
	if err == nil || !strings.Contains(err.Error(), "binaries: vision: memory_max needs cgroup v2 containment") {
		t.Fatalf("admit without a tree = %v", err)
	}
	if err := (*cgroupTree)(nil).admit(&settings{entries: map[string]*entry{"plain": {name: "plain"}}}); err != nil {
		t.Fatalf("admit of an entry without limits = %v", err)
	}
}

// TestWithoutCgroupsOneWarnNamesTheSetsidEscape: a spawnd that finds no
// cgroup v2 tree says once, at boot, what process groups cannot contain.
func TestWithoutCgroupsOneWarnNamesTheSetsidEscape(t *testing.T) {
	v1Only := filepath.Join(t.TempDir(), "cgroup")
	if err := os.WriteFile(v1Only, []byte("12:memory:/x\n1:name=systemd:/x\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	procSelfCgroup = v1Only
	t.Cleanup(func() { procSelfCgroup = "/proc/self/cgroup" })
	h := newHarness(t, defaultYAML)
	h.logs.await(t, msgNoCgroups)
	if n := len(h.logs.find(msgNoCgroups)); n != 1 || !strings.Contains(msgNoCgroups, "setsid") {
		t.Fatalf("%d boot WARNs %q, want one naming the setsid escape", n, msgNoCgroups)
	}
	if h.d.cgroups != nil {
		t.Fatal("spawnd contains instances in cgroups without a cgroup v2 tree")
	}
}

// TestABrokerIDThatIsNotATokenHasNoCgroup: broker_id is joined into the
// cgroup path and everything under it is this broker's to kill, so ".."
// would hand the root's siblings to the sweep.
func TestABrokerIDThatIsNotATokenHasNoCgroup(t *testing.T) {
	root := t.TempDir()
	for _, id := range []string{"..", ".", "a/b", "../etc", "x y"} {
		_, err := openCgroupTree(root, id)
		if err == nil || !strings.Contains(err.Error(), "broker_id") {
			t.Fatalf("openCgroupTree(%q) = %v; want a refusal naming broker_id", id, err)
		}
	}
	if entries, _ := os.ReadDir(root); len(entries) != 0 {
		t.Fatalf("a refused broker_id left %d entries under the root", len(entries))
	}
}
