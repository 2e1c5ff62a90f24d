// Command nexus-spawnd is the privileged half of nexus-broker: it spawns,
// signals and re-adopts instances on the gateway's behalf, serving
// pkg/spawnrpc on a unix socket in its run directory. Stopping it stops no
// instance.
//
// It may link nothing gateway-side (deps_test.go checks it).
package main

import (
	"context"
	"flag"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/bootlog"
	"github.com/nexus-broker/nexus-broker/internal/config/core"
	"github.com/nexus-broker/nexus-broker/internal/footprint"
	"github.com/nexus-broker/nexus-broker/internal/spawnd"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc"
)

func main() {
	configPath := flag.String("config", "broker.yaml", "broker.yaml; nexus-spawnd reads only its own keys")
	runDir := flag.String("run-dir", "", "directory of the socket and spawnd.json; default spawnd.run_dir, else one per config file under $XDG_RUNTIME_DIR/nexus-broker, else /tmp/nexus-broker-<uid>")
	idleExit := flag.Duration("idle-exit", 0, "exit after this long with no lease and no gateway attached (a gateway launching spawnd sets it); 0 never")
	flag.Parse()
	// When launched by a gateway, stderr is spawnd.log, never a pipe.
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	// Notified, a write to a dead pipe fails with EPIPE rather than kill
	// us; ignored, the disposition would pass to every instance.
	signal.Notify(make(chan os.Signal, 1), syscall.SIGPIPE)
	// A SIGHUP meant for the gateway (pkill -HUP -f nexus-broker matches us
	// too) must not kill spawnd, even during boot.
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	go func() {
		for range hup {
			log.Warn("SIGHUP ignored: send it to nexus-broker, which reloads both processes in one step")
		}
	}()
	if err := run(*configPath, *runDir, *idleExit, log); err != nil {
		bootlog.Log(log, err, "nexus-spawnd failed") // one record, as the gateway's
		os.Exit(1)
	}
}

func run(cfgPath, runDir string, idleExit time.Duration, log *slog.Logger) error {
	footprint.Tune(spawnd.Procs)
	given := cfgPath
	cfgPath, err := core.Canonical(cfgPath)
	if err != nil {
		return bootlog.Wrap(bootlog.LoadConfig, err, "path", given)
	}
	cfg, err := core.Load(cfgPath)
	if err != nil {
		return bootlog.Wrap(bootlog.LoadConfig, err, "path", given)
	}
	if runDir == "" {
		runDir = spawnrpc.RunDir(cfg.Spawnd.RunDir, cfgPath)
	}
	allowedUID := cfg.Spawnd.Gateway(os.Getuid())
	socketGID := -1
	if cfg.Spawnd.SocketGID != nil {
		socketGID = *cfg.Spawnd.SocketGID
	}

	// Refuse to be a second spawnd before reading any shared state.
	lock, err := spawnrpc.ClaimRunDir(runDir, socketGID)
	if err != nil {
		return err
	}
	defer lock.Close()

	d, err := spawnd.New(cfgPath, cfg, log)
	if err != nil {
		return bootlog.Config(err, given)
	}
	// Close stops watching; instances keep running, which is the point of
	// the split.
	defer d.Close()
	if err := d.TakeReleases(filepath.Join(runDir, spawnrpc.ReleasesDir), allowedUID); err != nil {
		return err
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if idleExit > 0 {
		go d.ExitWhenIdle(ctx, idleExit, stop)
	}
	return spawnrpc.Serve(ctx, spawnrpc.ServeOptions{
		RunDir:      runDir,
		AllowedUID:  allowedUID,
		SocketGID:   socketGID,
		Impl:        d,
		SpawnThread: spawnd.SetNoNewPrivs,
		Logger:      log,
		Booted:      footprint.Booted,
	})
}
