package e2e

import (
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// TestWSURLOfAnEphemeralPort: listen_addr "127.0.0.1:0" names a host, so
// the ws_url a claim returns is built from it rather than from the Host
// header; it must carry the port the listener bound, never ":0", and a
// client must be able to dial it as returned.
func TestWSURLOfAnEphemeralPort(t *testing.T) {
	b := startListeningOn(t, "127.0.0.1:0")
	c := b.claim(brokerclient.ClaimRequest{})
	if want := "ws://" + b.Addr + "/lease/" + c.LeaseID; c.WSURL != want {
		t.Fatalf("ws_url %q, want %q (the bound port)", c.WSURL, want)
	}
	if got := say(t, b.dial(c, brokerclient.DialOptions{}), "hi"); !strings.HasSuffix(got, "hi") {
		t.Errorf("over the returned ws_url the instance answered %q", got)
	}
}

// startListeningOn starts a broker the make-run way (the gateway launches
// its spawnd) whose listen_addr is listen.
func startListeningOn(t *testing.T, listen string) *Broker {
	t.Helper()
	b := newBroker(t, Options{Launch: true})
	data, err := os.ReadFile(b.ConfigPath)
	if err != nil {
		t.Fatal(err)
	}
	fixed := regexp.MustCompile(`(?m)^listen_addr: .*$`)
	if err := os.WriteFile(b.ConfigPath, fixed.ReplaceAll(data, []byte(fmt.Sprintf("listen_addr: %q", listen))), 0o600); err != nil {
		t.Fatal(err)
	}
	b.StartGateway()
	return b
}
