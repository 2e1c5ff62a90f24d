// Command nexus-echo is the reference nexus instance: a real dial-back client
// in front of a deterministic fake agent. nexus-broker's spawn daemon starts
// it as
//
//	nexus-echo -config FILE [-recall SESSION] [entry args]
//
// with NEXUS_BROKER_ADDR, NEXUS_BROKER_LEASE_ID and NEXUS_BROKER_SPAWN_SECRET
// in its environment. See package internal/echo for what it does.
//
// Of the project it imports only internal/echo.
package main

import (
	"flag"
	"fmt"
	"log/slog"
	"os"

	"github.com/nexus-broker/nexus-broker/internal/echo"
)

func main() {
	// The same three flags stock nexus accepts, and no others: an entry whose
	// args name a flag a stock build would reject must fail here too.
	configPath := flag.String("config", "", "session config file written by the broker (required; its content is ignored)")
	recall := flag.String("recall", "", "resume the session with this id instead of starting a new one")
	flag.Bool("replay", false, "accepted for compatibility with stock nexus; ignored")
	flag.Parse()
	if *configPath == "" {
		fmt.Fprintln(os.Stderr, "nexus-echo: -config is required: pass the session config file (nexus-broker's spawn daemon does this)")
		flag.Usage()
		os.Exit(echo.ExitUsage)
	}
	os.Exit(echo.Run(echo.Options{
		ConfigPath: *configPath,
		Recall:     *recall,
		Args:       flag.Args(),
		Logger:     slog.New(slog.NewTextHandler(os.Stderr, nil)),
	}))
}
