package brokerd

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// showDevClaim proves the development setup end to end the way a newcomer
// would: claim, say hello over the WebSocket, print the streamed answer,
// release; then prints the commands to do it by hand.
func showDevClaim(ctx context.Context, base string, log *slog.Logger) {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	c := &brokerclient.Client{Base: base}
	claim, err := c.Claim(ctx, brokerclient.ClaimRequest{Config: "engine:\n  name: example\n"})
	if err != nil {
		log.Error("development self-check: claim failed", "error", err)
		return
	}
	defer func() { _ = c.Release(context.Background(), claim.LeaseID) }()
	conn, err := brokerclient.Dial(ctx, claim.WSURL, brokerclient.DialOptions{})
	if err != nil {
		log.Error("development self-check: connecting to the lease failed", "error", err)
		return
	}
	defer conn.Close()
	if err := conn.Send(brokerframe.IO{Type: brokerframe.IOInput, Content: "hello"}); err != nil {
		log.Error("development self-check: sending input failed", "error", err)
		return
	}
	answer, err := conn.Answer()
	if err != nil {
		log.Error("development self-check: reading the answer failed", "error", err)
		return
	}
	fmt.Fprintf(os.Stdout, `
nexus-broker is up at %[1]s (development defaults, nexus-echo as the nexus entry).
Self-check: claimed lease %[2]s (session %[3]s), said "hello", got %[4]q, released it.

Try it yourself:
  curl -s -X POST %[1]s/claim -d '{"config":"engine:\n  name: example\n"}'
  bin/nexus-client -broker %[1]s          # claims, connects; type a line, see the streamed answer
  printf 'hello\n' | bin/nexus-client -broker %[1]s   # one answer per piped line, then release
  curl -s %[1]s/leases
  curl -s -X POST %[1]s/release/<lease_id>

Ctrl-C stops this gateway only: the nexus-spawnd it launched keeps every lease
still claimed (start the gateway again and they reattach) and exits on its own
10 s after its last one; make stop (bin/nexus-broker -stop) releases them all.

`, base, claim.LeaseID, claim.SessionID, answer)
}
