package gateway

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

const mod = "github.com/nexus-broker/nexus-broker/"

// mayNotImport is docs/architecture.md's arrows, checked: each package (or,
// ending in /, each package under it) and the project packages it must not
// import, so that no arrow runs up.
var mayNotImport = map[string][]string{
	// spawnd's generated types stay with spawnd, its RPC and its client.
	"internal/gateway/": {"pkg/spawnrpc/", "internal/spawnclient", "internal/console", "internal/brokerd", "internal/cluster", "internal/cluster/", "internal/httpapi"},
	"internal/gateway":  {"pkg/spawnrpc/", "internal/spawnclient", "internal/console", "internal/brokerd", "internal/cluster", "internal/cluster/", "internal/httpapi"},
	// The cluster router wraps the core's exported face, never its insides.
	"internal/cluster/router": {"internal/gateway/internal/", "internal/gateway/spawner", "internal/console", "internal/spawnclient", "internal/brokerd", "pkg/spawnrpc/", "internal/httpapi"},
	// The console reads the core's exported face (console.Core), never its
	// insides, nor the layers beside it.
	"internal/console": {"internal/gateway/internal/", "internal/gateway/spawner", "pkg/spawnrpc/", "internal/spawnclient", "internal/brokerd", "internal/a2a", "internal/a2a/", "internal/cluster", "internal/cluster/", "internal/httpapi"},
	// The HTTP face reads the core's exported face (httpapi.Core), never
	// its insides, nor the layers beside or above it.
	"internal/httpapi": {"internal/gateway/internal/", "internal/gateway/spawner", "pkg/spawnrpc/", "internal/spawnclient", "internal/brokerd", "internal/console", "internal/a2a/ingress", "internal/cluster", "internal/cluster/"},
	"internal/a2a":     {"internal/gateway", "internal/gateway/", "internal/console", "internal/spawnclient", "internal/brokerd", "pkg/spawnrpc/", "internal/httpapi"},
	// The A2A door reaches the core only through its API: none of its
	// internals, nor the layers beside or above it.
	"internal/a2a/ingress": {"internal/gateway/internal/", "internal/gateway/spawner", "internal/cluster", "internal/cluster/", "internal/console", "internal/spawnclient", "internal/brokerd", "pkg/spawnrpc/", "internal/httpapi"},
	"internal/cluster":     {"internal/gateway", "internal/gateway/", "internal/console", "internal/spawnclient", "internal/brokerd", "pkg/spawnrpc/", "internal/httpapi"},
	"internal/auth":        {"internal/gateway", "internal/gateway/", "internal/console", "internal/a2a", "internal/cluster", "internal/spawnclient", "internal/httpapi"},
	"internal/config":      {"internal/gateway", "internal/gateway/", "internal/console", "internal/a2a", "internal/cluster", "internal/auth", "internal/httpapi"},
	"internal/spawnclient": {"internal/gateway", "internal/console", "internal/a2a", "internal/cluster", "internal/brokerd"},
}

// leaves import nothing of the project.
var leaves = []string{"internal/gateway/spawner", "internal/gateway/reply", "internal/gateway/internal/capacity", "internal/gateway/internal/pool", "internal/envdur"}

func matches(pattern, pkg string) bool {
	if strings.HasSuffix(pattern, "/") {
		return strings.HasPrefix(pkg, pattern)
	}
	return pkg == pattern
}

// TestNoImportArrowRunsUp reads every package's imports (tests aside) and
// holds them to mayNotImport and leaves.
func TestNoImportArrowRunsUp(t *testing.T) {
	out, err := exec.Command("go", "list", "-f", "{{.ImportPath}}{{range .Imports}} {{.}}{{end}}", mod+"...").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if len(lines) < 20 {
		t.Fatalf("go list named only %d packages", len(lines))
	}
	spawnpbUsers := 0
	for _, line := range lines {
		f := strings.Fields(line)
		pkg := strings.TrimPrefix(f[0], mod)
		for _, imp := range f[1:] {
			if !strings.HasPrefix(imp, mod) {
				continue
			}
			imp = strings.TrimPrefix(imp, mod)
			if imp == "pkg/spawnrpc/spawnpb" {
				spawnpbUsers++
				if !strings.HasPrefix(pkg, "pkg/spawnrpc") && !strings.HasPrefix(pkg, "internal/spawnd") && pkg != "internal/spawnclient" {
					t.Errorf("%s imports spawnpb: only pkg/spawnrpc, internal/spawnd and internal/spawnclient may", pkg)
				}
			}
			for pattern, denied := range mayNotImport {
				if !matches(pattern, pkg) {
					continue
				}
				for _, d := range denied {
					if matches(d, imp) {
						t.Errorf("%s imports %s: that arrow runs up (docs/architecture.md, \"The gateway's layers\")", pkg, imp)
					}
				}
			}
			for _, leaf := range leaves {
				if pkg == leaf {
					t.Errorf("%s imports %s: it is a leaf and imports nothing of the project", pkg, imp)
				}
			}
		}
	}
	if spawnpbUsers == 0 {
		t.Fatal("no package imports spawnpb: the check reads nothing")
	}
}

// Size bounds of issue 26: no package above maxPackageLines non-test lines,
// no file above maxFileLines outside the privileged half (spawnd, whose verb
// table stays one file). Generated files count for neither.
const (
	maxPackageLines = 4500
	maxFileLines    = 600
)

// generated is Go's mark of a generated file, before its package clause.
var generated = regexp.MustCompile(`(?m)^// Code generated .* DO NOT EDIT\.$`)

// TestNoPackageOrFileTooLarge counts the lines of every package's non-test
// Go files (go list's GoFiles) and holds them to the bounds.
func TestNoPackageOrFileTooLarge(t *testing.T) {
	out, err := exec.Command("go", "list", "-f", "{{.ImportPath}} {{.Dir}}{{range .GoFiles}} {{.}}{{end}}", mod+"...").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	counted := 0
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		pkg, dir := strings.TrimPrefix(f[0], mod), f[1]
		total := 0
		for _, name := range f[2:] {
			data, err := os.ReadFile(filepath.Join(dir, name))
			if err != nil {
				t.Fatal(err)
			}
			if generated.Match(bytes.SplitN(data, []byte("\npackage "), 2)[0]) {
				continue
			}
			n := bytes.Count(data, []byte("\n"))
			total += n
			counted++
			if n > maxFileLines && !strings.HasPrefix(pkg, "internal/spawnd") {
				t.Errorf("%s/%s has %d lines, more than %d: split it", pkg, name, n, maxFileLines)
			}
		}
		if total > maxPackageLines {
			t.Errorf("%s holds %d non-test lines, more than %d: it is more than one layer", pkg, total, maxPackageLines)
		}
	}
	if counted < 100 {
		t.Fatalf("counted only %d files: the check reads nothing", counted)
	}
}
