package main

import (
	"os/exec"
	"strings"
	"testing"
)

// gatewaySide are packages that belong to the gateway, its clients or its
// tests, and must never be linked into the privileged binary: what a
// reviewer reads to trust spawnd is what `go list -deps ./cmd/nexus-spawnd`
// names. An entry ending in / stands for every package under it.
var gatewaySide = []string{
	"github.com/nexus-broker/nexus-broker/internal/a2a",
	"github.com/nexus-broker/nexus-broker/internal/auth",
	"github.com/nexus-broker/nexus-broker/internal/brokerd",
	"github.com/nexus-broker/nexus-broker/internal/config",
	"github.com/nexus-broker/nexus-broker/internal/echo",
	"github.com/nexus-broker/nexus-broker/internal/gateway",
	"github.com/nexus-broker/nexus-broker/internal/nexusclient",
	"github.com/nexus-broker/nexus-broker/internal/spawnclient",
	"github.com/nexus-broker/nexus-broker/pkg/brokerclient",
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe",
	"github.com/a2aproject/",
	"github.com/chromedp/",
	"github.com/coreos/go-oidc",
	"github.com/getkin/kin-openapi",
	"github.com/go-jose/",
	"github.com/gorilla/websocket",
	"github.com/nats-io/",
}

func TestLinksNoGatewayCode(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	deps := strings.Fields(string(out))
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
