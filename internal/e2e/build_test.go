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
