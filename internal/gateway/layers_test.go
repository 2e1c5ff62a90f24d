package gateway

import (
	"bytes"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

const mod = "github.com/nexus-broker/nexus-broker/"

// mayNotImport is docs/architecture.md's arrows, checked: each package (or,
// ending in /, each package under it) and the project packages it must not
// import, so that no arrow runs up.
var mayNotImport = map[string][]string{
	// spawnd's generated types stay with spawnd, its RPC and its client.
	"internal/gateway/": {"pkg/spawnrpc/", "internal/spawnclient", "internal/console", "internal/brokerd", "internal/cluster", "internal/cluster/", "internal/httpapi", "internal/a2a/ingress"},
	"internal/gateway":  {"pkg/spawnrpc/", "internal/spawnclient", "internal/console", "internal/brokerd", "internal/cluster", "internal/cluster/", "internal/httpapi", "internal/a2a/ingress"},
	// The cluster router wraps the core's exported face, never its insides.
	"internal/cluster/router": {"internal/gateway/internal/", "internal/gateway/spawner", "internal/console", "internal/spawnclient", "internal/brokerd", "pkg/spawnrpc/", "internal/httpapi", "internal/a2a/ingress"},
	// The console reads the core's exported face (console.Core), never its
	// insides, nor the layers beside it.
	"internal/console": {"internal/gateway/internal/", "internal/gateway/spawner", "pkg/spawnrpc/", "internal/spawnclient", "internal/brokerd", "internal/a2a", "internal/a2a/", "internal/cluster", "internal/cluster/", "internal/httpapi"},
	// The HTTP face reads the core's exported face (httpapi.Core), never
	// its insides, nor the layers beside or above it.
	"internal/httpapi": {"internal/gateway/internal/", "internal/gateway/spawner", "pkg/spawnrpc/", "internal/spawnclient", "internal/brokerd", "internal/console", "internal/a2a/ingress", "internal/cluster", "internal/cluster/"},
	"internal/a2a":     {"internal/gateway", "internal/gateway/", "internal/console", "internal/spawnclient", "internal/brokerd", "pkg/spawnrpc/", "internal/httpapi", "internal/a2a/ingress"},
	// The A2A door reaches the core only through its API: none of its
	// internals, nor the layers beside or above it.
	"internal/a2a/ingress": {"internal/gateway/internal/", "internal/gateway/spawner", "internal/cluster", "internal/cluster/", "internal/console", "internal/spawnclient", "internal/brokerd", "pkg/spawnrpc/", "internal/httpapi"},
	"internal/cluster":     {"internal/gateway", "internal/gateway/", "internal/console", "internal/spawnclient", "internal/brokerd", "pkg/spawnrpc/", "internal/httpapi", "internal/a2a/ingress", "internal/cluster/router"},
	"internal/auth":        {"internal/gateway", "internal/gateway/", "internal/console", "internal/a2a", "internal/a2a/", "internal/cluster", "internal/cluster/", "internal/spawnclient", "internal/httpapi", "internal/brokerd"},
	"internal/config":      {"internal/gateway", "internal/gateway/", "internal/console", "internal/a2a", "internal/a2a/", "internal/cluster", "internal/cluster/", "internal/auth", "internal/httpapi", "internal/spawnclient", "internal/brokerd"},
	// spawnd's client implements spawner, in the gateway's types, and
	// knows no layer.
	"internal/spawnclient": {"internal/gateway", "internal/gateway/internal/", "internal/console", "internal/a2a", "internal/a2a/", "internal/cluster", "internal/cluster/", "internal/httpapi", "internal/brokerd"},
}

// floor is the rest of what the gateway links below its layers: helpers
// (some of which spawnd links too) that import none of the layers
// (aboveTheFloor).
var floor = []string{"internal/atomicfile", "internal/bindindex", "internal/bootlog", "internal/config/core", "internal/footprint", "internal/hostguard", "internal/inotify", "internal/logbound", "internal/rawsock", "internal/safedir", "pkg/brokerclient", "pkg/brokerframe", "pkg/sessionid", "pkg/spawnrpc", "pkg/spawnrpc/spawnpb"}

// aboveTheFloor is the gateway's layers, which no floor package imports.
var aboveTheFloor = []string{"internal/gateway", "internal/gateway/internal/", "internal/gateway/spawner", "internal/httpapi", "internal/console", "internal/a2a", "internal/a2a/", "internal/cluster", "internal/cluster/", "internal/auth", "internal/config", "internal/spawnclient", "internal/brokerd"}

// leaves import nothing of the project.
var leaves = []string{"internal/gateway/spawner", "internal/gateway/reply", "internal/gateway/internal/capacity", "internal/gateway/internal/pool", "internal/envdur", "internal/spawnproof"}

// top is the composition, which may import every layer and which none
// imports.
var top = []string{"cmd/nexus-broker", "internal/brokerd"}

// rules is mayNotImport with the floor's rule added.
func rules() map[string][]string {
	r := make(map[string][]string, len(mayNotImport)+len(floor))
	for p, denied := range mayNotImport {
		r[p] = denied
	}
	for _, p := range floor {
		r[p] = append(r[p], aboveTheFloor...)
	}
	return r
}

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
	rules := rules()
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
			for pattern, denied := range rules {
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

	// Every package the gateway links has its place in the drawing.
	linked := gatewayPackages(t)
	for _, pkg := range linked {
		placed := slices.Contains(leaves, pkg) || slices.Contains(top, pkg)
		for pattern := range rules {
			placed = placed || matches(pattern, pkg)
		}
		if !placed {
			t.Errorf("nexus-broker links %s, which layers_test.go places nowhere: add it to mayNotImport, floor or leaves, and to docs/architecture.md's drawing", pkg)
		}
	}
}

// gatewayPackages is every package of the project nexus-broker links:
// the gateway side.
func gatewayPackages(t *testing.T) []string {
	t.Helper()
	out, err := exec.Command("go", "list", "-deps", "-f", "{{.ImportPath}}", mod+"cmd/nexus-broker").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	var pkgs []string
	for _, p := range strings.Fields(string(out)) {
		if strings.HasPrefix(p, mod) {
			pkgs = append(pkgs, strings.TrimPrefix(p, mod))
		}
	}
	if len(pkgs) < 20 {
		t.Fatalf("nexus-broker links only %d packages of the project", len(pkgs))
	}
	return pkgs
}

// Size bounds of issue 26: no package above maxPackageLines non-test lines,
// no file above maxFileLines outside the privileged half (spawnd, whose verb
// table stays one file), no struct the gateway links above maxStructFields
// fields but wideStructs. Generated files count for none.
const (
	maxPackageLines = 4500
	maxFileLines    = 600
	maxStructFields = 15
)

// wideStructs are the gateway's structs allowed more than maxStructFields
// fields, and why: wire and schema types, whose shape is not ours to
// choose. (spawnd.Daemon, exempt with the privileged half, is not linked by
// the gateway.)
var wideStructs = map[string]string{
	"pkg/brokerframe.IO":        "the wire envelope's payload, upstream's flat union field for field",
	"internal/config.Config":    "broker.yaml's top level, one field a key",
	"internal/config.Validator": "an auth.validators entry, one struct for every type so the list decodes in order",
}

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
	t.Run("structs", testNoStructTooWide)
}

