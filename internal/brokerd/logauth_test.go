package brokerd

import (
	"bytes"
	"log/slog"
	"regexp"
	"strings"
	"testing"

	"github.com/nexus-broker/nexus-broker/internal/config"
)

// TestLogAuthBootWarnings: no auth: block is the spec's WARN, word for
// word, and a second, plainer one only when the port is reachable beyond
// loopback; an auth: block is neither.
func TestLogAuthBootWarnings(t *testing.T) {
	const spec = `level=WARN msg="client authentication is DISABLED: broker config has no auth block, so any caller that can reach this broker can claim, release and list leases"`
	const second = "anyone who can reach this port controls every lease"
	for _, tc := range []struct {
		yaml          string
		first, second bool
	}{
		{`listen_addr: "127.0.0.1:8080"`, true, false},
		{`listen_addr: ":8080"`, true, true},
		{`listen_addr: "10.0.0.5:8080"`, true, true},
		{"listen_addr: \":8080\"\nauth:\n  validators: [{type: static, tokens: [{token: t, principal: p}]}]\n", false, false},
		{"listen_addr: \":8080\"\nauth:\n  validators: [{type: static, tokens: [{token: t, principal: p}]}, {type: static, tokens: [{token: u, principal: q}]}]\n", false, false},
	} {
		c, err := config.Parse([]byte(tc.yaml))
		if err != nil {
			t.Fatal(err)
		}
		var buf bytes.Buffer
		logAuth(c, slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{ReplaceAttr: dropTime})))
		out := buf.String()
		if strings.Contains(out, spec) != tc.first || strings.Contains(out, second) != tc.second {
			t.Errorf("%q logged:\n%s", tc.yaml, out)
		}
		if strings.Contains(out, second) && strings.Index(out, second) < strings.Index(out, spec) {
			t.Errorf("the second WARN came first:\n%s", out)
		}
		// Upstream's names, as a list: a repeated type is numbered.
		announced := regexp.MustCompile(`msg="client authentication enabled" validators=(\[static\]|"\[static static#2\]") admin_scope=`)
		if !tc.first && !announced.MatchString(out) {
			t.Errorf("an auth: block was not announced:\n%s", out)
		}
	}
}

func dropTime(_ []string, a slog.Attr) slog.Attr {
	if a.Key == slog.TimeKey {
		return slog.Attr{}
	}
	return a
}

// TestReleaseHint: Ctrl-C of make run names make stop; of a gateway on a
// file of its own, -stop with that file.
func TestReleaseHint(t *testing.T) {
	if got := releaseHint(true, "/run/user/0/nexus-broker-dev/broker.yaml"); got != "make stop (bin/nexus-broker -stop)" {
		t.Errorf("development defaults: %q", got)
	}
	if got := releaseHint(false, "/etc/nexus-broker/broker.yaml"); got != "nexus-broker -stop -config /etc/nexus-broker/broker.yaml" {
		t.Errorf("a config file: %q", got)
	}
}
