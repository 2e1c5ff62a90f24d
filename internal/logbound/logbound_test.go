package logbound

import (
	"context"
	"fmt"
	"log/slog"
	"testing"
	"time"
)

// records is a slog handler that hands every record to a channel.
type records chan slog.Record

func (r records) Enabled(context.Context, slog.Level) bool        { return true }
func (r records) Handle(_ context.Context, rec slog.Record) error { r <- rec; return nil }
func (r records) WithAttrs([]slog.Attr) slog.Handler              { return r }
func (r records) WithGroup(string) slog.Handler                   { return r }

func attrs(rec slog.Record) map[string]string {
	out := map[string]string{}
	rec.Attrs(func(a slog.Attr) bool { out[a.Key] = a.Value.String(); return true })
	return out
}

func next(t *testing.T, r records) slog.Record {
	t.Helper()
	select {
	case rec := <-r:
		return rec
	case <-time.After(10 * time.Second):
		t.Fatal("no log line within 10 s")
		return slog.Record{}
	}
}

// TestAFloodWritesOneLineThenOneSummary: 100 000 occurrences of one key
// write the first at once and, at each window's end, one summary with the
// first line's attributes: two lines per window, whose counts add up to
// every occurrence. The next occurrence after the flood opens a new window
// and is written again.
func TestAFloodWritesOneLineThenOneSummary(t *testing.T) {
	const n, window = 100_000, 200 * time.Millisecond
	r := make(records, 1024)
	l := New(slog.New(r), window)
	start := time.Now()
	for i := range n {
		l.Warn("lease-1", "dropping frame", "lease_id", "lease-1", "n", i)
	}
	windows := int(time.Since(start)/window) + 1
	counted, lines := 0, 0
	for counted < n {
		rec := next(t, r)
		a := attrs(rec)
		if rec.Message != "dropping frame" || rec.Level != slog.LevelWarn || a["lease_id"] != "lease-1" {
			t.Fatalf("line %d: %s %v", lines, rec.Message, a)
		}
		lines++
		if a["suppressed"] == "" {
			counted++
			continue
		}
		var k int
		fmt.Sscan(a["suppressed"], &k)
		if a["window"] != window.String() || k <= 0 {
			t.Fatalf("summary: %v", a)
		}
		counted += k
	}
	if lines > 2*windows {
		t.Fatalf("%d lines for %d occurrences over %d windows, want at most 2 a window", lines, n, windows)
	}
	if counted != n {
		t.Fatalf("the lines account for %d occurrences, want %d", counted, n)
	}
	time.AfterFunc(2*window, func() { l.Warn("lease-1", "dropping frame", "n", -1) })
	if again := next(t, r); attrs(again)["n"] != "-1" || attrs(again)["suppressed"] != "" {
		t.Fatalf("after the window: %s %v", again.Message, attrs(again))
	}
}

// TestKeysAreSubjectAndMessage: another subject or another message is its
// own key and is written at once; a key seen once has no summary.
func TestKeysAreSubjectAndMessage(t *testing.T) {
	r := make(records, 16)
	l := New(slog.New(r), 50*time.Millisecond)
	l.Warn("a", "m1")
	l.Warn("b", "m1")
	l.Warn("a", "m2")
	l.Warn("a", "m1")
	for _, want := range []string{"m1", "m1", "m2"} {
		if got := next(t, r).Message; got != want {
			t.Fatalf("got %q, want %q", got, want)
		}
	}
	if s := next(t, r); s.Message != "m1" || attrs(s)["suppressed"] != "1" {
		t.Fatalf("summary: %s %v", s.Message, attrs(s))
	}
	// a/m2 and b/m1 end without a summary: nothing more comes once a later
	// window's line (written after theirs closed) has arrived.
	time.AfterFunc(100*time.Millisecond, func() { l.Warn("c", "marker") })
	if m := next(t, r); m.Message != "marker" {
		t.Fatalf("a key seen once wrote a summary: %s %v", m.Message, attrs(m))
	}
}

// TestInventedSubjectsShareOneKey: past maxKeys live keys, new subjects
// share one, so a peer making up lease ids writes a bounded number of lines.
func TestInventedSubjectsShareOneKey(t *testing.T) {
	r := make(records, maxKeys+16)
	l := New(slog.New(r), time.Hour)
	for i := range maxKeys + 1000 {
		l.Warn(fmt.Sprint("lease-", i), "unknown lease")
	}
	if n := len(r); n != maxKeys+1 {
		t.Fatalf("%d lines for %d invented subjects, want %d", n, maxKeys+1000, maxKeys+1)
	}
}
