package e2e

import (
	"sort"
	"strings"
	"testing"

	"github.com/a2aproject/a2a-go/v2/a2a"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// TestMetricsExposition parses GET /metrics with the Prometheus text parser
// on the first scrape: every family of the wire contract, with its type and
// its whole fixed label set, present at 0.
func TestMetricsExposition(t *testing.T) {
	b := startBroker(t, Options{})
	text, families := b.scrape()
	want := map[string]struct {
		typ    dto.MetricType
		label  string
		values []string
	}{
		"claims_total": {dto.MetricType_COUNTER, "outcome", []string{"accepted", "rejected", "no_capacity", "queue_timeout", "queue_full",
			"principal_lease_limit", "principal_queue_limit", "cancelled", "spawn_failed", "ready_timeout", "journal_unavailable", "internal", "broker_draining"}},
		"claim_duration_seconds": {dto.MetricType_HISTOGRAM, "", nil},
		"spawn_failures_total":   {dto.MetricType_COUNTER, "reason", []string{"exec", "exited_before_ready", "ready_timeout"}},
		"frames_dropped_total": {dto.MetricType_COUNTER, "reason", []string{"undecodable", "lease_mismatch", "no_instance",
			"instance_buffer_full", "client_buffer_full", "lease_gone", "client_control"}},
		"replay_gaps_total":      {dto.MetricType_COUNTER, "reason", []string{"evicted", "restarted"}},
		"client_evictions_total": {dto.MetricType_COUNTER, "", nil},
		"config_reloads_total":   {dto.MetricType_COUNTER, "outcome", []string{"applied", "rejected"}},
		"restored_leases_total":  {dto.MetricType_COUNTER, "outcome", []string{"restored", "reattached", "reaped"}},
		"slots_in_use":           {dto.MetricType_GAUGE, "", nil},
		"max_concurrent":         {dto.MetricType_GAUGE, "", nil},
		"queue_depth":            {dto.MetricType_GAUGE, "", nil},
		"max_queue_depth":        {dto.MetricType_GAUGE, "", nil},
		"tickets_outstanding":    {dto.MetricType_GAUGE, "", nil},
		"leases":                 {dto.MetricType_GAUGE, "state", []string{"active", "draining", "spawning"}},
	}
	for name, w := range want {
		f, ok := families["nexus_broker_"+name]
		if !ok {
			t.Errorf("missing family nexus_broker_%s", name)
			continue
		}
		if f.GetType() != w.typ {
			t.Errorf("%s has type %v, want %v", name, f.GetType(), w.typ)
		}
		var got []string
		for _, m := range f.Metric {
			v := m.GetCounter().GetValue() + m.GetGauge().GetValue() + float64(m.GetHistogram().GetSampleCount())
			if name != "max_concurrent" && name != "max_queue_depth" && v != 0 {
				t.Errorf("%s%v = %v on the first scrape", name, m.Label, v)
			}
			for _, l := range m.Label {
				if l.GetName() != w.label {
					t.Errorf("%s carries label %q", name, l.GetName())
				}
				got = append(got, l.GetValue())
			}
		}
		sort.Strings(got)
		wantValues := append([]string(nil), w.values...)
		sort.Strings(wantValues)
		if strings.Join(got, ",") != strings.Join(wantValues, ",") {
			t.Errorf("%s label values = %v, want %v", name, got, wantValues)
		}
	}
	if len(families) != len(want) {
		t.Errorf("%d families exposed, want %d", len(families), len(want))
	}
	if g := families["nexus_broker_max_concurrent"].Metric[0].GetGauge().GetValue(); g != 8 {
		t.Errorf("max_concurrent = %v", g)
	}
	// Every HELP line reads as upstream's, and the families come in its
	// order, so a scrape diffed against upstream's differs only in numbers.
	help := []struct{ name, text string }{
		{"claims_total", "Instance claims handled by the shared spawn spine, by outcome. Covers POST /claim and the A2A ingress."},
		{"claim_duration_seconds", "Wall time of an ACCEPTED claim, from request to a ready instance."},
		{"spawn_failures_total", "Instance spawns that produced no ready instance, by reason."},
		{"frames_dropped_total", "Broker frames discarded rather than relayed, by reason."},
		{"replay_gaps_total", "Stream-gap notices served to a resuming client, by reason."},
		{"client_evictions_total", "Client WebSockets displaced by a newer connection on the same lease."},
		{"config_reloads_total", "SIGHUP configuration reloads, by outcome."},
		{"restored_leases_total", "Leases adopted from the journal at boot, and what became of them."},
		{"slots_in_use", "Capacity slots currently held: one per live lease."},
		{"max_concurrent", "Configured max_concurrent ceiling. 0 means unlimited."},
		{"queue_depth", "Claims currently parked in the FIFO capacity queue."},
		{"max_queue_depth", "Configured max_queue_depth ceiling on parked claims. 0 means unlimited."},
		{"leases", "Live leases by operator-facing state."},
		{"tickets_outstanding", "Issued, unredeemed WebSocket tickets the broker still holds."},
	}
	last := -1
	for _, h := range help {
		name := "nexus_broker_" + h.name
		if got := families[name].GetHelp(); got != h.text {
			t.Errorf("%s HELP = %q, want %q", name, got, h.text)
		}
		at := strings.Index(text, "# HELP "+name+" ")
		if at < last {
			t.Errorf("%s is out of upstream's order", name)
		}
		last = at
	}
}

// scrape reads GET /metrics through the Prometheus text parser.
func (b *Broker) scrape() (string, map[string]*dto.MetricFamily) {
	b.t.Helper()
	_, text := b.get("/metrics")
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(strings.NewReader(text))
	if err != nil {
		b.t.Fatalf("the Prometheus text parser refused the exposition: %v\n%s", err, text)
	}
	return text, families
}

// claims_total counts every claim of the shared spawn spine, POST /claim's
// and the A2A ingress's alike, and claim_duration_seconds times only the
// accepted ones.
func TestClaimsOfBothIngressesAreCountedAndOnlyAcceptedOnesTimed(t *testing.T) {
	b := a2aBroker(t, "", Options{})
	b.claim(brokerclient.ClaimRequest{})
	for _, body := range []string{`{"config":""}`, `{`} {
		if status, _ := b.do("POST", "/claim", body); status != 400 {
			t.Fatalf("claim %s: %d", body, status)
		}
	}
	c := a2aClient(t, b, "support", a2a.TransportProtocolJSONRPC)
	if got := answerOf(t, sendTask(t, c, userMsg("conv-metrics", "hello"))); got != "echo #1: hello" {
		t.Fatalf("answer %q", got)
	}
	m := b.metrics()
	for series, want := range map[string]float64{
		`nexus_broker_claims_total{outcome="accepted"}`: 2,
		`nexus_broker_claims_total{outcome="rejected"}`: 2,
		`nexus_broker_claim_duration_seconds_count`:     2,
	} {
		if m[series] != want {
			t.Errorf("%s = %v, want %v", series, m[series], want)
		}
	}
}