// testNoStructTooWide parses the non-test, non-generated files of every
// package nexus-broker links and holds each struct type, named or not, to
// maxStructFields fields (an embedded field is one), wideStructs aside.
func testNoStructTooWide(t *testing.T) {
	linked := gatewayPackages(t)
	args := append([]string{"list", "-f", "{{.ImportPath}} {{.Dir}}{{range .GoFiles}} {{.}}{{end}}"}, prefixed(linked)...)
	out, err := exec.Command("go", args...).Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	structs, wide := 0, map[string]bool{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		pkg, dir := strings.TrimPrefix(f[0], mod), f[1]
		for _, name := range f[2:] {
			fset := token.NewFileSet()
			file, err := parser.ParseFile(fset, filepath.Join(dir, name), nil, parser.ParseComments)
			if err != nil {
				t.Fatal(err)
			}
			if ast.IsGenerated(file) {
				continue
			}
			named := map[*ast.StructType]string{}
			ast.Inspect(file, func(n ast.Node) bool {
				if ts, ok := n.(*ast.TypeSpec); ok {
					if st, ok := ts.Type.(*ast.StructType); ok {
						named[st] = pkg + "." + ts.Name.Name
					}
				}
				st, ok := n.(*ast.StructType)
				if !ok {
					return true
				}
				structs++
				fields := 0
				for _, field := range st.Fields.List {
					fields += max(len(field.Names), 1)
				}
				if fields <= maxStructFields {
					return true
				}
				what, ok := named[st]
				if !ok {
					what = fmt.Sprintf("the struct at %s/%s:%d", pkg, name, fset.Position(st.Pos()).Line)
				}
				if _, ok := wideStructs[what]; ok {
					wide[what] = true
					return true
				}
				t.Errorf("%s has %d fields, more than %d: split it (only wire and schema types are exempt, wideStructs)", what, fields, maxStructFields)
				return true
			})
		}
	}
	if structs < 200 {
		t.Fatalf("read only %d structs: the check reads nothing", structs)
	}
	for what := range wideStructs {
		if !wide[what] {
			t.Errorf("%s is exempt in wideStructs but has no more than %d fields, or is gone: drop the exemption", what, maxStructFields)
		}
	}
}

// prefixed is pkgs with the module's path before each.
func prefixed(pkgs []string) []string {
	out := make([]string, len(pkgs))
	for i, p := range pkgs {
		out[i] = mod + p
	}
	return out
}
