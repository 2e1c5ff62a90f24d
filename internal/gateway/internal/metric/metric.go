// Package metric is the gateway's Prometheus text-format counters: a
// counter per value of a fixed label set, and a fixed-bucket histogram.
// Every series exists from the first scrape. It imports nothing of the
// project.
package metric

import (
	"fmt"
	"io"
	"math"
	"sort"
	"sync"
	"sync/atomic"
	"time"
)

// CounterVec is a counter per label value of one fixed set.
type CounterVec struct {
	label  string
	values map[string]*atomic.Uint64
	order  []string
}

// NewCounterVec is a CounterVec of label over values, each at 0.
func NewCounterVec(label string, values []string) *CounterVec {
	v := &CounterVec{label: label, values: map[string]*atomic.Uint64{}, order: values}
	for _, s := range values {
		v.values[s] = new(atomic.Uint64)
	}
	return v
}

// Inc counts one event; a value outside the set is a programming error and
// panics in tests rather than silently growing the series set.
func (v *CounterVec) Inc(value string) {
	v.Add(value, 1)
}

// Add counts n events of value.
func (v *CounterVec) Add(value string, n uint64) {
	c, ok := v.values[value]
	if !ok {
		panic(fmt.Sprintf("metrics: %q is not a %s value", value, v.label))
	}
	c.Add(n)
}

// Get is value's count.
func (v *CounterVec) Get(value string) uint64 { return v.values[value].Load() }

// Write writes the family name (after ns) with its help, a series a value.
func (v *CounterVec) Write(w io.Writer, ns, name, help string) {
	Header(w, ns+name, "counter", help)
	for _, val := range v.order {
		fmt.Fprintf(w, "%s%s{%s=%q} %d\n", ns, name, v.label, val, v.Get(val))
	}
}

// Histogram is a fixed-bucket histogram of durations, in seconds.
type Histogram struct {
	// Buckets are the upper bounds, ascending; +Inf is added.
	Buckets []float64
	mu      sync.Mutex
	counts  []uint64 // per bucket, plus +Inf
	sum     float64
	n       uint64
}

// Observe counts one duration.
func (h *Histogram) Observe(d time.Duration) {
	s := d.Seconds()
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.counts == nil {
		h.counts = make([]uint64, len(h.Buckets)+1)
	}
	h.counts[sort.SearchFloat64s(h.Buckets, s)]++
	h.sum += s
	h.n++
}

// Write writes the family name (after ns) with its help.
func (h *Histogram) Write(w io.Writer, ns, name, help string) {
	h.mu.Lock()
	counts := append([]uint64(nil), h.counts...)
	if counts == nil {
		counts = make([]uint64, len(h.Buckets)+1)
	}
	sum, n := h.sum, h.n
	h.mu.Unlock()
	Header(w, ns+name, "histogram", help)
	var cum uint64
	for i, le := range h.Buckets {
		cum += counts[i]
		fmt.Fprintf(w, "%s%s_bucket{le=%q} %d\n", ns, name, formatFloat(le), cum)
	}
	cum += counts[len(h.Buckets)]
	fmt.Fprintf(w, "%s%s_bucket{le=\"+Inf\"} %d\n", ns, name, cum)
	fmt.Fprintf(w, "%s%s_sum %s\n%s%s_count %d\n", ns, name, formatFloat(sum), ns, name, n)
}

// Header writes a family's HELP and TYPE lines.
func Header(w io.Writer, name, typ, help string) {
	fmt.Fprintf(w, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, typ)
}

func formatFloat(f float64) string {
	if f == math.Trunc(f) && math.Abs(f) < 1e15 {
		return fmt.Sprintf("%.0f", f)
	}
	return fmt.Sprintf("%g", f)
}
