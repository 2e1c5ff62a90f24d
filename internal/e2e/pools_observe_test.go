package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// What an operator sees of the warm pools: GET /leases, /metrics, the
// console, and an A2A profile with warm:.

// TestPoolMetricsFromTheFirstScrape: the three pool families parse, with
// a series per pool (labelled by its name, never its config_file) at 0 on
// the first scrape, before any claim or boot failure; then a hit, a miss
// and a refill failure are counted against their own pool.
func TestPoolMetricsFromTheFirstScrape(t *testing.T) {
	good, file := poolYAML(t, "default", "nexus", 1)
	broken, _ := poolYAML(t, "broken", "doomed", 1)
	b := startBroker(t, Options{YAML: fmt.Sprintf("  doomed:\n    path: %q\n    env: {NEXUS_ECHO_EXIT_BEFORE_READY: \"1\"}\nmax_concurrent: 6\npools:\n%s%s",
		bin("nexus-echo"), good, broken)})
	_, families := b.scrape()
	want := map[string]struct {
		typ    dto.MetricType
		series []string
	}{
		"pool_idle":                  {dto.MetricType_GAUGE, []string{"pool=default", "pool=broken"}},
		"pool_claims_total":          {dto.MetricType_COUNTER, []string{"pool=default,outcome=hit", "pool=default,outcome=miss", "pool=broken,outcome=hit", "pool=broken,outcome=miss"}},
		"pool_refill_failures_total": {dto.MetricType_COUNTER, []string{"pool=default", "pool=broken"}},
	}
	for name, w := range want {
		f := families["nexus_broker_"+name]
		if f == nil || f.GetType() != w.typ {
			t.Errorf("family nexus_broker_%s is %v, want a %v", name, f, w.typ)
			continue
		}
		var got []string
		for _, m := range f.Metric {
			var labels []string
			for _, l := range m.Label {
				labels = append(labels, l.GetName()+"="+l.GetValue())
				if strings.Contains(l.GetValue(), file) || strings.Contains(l.GetValue(), "/") {
					t.Errorf("%s is labelled with a path: %v", name, m.Label)
				}
			}
			got = append(got, strings.Join(labels, ","))
			// Idle may already be 1, the warm instance booted, and the
			// broken pool's first boot may already have failed.
			booted := name == "pool_idle" || name == "pool_refill_failures_total" && got[len(got)-1] == "pool=broken"
			if v := m.GetCounter().GetValue(); !booted && v != 0 {
				t.Errorf("%s%v = %v on the first scrape", name, m.Label, v)
			}
		}
		if strings.Join(got, " ") != strings.Join(w.series, " ") {
			t.Errorf("%s series %v, want %v", name, got, w.series)
		}
	}

	b.awaitPoolIdle("default")
	b.claim(brokerclient.ClaimRequest{Config: poolConfig})
	eventually(t, 30*time.Second, func() string { return "no refill failure of the broken pool" },
		func() bool { return b.metrics()[`nexus_broker_pool_refill_failures_total{pool="broken"}`] >= 1 })
	// The broken pool never has an idle instance: its claim is a miss (a
	// cold spawn, which fails as that entry does).
	if _, err := b.Client.Claim(context.Background(), brokerclient.ClaimRequest{Binary: "doomed", Config: poolConfig}); err == nil {
		t.Fatal("a claim of the broken entry succeeded")
	}
	m := b.metrics()
	for series, v := range map[string]float64{
		`nexus_broker_pool_claims_total{pool="default",outcome="hit"}`:  1,
		`nexus_broker_pool_claims_total{pool="default",outcome="miss"}`: 0,
		`nexus_broker_pool_claims_total{pool="broken",outcome="miss"}`:  1,
		`nexus_broker_pool_claims_total{pool="broken",outcome="hit"}`:   0,
		`nexus_broker_pool_refill_failures_total{pool="default"}`:       0,
	} {
		if m[series] != v {
			t.Errorf("%s = %v, want %v", series, m[series], v)
		}
	}
}

// TestWarmLeasesInTheOperatorView: GET /leases of an operator lists a
// warm lease with its usual state and its pool, and the claimed one
// without; the console shows the pool's idle/min_idle and offers no
// release of a warm lease.
func TestWarmLeasesInTheOperatorView(t *testing.T) {
	pools, _ := poolYAML(t, "default", "nexus", 1)
	b := startBroker(t, Options{YAML: "max_concurrent: 4\npools:\n" + pools})
	w := b.waitWarm(1)[0]
	if w.Pool != "default" || w.State != "active" {
		t.Fatalf("the warm lease is listed as %+v, want state active and pool default", w)
	}
	snap := consoleSnapshotOf(t, b)
	if len(snap.Pools) != 1 || snap.Pools[0].Name != "default" || snap.Pools[0].Binary != "nexus" || snap.Pools[0].MinIdle != 1 || snap.Pools[0].Idle != 1 {
		t.Errorf("the console's pools: %+v", snap.Pools)
	}
	if len(snap.Leases) != 1 || snap.Leases[0].Pool != "default" || snap.Leases[0].Releasable {
		t.Errorf("the console's warm lease: %+v, want pool default and no release offered", snap.Leases)
	}
	c := b.claim(brokerclient.ClaimRequest{Config: poolConfig})
	if l, ok := b.lease(c.LeaseID); !ok || c.LeaseID != w.LeaseID || l.Pool != "" {
		t.Fatalf("the claimed lease is listed as %+v (%v), want the warm %s without a pool", l, ok, w.LeaseID)
	}
}

// consoleView is the part of a console snapshot the pool tests read.
type consoleView struct {
	Pools []struct {
		Name    string `json:"name"`
		Binary  string `json:"binary"`
		Idle    int    `json:"idle"`
		MinIdle int    `json:"min_idle"`
	} `json:"pools"`
	Leases []struct {
		LeaseID    string `json:"lease_id"`
		Pool       string `json:"pool"`
		Releasable bool   `json:"releasable"`
	} `json:"leases"`
}

// consoleSnapshotOf reads the first snapshot of GET /console/events.
func consoleSnapshotOf(t *testing.T, b *Broker) consoleView {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, "GET", b.Base+"/console/events", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		if data, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
			var v consoleView
			if err := json.Unmarshal([]byte(data), &v); err != nil {
				t.Fatalf("a console snapshot that is not JSON: %v: %s", err, data)
			}
			return v
		}
	}
	t.Fatalf("no console snapshot: %v", sc.Err())
	return consoleView{}
}
