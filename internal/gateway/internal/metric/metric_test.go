package metric

import (
	"strings"
	"testing"
	"time"
)

// TestExposition holds the text format byte for byte: a series per value
// from the first scrape, cumulative buckets, +Inf, sum and count.
func TestExposition(t *testing.T) {
	v := NewCounterVec("reason", []string{"a", "b"})
	v.Inc("b")
	v.Add("b", 2)
	h := Histogram{Buckets: []float64{0.005, 0.5}}
	h.Observe(time.Millisecond)
	h.Observe(time.Second)
	var w strings.Builder
	v.Write(&w, "ns_", "things_total", "Things.")
	h.Write(&w, "ns_", "wait_seconds", "Waits.")
	want := `# HELP ns_things_total Things.
# TYPE ns_things_total counter
ns_things_total{reason="a"} 0
ns_things_total{reason="b"} 3
# HELP ns_wait_seconds Waits.
# TYPE ns_wait_seconds histogram
ns_wait_seconds_bucket{le="0.005"} 1
ns_wait_seconds_bucket{le="0.5"} 1
ns_wait_seconds_bucket{le="+Inf"} 2
ns_wait_seconds_sum 1.001
ns_wait_seconds_count 2
`
	if w.String() != want {
		t.Errorf("exposition:\n%s\nwant:\n%s", w.String(), want)
	}
	defer func() {
		if recover() == nil {
			t.Error("a value outside the set did not panic")
		}
	}()
	v.Inc("c")
}
