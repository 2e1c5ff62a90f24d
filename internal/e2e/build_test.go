package e2e

import (
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
)

// The binaries are built with the Makefile's TAGS, and with them no package
// they link compiles C: no process of the broker maps libc and the dynamic
// loader (docs/performance.md, "Memory").
func TestBuildTagsAreTheMakefiles(t *testing.T) {
	mk, err := os.ReadFile("../../Makefile")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^TAGS\s*:=\s*(\S+)\s*$`).FindSubmatch(mk)
	if m == nil {
		t.Fatal("the Makefile defines no TAGS")
	}
	if string(m[1]) != buildTags {
		t.Fatalf("the Makefile builds with tags %q, the e2e tests with %q", m[1], buildTags)
	}
	out, err := exec.Command("go", "list", "-tags", buildTags, "-deps", "-f", "{{if .CgoFiles}}{{.ImportPath}}{{end}}",
		"../../cmd/nexus-broker", "../../cmd/nexus-spawnd", "../../cmd/nexus-echo").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	// runtime/cgo has C files whenever cgo is enabled, and is linked only
	// when another package needs it.
	var withC []string
	for _, p := range strings.Fields(string(out)) {
		if p != "runtime/cgo" {
			withC = append(withC, p)
		}
	}
	if len(withC) > 0 {
		t.Fatalf("with tags %s these packages still compile C, so the binaries link libc: %v", buildTags, withC)
	}
}

// TestMakeRunSaysItIsBuilding: make run says, before it builds, that it is
// building and that the first build takes about two minutes when Go's build
// cache is cold (an empty GOCACHE here), and nothing when the cache holds
// every package (the one this suite's binaries were just built into, with
// their flags); make run asks for that note before the build.
func TestMakeRunSaysItIsBuilding(t *testing.T) {
	note := func(env ...string) string {
		t.Helper()
		cmd := exec.Command("sh", "tools/buildnote.sh", "go", buildTags, "./cmd/nexus-broker", "./cmd/nexus-spawnd", "./cmd/nexus-echo")
		cmd.Dir = "../.."
		cmd.Env = append(os.Environ(), env...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("tools/buildnote.sh: %v\n%s", err, out)
		}
		return string(out)
	}
	if got := note("GOCACHE="+t.TempDir(), "GOFLAGS="); !strings.Contains(got, "make run: building nexus-broker, nexus-spawnd and nexus-echo") || !strings.Contains(got, "about two minutes") {
		t.Errorf("on a cold build cache make run says %q, want that it is building and that it takes about two minutes", got)
	}
	flags := "-race"
	if os.Getenv("E2E_NORACE") != "" {
		flags = ""
	}
	if got := note("GOFLAGS=" + flags); got != "" {
		t.Errorf("on the build cache that holds these binaries make run says %q, want nothing", got)
	}
	out, err := exec.Command("make", "-C", "../..", "-n", "--no-print-directory", "run").CombinedOutput()
	if err != nil {
		t.Fatalf("make -n run: %v\n%s", err, out)
	}
	dry := string(out)
	if n, b := strings.Index(dry, "tools/buildnote.sh"), strings.Index(dry, "go build"); n < 0 || b < 0 || n > b {
		t.Errorf("make run does not ask for the note before it builds:\n%s", dry)
	}
}
