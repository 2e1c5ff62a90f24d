// Command nexus-cluster is `make cluster`: an embedded nats-server and three
// nexus-broker pairs on loopback in cluster mode, until Ctrl-C. See package
// internal/clusterdemo.
//
// Of the project it imports only internal/clusterdemo.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"github.com/nexus-broker/nexus-broker/internal/clusterdemo"
)

func main() {
	exe, err := os.Executable()
	if err != nil {
		fmt.Fprintln(os.Stderr, "nexus-cluster:", err)
		os.Exit(1)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := clusterdemo.Run(ctx, filepath.Dir(exe), os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "nexus-cluster:", err)
		os.Exit(1)
	}
}
