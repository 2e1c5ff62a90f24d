package e2e

import (
	"context"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"
)

// runClient runs nexus-client with input piped in (stdin /dev/null when
// input is empty) and returns its output.
func runClient(t *testing.T, input string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin("nexus-client"), args...)
	if input != "" {
		cmd.Stdin = strings.NewReader(input)
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("nexus-client %v: %v\n%s", args, err, out)
	}
	return string(out)
}

// TestClientPipedKeepAndAttach: piped input waits for each answer before
// the next line and before the release, so `printf 'hello\n' |
// nexus-client` prints the answer; -keep leaves the lease claimed and says
// how to attach again; -ws attaches to it, and releases nothing.
func TestClientPipedKeepAndAttach(t *testing.T) {
	b := startBroker(t, Options{})
	out := runClient(t, "hello\nsecond\n", "-broker", b.Base)
	for _, want := range []string{"echo #1: hello", "echo #2: second (earlier: hello)", "released "} {
		if !strings.Contains(out, want) {
			t.Errorf("piped nexus-client output lacks %q:\n%s", want, out)
		}
	}
	if n := len(b.leases().Leases); n != 0 {
		t.Errorf("%d leases left after a piped session", n)
	}
	// </dev/null is no terminal either: no prompt, and the release.
	if out := runClient(t, "", "-broker", b.Base); strings.Contains(out, "type a line") || !strings.Contains(out, "released ") {
		t.Errorf("nexus-client </dev/null output:\n%s", out)
	}

	out = runClient(t, "kept\n", "-broker", b.Base, "-keep")
	m := regexp.MustCompile(`-ws (ws://\S+)`).FindStringSubmatch(out)
	if !strings.Contains(out, "echo #1: kept") || !strings.Contains(out, "stays claimed") || m == nil {
		t.Fatalf("nexus-client -keep output:\n%s", out)
	}
	if n := len(b.leases().Leases); n != 1 {
		t.Fatalf("%d leases after -keep, want 1", n)
	}
	out = runClient(t, "again\n", "-broker", b.Base, "-ws", m[1])
	if !strings.Contains(out, "echo #2: again (earlier: kept)") || strings.Contains(out, "released") {
		t.Errorf("nexus-client -ws output:\n%s", out)
	}
	if n := len(b.leases().Leases); n != 1 {
		t.Errorf("%d leases after -ws, want the kept one still claimed", n)
	}
}
