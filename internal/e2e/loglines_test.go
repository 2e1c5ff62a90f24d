package e2e

import (
	"bytes"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// TestAFloodToAStalledClientWritesAFewLines: an instance streaming 1 M
// deltas to a client that reads nothing loses frame after frame to the
// replay bound, and the gateway's log says so in a few
// dozen lines (the first drop, then one summary with the count per 10 s),
// not one line per frame.
func TestAFloodToAStalledClientWritesAFewLines(t *testing.T) {
	// The write wait outlasts the flood, so the client stays attached and
	// stalled throughout: every frame past the replay bound is a drop.
	b := startBroker(t, Options{YAML: "client_replay_buffer_bytes: 3000\n",
		GatewayEnv: []string{"NEXUS_BROKER_TEST_WRITE_WAIT=30m"}})
	claim := b.claim(brokerclient.ClaimRequest{})
	ws := dialSmallBuffer(t, claim.WSURL)
	before := strings.Count(b.GatewayLog.String(), "\n")
	writeInput(t, ws, claim.LeaseID, "/big 1000000")
	// The turn is over once nexus-echo has recorded it in its transcript,
	// after its last delta was sent.
	transcript := filepath.Join(b.Home, ".nexus", "sessions", claim.SessionID, "transcript.jsonl")
	eventually(t, 10*time.Minute, func() string { return "the 1 M-delta turn to end" }, func() bool {
		data, _ := os.ReadFile(transcript)
		return bytes.Count(data, []byte("\n")) == 1
	})
	dropped := b.metrics()[`nexus_broker_frames_dropped_total{reason="client_buffer_full"}`]
	logged := strings.Split(b.GatewayLog.String(), "\n")[before:]
	drops := regexp.MustCompile(`msg="peer send buffer full, dropping frame" lease_id=` + claim.LeaseID)
	n := 0
	for _, line := range logged {
		if drops.MatchString(line) {
			n++
		}
	}
	if dropped == 0 || n == 0 || len(logged) > 50 {
		t.Fatalf("%.0f frames dropped wrote %d drop lines and %d lines in all, want some and at most 50", dropped, n, len(logged))
	}
	t.Logf("%.0f frames dropped, %d drop lines, %d lines in all", dropped, n, len(logged))
}
