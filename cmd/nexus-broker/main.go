// Command nexus-broker is the unprivileged gateway of nexus-broker: the HTTP
// and WebSocket ingress. It attaches to nexus-spawnd (and in development
// starts it) for everything that touches a process.
//
// Of the project it imports only internal/brokerd and internal/bootlog.
package main

import (
	"flag"
	"log/slog"
	"os"

	"github.com/nexus-broker/nexus-broker/internal/bootlog"
	"github.com/nexus-broker/nexus-broker/internal/brokerd"
)

func main() {
	configPath := flag.String("config", "", "broker.yaml; default ./broker.yaml, or the development defaults when that does not exist")
	launch := flag.Bool("launch-spawnd", true, "start nexus-spawnd when none is running (development); systemd units set false")
	spawnd := flag.String("spawnd", "", "path of nexus-spawnd to launch; default: beside this executable, then PATH")
	stop := flag.Bool("stop", false, "release every lease of this config's nexus-spawnd and exit; a launched spawnd then exits on its own")
	drain := flag.Bool("drain", false, "have the broker running with this config take no new claims or offers (its leases keep working; /readyz says draining) and exit")
	undrain := flag.Bool("undrain", false, "end -drain on the broker running with this config and exit")
	flag.Parse()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	o := brokerd.Options{ConfigPath: *configPath, LaunchSpawnd: *launch, SpawndPath: *spawnd, Logger: log}
	run := brokerd.Run
	switch {
	case *stop:
		run = brokerd.Stop
	case *drain:
		run = func(o brokerd.Options) error { return brokerd.Control(o, brokerd.VerbDrain) }
	case *undrain:
		run = func(o brokerd.Options) error { return brokerd.Control(o, brokerd.VerbUndrain) }
	}
	if err := run(o); err != nil {
		// As upstream: the failure is one record of this log, then exit 1.
		bootlog.Log(log, err, brokerd.Failed)
		os.Exit(1)
	}
}
