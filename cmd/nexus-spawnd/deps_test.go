package main

import (
	"bytes"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// gatewaySide are packages that belong to the gateway, its clients or its
// tests, and must never be linked into the privileged binary: what a
// reviewer reads to trust spawnd is what `go list -deps ./cmd/nexus-spawnd`
// names. An entry ending in / stands for every package under it.
var gatewaySide = []string{
	"github.com/nexus-broker/nexus-broker/internal/a2a",
	"github.com/nexus-broker/nexus-broker/internal/a2a/",
	"github.com/nexus-broker/nexus-broker/internal/auth",
	"github.com/nexus-broker/nexus-broker/internal/brokerd",
	"github.com/nexus-broker/nexus-broker/internal/cluster",
	"github.com/nexus-broker/nexus-broker/internal/cluster/",
	"github.com/nexus-broker/nexus-broker/internal/config",
	"github.com/nexus-broker/nexus-broker/internal/console",
	"github.com/nexus-broker/nexus-broker/internal/echo",
	"github.com/nexus-broker/nexus-broker/internal/envdur",
	"github.com/nexus-broker/nexus-broker/internal/gateway",
	"github.com/nexus-broker/nexus-broker/internal/gateway/",
	"github.com/nexus-broker/nexus-broker/internal/hostguard",
	"github.com/nexus-broker/nexus-broker/internal/httpapi",
	"github.com/nexus-broker/nexus-broker/internal/nexusclient",
	"github.com/nexus-broker/nexus-broker/internal/rawsock",
	"github.com/nexus-broker/nexus-broker/internal/spawnclient",
	"github.com/nexus-broker/nexus-broker/pkg/brokerclient",
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe",
	"github.com/a2aproject/",
	"github.com/chromedp/",
	"github.com/coreos/go-oidc/",
	"github.com/getkin/kin-openapi/",
	"github.com/go-jose/",
	"github.com/gorilla/websocket",
	"github.com/nats-io/",
}

func goList(t *testing.T, format string) []string {
	t.Helper()
	out, err := exec.Command("go", "list", "-deps", "-f", format, ".").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	return strings.Fields(string(out))
}

func TestLinksNoGatewayCode(t *testing.T) {
	deps := goList(t, "{{.ImportPath}}")
	if len(deps) < 10 {
		t.Fatalf("go list -deps named only %q", deps)
	}
	for _, dep := range deps {
		for _, denied := range gatewaySide {
			if dep == denied || strings.HasSuffix(denied, "/") && strings.HasPrefix(dep, denied) {
				t.Errorf("nexus-spawnd links %s, which is gateway-side (%s); move what spawnd needs of it into a package both sides share", dep, denied)
			}
		}
	}
}

// statedLines is how README's security section states the count.
var statedLines = regexp.MustCompile(`about\s+(\d[\d ]*\d)\s+lines of this module`)

// TestREADMEStatesTheLinkedLines keeps README's count of the lines spawnd
// links within a tenth of the truth: what a reviewer is told to read.
func TestREADMEStatesTheLinkedLines(t *testing.T) {
	lines := 0
	for _, path := range goList(t, `{{if and .Module .Module.Main}}{{$d := .Dir}}{{range .GoFiles}}{{$d}}/{{.}} {{end}}{{end}}`) {
		if strings.HasSuffix(path, ".pb.go") {
			continue
		}
		data, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		lines += bytes.Count(data, []byte("\n"))
	}
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	m := statedLines.FindSubmatch(readme)
	if m == nil {
		t.Fatalf("README.md does not say \"about N lines of this module\" (nexus-spawnd links %d)", lines)
	}
	stated, _ := strconv.Atoi(strings.ReplaceAll(string(m[1]), " ", ""))
	if diff := stated - lines; diff*10 > lines || -diff*10 > lines {
		t.Errorf("README.md says nexus-spawnd links about %d lines of this module; it links %d: update the count", stated, lines)
	}
	t.Logf("nexus-spawnd links %d lines of this module (README: about %d)", lines, stated)
}
