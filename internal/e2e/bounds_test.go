package e2e

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/echo"
	"github.com/nexus-broker/nexus-broker/internal/httpapi"
	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// httpBound is the body and idle timeout the bounds tests run the gateway
// with.
const httpBound = 300 * time.Millisecond

// startBoundedBroker starts a broker whose HTTP bounds are httpBound and
// whose instances take bootDelay to dial back.
func startBoundedBroker(t *testing.T, bootDelay time.Duration) *Broker {
	return startBroker(t, Options{
		NoNexusEntry: true,
		YAML:         fmt.Sprintf("binaries:\n  nexus:\n    path: %q\n    env: {%s: %q}\n", bin("nexus-echo"), echo.EnvBootDelay, bootDelay.String()),
		Env:          []string{fmt.Sprintf("%s=%s,%s", httpapi.TestHTTPTimeoutsEnv, httpBound, httpBound)},
	})
}

// awaitClosed reads conn until the server closes it, failing the test if
// that takes longer than within (the bound plus generous slack for a loaded
// machine: what fails on a gateway without the bound is that it never
// closes at all).
func awaitClosed(t *testing.T, conn net.Conn, within time.Duration) {
	t.Helper()
	_ = conn.SetReadDeadline(time.Now().Add(within))
	if _, err := io.Copy(io.Discard, conn); err != nil {
		t.Fatalf("the gateway did not close the connection within %s: %v", within, err)
	}
}

// TestSlowBodyClaimIsClosed: a claim whose body stalls after its headers is
// cut off after the body timeout.
func TestSlowBodyClaimIsClosed(t *testing.T) {
	b := startBoundedBroker(t, 0)
	conn, err := net.Dial("tcp", b.Addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := fmt.Fprintf(conn, "POST /claim HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"con", b.Addr); err != nil {
		t.Fatal(err)
	}
	awaitClosed(t, conn, 10*time.Second)
	if _, inUse := b.slots(); inUse != 0 {
		t.Fatalf("a claim whose body never came holds %d slots", inUse)
	}
}

// TestIdleKeepAliveIsClosed: a keep-alive connection with no request in
// flight is closed after the idle timeout.
func TestIdleKeepAliveIsClosed(t *testing.T) {
	b := startBoundedBroker(t, 0)
	conn, err := net.Dial("tcp", b.Addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := fmt.Fprintf(conn, "GET /healthz HTTP/1.1\r\nHost: %s\r\n\r\n", b.Addr); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil || resp.StatusCode != 200 || resp.Close {
		t.Fatalf("GET /healthz = %v, %v; want 200 on a kept-alive connection", resp, err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	awaitClosed(t, conn, 10*time.Second)
}

// TestHTTPBoundsSpareSlowClaimsAndWebSockets: a claim whose instance boots
// for longer than both bounds is answered, and a lease socket idle for
// longer than both stays open.
func TestHTTPBoundsSpareSlowClaimsAndWebSockets(t *testing.T) {
	b := startBoundedBroker(t, 4*httpBound)
	c := b.claim(brokerclient.ClaimRequest{})
	conn := b.dial(c, brokerclient.DialOptions{})
	// Not synchronisation: the property is that nothing happens for longer
	// than the bounds.
	time.Sleep(4 * httpBound)
	if got := say(t, conn, "still there"); got != "echo #1: still there" {
		t.Fatalf("answer after idling past the HTTP bounds = %q", got)
	}
}
