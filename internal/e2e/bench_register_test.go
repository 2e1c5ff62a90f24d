package e2e

import (
	"strings"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// registerRefusal times one refused registration on /instance as a dialer
// sees it: from sending the register frame to reading the close frame (the
// dial itself is outside the figure).
func registerRefusal(b *testing.B, br *Broker, leaseID, secret string) time.Duration {
	ws, _, err := websocket.DefaultDialer.Dial("ws://"+br.Addr+"/instance", nil)
	if err != nil {
		b.Fatal(err)
	}
	defer ws.Close()
	reg, _ := brokerframe.Encode(brokerframe.Frame{LeaseID: leaseID, Signal: brokerframe.SignalRegister, Secret: secret})
	_ = ws.SetReadDeadline(time.Now().Add(rttDeadline))
	start := time.Now()
	if err := ws.WriteMessage(websocket.TextMessage, reg); err != nil {
		b.Fatal(err)
	}
	_, _, err = ws.ReadMessage()
	d := time.Since(start)
	if ce, ok := err.(*websocket.CloseError); !ok || ce.Code != websocket.ClosePolicyViolation || ce.Text != "unknown lease" {
		b.Fatalf("register as %s: %v, want close 1008 unknown lease", leaseID, err)
	}
	return d
}

// BenchmarkRegisterRefusal is the dialer's view of issue 8's equal-time
// refusals through the real gateway and spawnd: a register frame for a live
// lease with a wrong secret (the baseline) against one for a lease id of the
// same length that was never minted, interleaved in one run. The two must
// not be told apart by time: the target is a median ratio of 1.00 ± 0.05.
func BenchmarkRegisterRefusal(b *testing.B) {
	benchPreflight(b)
	br := startBroker(b, Options{YAML: "idle_timeout: 0s\n"})
	live := br.claim(brokerclient.ClaimRequest{}).LeaseID
	cases := []struct{ name, id string }{{"wrong-secret", live}, {"unknown-lease", strings.Repeat("x", len(live))}}
	secret := strings.Repeat("0", 64)
	for _, c := range cases { // warm-up, not in the figures
		registerRefusal(b, br, c.id, secret)
	}
	samples := map[string][]time.Duration{}
	for i := 0; b.Loop(); i++ {
		for k := range cases {
			c := cases[(i+k)%len(cases)]
			samples[c.name] = append(samples[c.name], registerRefusal(b, br, c.id, secret))
		}
	}
	wrong, unknown := pct(samples["wrong-secret"], 50), pct(samples["unknown-lease"], 50)
	ratio := float64(unknown) / float64(wrong)
	b.ReportMetric(ms(wrong), "wrong-secret-p50-ms")
	b.ReportMetric(ms(unknown), "unknown-lease-p50-ms")
	b.ReportMetric(ratio, "unknown-vs-wrong")
	verdict(b, "refusals take the same time", ratio > 0.95 && ratio < 1.05, "median unknown lease %.3f ms, wrong secret %.3f ms, ratio %.3f", ms(unknown), ms(wrong), ratio)
}
