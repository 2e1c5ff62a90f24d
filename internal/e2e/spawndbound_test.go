package e2e

import (
	"net/http"
	"testing"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// TestSpawndBoundIsNoCapacity: past spawnd's own spawnd.max_leases (here
// below a max_concurrent that would admit more) the claim is the gateway's
// 503 no capacity, counted in claims_total, and nothing is spawned.
func TestSpawndBoundIsNoCapacity(t *testing.T) {
	b := startBroker(t, Options{YAML: "max_concurrent: 4\n", SpawndYAML: "  max_leases: 1\n"})
	b.claim(brokerclient.ClaimRequest{})
	code, body := b.do(http.MethodPost, "/claim", `{"config":"engine:\n  name: example\n"}`)
	if code != http.StatusServiceUnavailable || body != `{"error":"no capacity"}`+"\n" {
		t.Fatalf("claim past spawnd.max_leases = %d %q, want 503 {\"error\":\"no capacity\"}", code, body)
	}
	if v := b.metrics()[`nexus_broker_claims_total{outcome="no_capacity"}`]; v != 1 {
		t.Errorf(`claims_total{outcome="no_capacity"} = %v, want 1`, v)
	}
	if n := len(b.Instances()); n != 1 {
		t.Errorf("%d instances, want the first claim's alone", n)
	}
}
