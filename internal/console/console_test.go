package console

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/config"
	"github.com/nexus-broker/nexus-broker/internal/gateway"
	"github.com/nexus-broker/nexus-broker/internal/httpapi"
)

// TestConsoleLoopbackOnlyWithoutAuth: without an auth: block the console
// and its stream answer loopback peers, and refuse anyone else with a 403
// naming the key, unless console.allow_remote is set.
func TestConsoleLoopbackOnlyWithoutAuth(t *testing.T) {
	for _, c := range []struct {
		peer        string
		allowRemote bool
		want        int
	}{
		{"127.0.0.1:40000", false, http.StatusOK},
		{"127.8.9.10:40000", false, http.StatusOK},
		{"[::1]:40000", false, http.StatusOK},
		{"192.0.2.7:40000", false, http.StatusForbidden},
		{"[2001:db8::1]:40000", false, http.StatusForbidden},
		{"[::ffff:192.0.2.7]:40000", false, http.StatusForbidden},
		{"192.0.2.7:40000", true, http.StatusOK},
	} {
		cfg := config.Default()
		cfg.Console.AllowRemote = c.allowRemote
		log := slog.New(slog.NewTextHandler(io.Discard, nil))
		g := gateway.New(gateway.Options{Config: cfg, Logger: log})
		Attach(g)
		for _, path := range []string{"/console", "/console/events"} {
			ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
			r := httptest.NewRequestWithContext(ctx, http.MethodGet, path, nil)
			r.RemoteAddr = c.peer
			r.Host = "localhost:8080" // a name of this broker's (hostguard)
			// X-Forwarded-For is never read: only the TCP peer counts.
			r.Header.Set("X-Forwarded-For", "127.0.0.1")
			w := httptest.NewRecorder()
			httpapi.Handler(g, log).ServeHTTP(w, r) // the stream ends with ctx
			cancel()
			if w.Code != c.want {
				t.Errorf("%s from %s (allow_remote %v) = %d, want %d", path, c.peer, c.allowRemote, w.Code, c.want)
			}
			if w.Code == http.StatusForbidden && !strings.Contains(w.Body.String(), "console.allow_remote") {
				t.Errorf("%s from %s: refusal %q does not name console.allow_remote", path, c.peer, w.Body)
			}
			if w.Code == http.StatusOK && path == "/console/events" && !strings.Contains(w.Body.String(), "event: snapshot\ndata: {") {
				t.Errorf("%s from %s: no snapshot event in %q", path, c.peer, w.Body)
			}
		}
		g.Shutdown()
	}
}

// TestConsoleHubKeepsTheLastEvents: the event list is bounded, newest
// first, and every record wakes a watcher.
func TestConsoleHubKeepsTheLastEvents(t *testing.T) {
	h := newConsoleHub()
	_, changed := h.watch()
	for i := range consoleEvents + 7 {
		h.record(gateway.Event{Kind: gateway.EventClaimed, LeaseID: strings.Repeat("x", i+1)})
	}
	select {
	case <-changed:
	default:
		t.Fatal("recording an event did not wake the watcher")
	}
	evs, _ := h.watch()
	if len(evs) != consoleEvents {
		t.Fatalf("%d events kept, want %d", len(evs), consoleEvents)
	}
	if got := len(evs[0].LeaseID); got != consoleEvents+7 {
		t.Errorf("first event is lease #%d, want the newest (#%d)", got, consoleEvents+7)
	}
	if got := len(evs[len(evs)-1].LeaseID); got != 8 {
		t.Errorf("last event is lease #%d, want #8", got)
	}
}
