package spawnd

import (
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// A gateway asking for more than spawnd.max_leases live leases is refused
// by spawnd itself; a lease being torn down frees its place.
func TestSpawnPastMaxLeasesIsRefused(t *testing.T) {
	h := newHarness(t, defaultYAML+"spawnd: {max_leases: 2}\n")
	h.spawn("lease-1", "nexus")
	h.spawn("lease-2", "nexus")
	_, err := h.client.Spawn(h.ctx(), &spawnpb.SpawnRequest{LeaseId: "lease-3", Entry: "nexus", Config: []byte("core: {}\n")})
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "spawnd.max_leases") {
		t.Fatalf("third Spawn = %v, want ResourceExhausted naming spawnd.max_leases", err)
	}
	// Terminating (release_grace is running): no longer counted.
	if _, err := h.client.Terminate(h.ctx(), &spawnpb.TerminateRequest{LeaseId: "lease-1", NoWait: true}); err != nil {
		t.Fatal(err)
	}
	h.spawn("lease-4", "nexus")
}

// The live temp configs' total is bounded by spawnd.max_config_bytes, and
// a refused Spawn writes nothing.
func TestSpawnPastMaxConfigBytesIsRefused(t *testing.T) {
	h := newHarness(t, defaultYAML+"spawnd: {max_config_bytes: 20}\n")
	h.spawn("lease-1", "nexus") // 9 bytes of config
	_, err := h.client.Spawn(h.ctx(), &spawnpb.SpawnRequest{LeaseId: "lease-2", Entry: "nexus", Config: []byte(strings.Repeat("#", 12))})
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "spawnd.max_config_bytes") {
		t.Fatalf("Spawn of 12 more bytes = %v, want ResourceExhausted naming spawnd.max_config_bytes", err)
	}
	if _, err := h.client.Terminate(h.ctx(), &spawnpb.TerminateRequest{LeaseId: "lease-1", SkipGrace: true}); err != nil {
		t.Fatal(err)
	}
	h.spawn("lease-3", "nexus")
}
