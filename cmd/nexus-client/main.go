// Command nexus-client is a small interactive client of nexus-broker: it
// claims an instance (or attaches to a lease claimed elsewhere with -ws),
// sends each line you type as input, prints the streamed answer, and
// releases on exit. With piped input each line waits for its answer. A
// dropped socket is reconnected with a fresh ticket and ?from_seq=, so
// nothing is lost.
//
// Of the project it imports only internal/nexusclient.
package main

import (
	"flag"
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/nexus-broker/nexus-broker/internal/nexusclient"
)

func main() {
	var o nexusclient.Options
	flag.StringVar(&o.Broker, "broker", "http://127.0.0.1:8080", "the broker's http:// address")
	flag.StringVar(&o.Binary, "binary", "", "binaries: entry to claim (default: the reserved nexus entry)")
	flag.StringVar(&o.Session, "session", "", "resume this session id")
	flag.StringVar(&o.Config, "engine-config", "engine:\n  name: example\n", "the nexus config (YAML text) the claim carries")
	flag.StringVar(&o.WSURL, "ws", "", "attach to this ws_url of a lease claimed elsewhere instead of claiming (nothing is released on exit)")
	flag.BoolVar(&o.Keep, "keep", false, "leave the lease claimed on exit, and print how to attach again")
	flag.StringVar(&o.Token, "token", os.Getenv("NEXUS_BROKER_TOKEN"), "bearer token, when the broker has an auth: block")
	flag.Parse()
	o.In, o.Out = os.Stdin, os.Stdout
	// Anything but a terminal is piped input, /dev/null included (a
	// character device, but nobody types into it).
	_, notTTY := unix.IoctlGetTermios(int(os.Stdin.Fd()), unix.TCGETS)
	o.Piped = notTTY != nil
	if err := nexusclient.Run(o); err != nil {
		fmt.Fprintln(os.Stderr, "nexus-client:", err)
		os.Exit(1)
	}
}
