// Package brokerd runs the gateway process: load broker.yaml (or the
// development defaults), attach to nexus-spawnd (launching it in
// development), listen, serve, and handle SIGHUP / SIGTERM. cmd/nexus-broker
// only parses flags and calls Run.
//
// It is the composition: it may import every layer, and nothing imports
// it but cmd/nexus-broker (internal/gateway/layers_test.go checks it).
package brokerd

import (
	"context"
	_ "embed"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/a2a/ingress"
	"github.com/nexus-broker/nexus-broker/internal/atomicfile"
	"github.com/nexus-broker/nexus-broker/internal/auth"
	"github.com/nexus-broker/nexus-broker/internal/bootlog"
	"github.com/nexus-broker/nexus-broker/internal/cluster/router"
	"github.com/nexus-broker/nexus-broker/internal/config"
	"github.com/nexus-broker/nexus-broker/internal/config/core"
	"github.com/nexus-broker/nexus-broker/internal/console"
	"github.com/nexus-broker/nexus-broker/internal/footprint"
	"github.com/nexus-broker/nexus-broker/internal/gateway"
	"github.com/nexus-broker/nexus-broker/internal/httpapi"
	"github.com/nexus-broker/nexus-broker/internal/safedir"
	"github.com/nexus-broker/nexus-broker/internal/spawnclient"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc"
)

// Options are cmd/nexus-broker's flags.
type Options struct {
	// ConfigPath is broker.yaml. Empty means ./broker.yaml when it exists,
	// else the development defaults.
	ConfigPath string
	// LaunchSpawnd starts nexus-spawnd when none is running (development).
	// Production units run spawnd themselves and turn this off.
	LaunchSpawnd bool
	// SpawndPath overrides where nexus-spawnd is looked for.
	SpawndPath string
	Logger     *slog.Logger
}

// Records of a failed start or stop with no upstream counterpart, beside
// bootlog's.
const (
	AttachSpawnd     = "failed to attach to nexus-spawnd"
	GracefulShutdown = "graceful shutdown failed" // upstream's
	// Failed is the record of any other error of Run or Stop.
	Failed = "nexus-broker failed"
)

// shutdownGrace bounds how long open HTTP requests may finish after
// SIGTERM (upstream's 10 s); WebSockets are closed by the gateway first.
const shutdownGrace = 10 * time.Second

//go:embed dev.yaml
var devYAML string

// Run serves until SIGTERM/SIGINT. Instances keep running when it returns.
func Run(o Options) error {
	footprint.Tune(procsFor)
	log := o.Logger
	// Before anything can announce this process: a SIGHUP's default action
	// is to terminate it.
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	path, dev, cfg, err := loadConfig(o)
	if err != nil {
		return err
	}
	// Part of loading the file, as upstream's chain is: nothing is said of
	// a configuration that does not load.
	authn, err := auth.New(cfg.Auth, log)
	if err != nil {
		return bootlog.Wrap(bootlog.LoadConfig, err, "path", givenPath(o, path))
	}
	defer authn.Close()
	for _, w := range cfg.Warnings {
		// Each with upstream's attributes.
		if w == config.WarnTLSScheme {
			log.Warn(w, "advertise_addr", cfg.AdvertiseAddr, "listen_addr", cfg.ListenAddr)
		} else {
			log.Warn(w, "listen_addr", cfg.ListenAddr)
		}
	}
	for _, w := range cfg.Deprecations {
		log.Warn(w, "path", path)
	}
	logStarting(cfg, log)
	logAuth(cfg, log)

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	// spawnd's verdict on the registry comes before the port opens: a
	// config it refuses never has the gateway answer a single request.
	client, err := spawnclient.Dial(ctx, spawnclient.DialOptions{
		RunDir: spawnrpc.RunDir(cfg.Spawnd.RunDir, path), ConfigPath: path, ConfigDigest: cfg.Digest, Launch: o.LaunchSpawnd, SpawndPath: o.SpawndPath, Logger: log,
	})
	if err != nil {
		return bootlog.Wrap(AttachSpawnd, err)
	}
	defer client.Close()

	ln, err := net.Listen("tcp", cfg.ListenAddr)
	if err != nil {
		return bootlog.Wrap(bootlog.HTTPGateway, fmt.Errorf("listen_addr %q: %w", cfg.ListenAddr, err))
	}
	defer ln.Close()

	g := gateway.New(gateway.Options{Config: cfg, Spawner: client, Ready: client.Ready, Journal: client.Journal, Logger: log, ListenPort: ln.Addr().(*net.TCPAddr).Port, Auth: authn})
	console.Attach(g)
	ingress.Attach(g, cfg, log)
	if cfg.Cluster != nil {
		g.JoinCluster(func(brokerID string) (gateway.Router, error) { return router.New(g, cfg, brokerID, log) })
	}
	if err := g.Start(ctx); err != nil {
		return bootlog.Config(err, path)
	}
	// The default place is not fatal: a run directory of spawnd's user
	// that this one cannot write (spawnd.run_dir of a split-uid install)
	// leaves the broker serving, without -drain. A control_socket the
	// operator chose is.
	if ctl, err := serveControl(controlPath(cfg, path), g.SetDraining, log); err == nil {
		defer ctl.Close()
	} else if cfg.ControlSocket != "" {
		g.Shutdown()
		return bootlog.Config(fmt.Errorf("broker config: %w", err), path)
	} else {
		log.Warn("control socket unavailable: nexus-broker -drain and -undrain cannot reach this broker; set control_socket to a path in a directory this user owns", "error", err)
	}
	h := httpapi.Handler(g, log)
	srv := httpapi.Server(h)
	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve(gateway.Listener(ln)) }()
	if cfg.Auth != nil && cfg.Auth.ProxyListen != "" {
		psrv, err := serveProxy(cfg.Auth, h, log, serveErr)
		if err != nil {
			g.Shutdown()
			return bootlog.Config(err, path)
		}
		defer psrv.Close()
		defer os.Remove(cfg.Auth.ProxyListen)
	}
	base := "http://" + ln.Addr().String()
	log.Info("http gateway listening", "addr", ln.Addr().String()) // upstream's line
	log.Info("nexus-broker listening", append([]any{"addr", ln.Addr().String(), "config", path}, bootSummary(ctx, cfg, path, client)...)...)
	footprint.Booted()
	if dev {
		go showDevClaim(ctx, base, log)
	}

	for {
		select {
		case <-hup:
			_ = g.Reload(ctx, path) // logged either way; the config in force stays on failure
		case err := <-serveErr:
			g.Shutdown()
			return bootlog.Wrap(bootlog.HTTPGateway, err)
		case <-ctx.Done():
			// Upstream's lines; ours adds that the instances stay.
			log.Info("shutdown signal received, draining", "instances", "keep running for the next gateway to reattach", "release_them_with", releaseHint(dev, path))
			g.Shutdown()
			sctx, cancel := context.WithTimeout(context.Background(), shutdownGrace)
			defer cancel()
			if err := srv.Shutdown(sctx); err != nil {
				return bootlog.Wrap(GracefulShutdown, err)
			}
			log.Info("nexus-broker stopped")
			return nil
		}
	}
}

// releaseHint is how to release what Ctrl-C leaves running: make stop on
// make run's development defaults, else -stop with the file.
func releaseHint(dev bool, path string) string {
	if dev {
		return "make stop (bin/nexus-broker -stop)"
	}
	return "nexus-broker -stop -config " + path
}

// bootSummary is what is in force, for the one boot line that says so: the
// entries as spawnd resolved them (the gateway reads no path from the
// file), the timeouts, and where state and the socket live.
func bootSummary(ctx context.Context, cfg *config.Config, path string, client *spawnclient.Client) []any {
	entries := "(spawnd did not answer)"
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if st, err := client.Status(ctx); err == nil {
		var es []string
		for _, b := range st.Binaries {
			es = append(es, b.Name+"="+b.ResolvedPath)
		}
		entries = strings.Join(es, ",")
	}
	return []any{"advertise_addr", cfg.AdvertiseAddr, "entries", entries,
		"idle_timeout", cfg.IdleTimeout.D().String(), "max_turn_duration", cfg.MaxTurnDuration.D().String(),
		"ready_timeout", cfg.ReadyTimeout.D().String(), "queue_wait_timeout", cfg.QueueWaitTimeout.D().String(),
		"release_grace", cfg.ReleaseGrace.D().String(), "reattach_window", cfg.ReattachWindow.D().String(),
		"max_concurrent", cfg.MaxConcurrent, "state_dir", cfg.StateDir, "run_dir", spawnrpc.RunDir(cfg.Spawnd.RunDir, path), "spawnd_pid", client.Endpoint().Pid}
}

// loadConfig resolves, canonicalises and loads the config file of o. Its
// errors carry upstream's "failed to load config" record, naming the path
// as given (else the one chosen).
func loadConfig(o Options) (path string, dev bool, cfg *config.Config, err error) {
	defer func() { err = bootlog.Wrap(bootlog.LoadConfig, err, "path", givenPath(o, path)) }()
	if path, dev, err = resolveConfig(o.ConfigPath, o.Logger); err != nil {
		return "", false, nil, err
	}
	canon, err := core.Canonical(path)
	if err != nil {
		return path, false, nil, err
	}
	path = canon
	cfg, err = config.Load(path)
	return path, dev, cfg, err
}

// givenPath is the config path as the command line gave it (upstream's
// record names it so), else the one chosen.
func givenPath(o Options, chosen string) string {
	if o.ConfigPath != "" {
		return o.ConfigPath
	}
	return chosen
}

// resolveConfig picks the config file. With no -config and no ./broker.yaml
// it writes the development defaults (nexus-echo beside this executable as
// the nexus entry, loopback only) to a private file both processes read.
func resolveConfig(path string, log *slog.Logger) (string, bool, error) {
	if path != "" {
		return path, false, nil
	}
	if _, err := os.Stat("broker.yaml"); err == nil {
		return "broker.yaml", false, nil
	}
	exe, err := os.Executable()
	if err != nil {
		return "", false, err
	}
	echo := filepath.Join(filepath.Dir(exe), "nexus-echo")
	if _, err := os.Stat(echo); err != nil {
		return "", false, fmt.Errorf("no -config given, no ./broker.yaml, and no nexus-echo beside %s for the development defaults: run `make build` or pass -config", exe)
	}
	// Private, and verified if it was there: in /tmp anyone could have
	// created it first and swapped the config spawnd reads.
	dir := devDir()
	// Its parent's owner could rename it away and put its own in its
	// place, whatever its mode says: an $XDG_RUNTIME_DIR of another uid's
	// (a root make run under sudo -E) is refused as a planted one is.
	if err := safedir.ParentOwned(filepath.Dir(dir)); err != nil && os.Getenv("XDG_RUNTIME_DIR") != "" {
		return "", false, fmt.Errorf("development defaults directory: $XDG_RUNTIME_DIR: %w", err)
	}
	if err := safedir.Ensure(dir, 0o700); err != nil {
		return "", false, fmt.Errorf("development defaults directory: %w", err)
	}
	p := filepath.Join(dir, "broker.yaml")
	text := strings.NewReplacer("{{ECHO}}", echo, "{{RUN_DIR}}", filepath.Join(dir, "run"), "{{STATE_DIR}}", filepath.Join(dir, "state")).Replace(devYAML)
	// Replaced by rename: whatever is at p, a planted symlink included, is
	// never opened or followed.
	if err := atomicfile.Write(p, []byte(text), nil); err != nil {
		return "", false, err
	}
	log.Info("no -config and no ./broker.yaml: using the development defaults (nexus-echo as the nexus entry)", "config", p)
	return p, true, nil
}

// devDir holds the development defaults: $XDG_RUNTIME_DIR/nexus-broker-dev,
// else /tmp/nexus-broker-dev-<uid> (not $TMPDIR: spawnd's socket goes in
// it, and must stay within the unix socket path limit).
func devDir() string {
	if x := os.Getenv("XDG_RUNTIME_DIR"); x != "" {
		return filepath.Join(x, "nexus-broker-dev")
	}
	return fmt.Sprintf("/tmp/nexus-broker-dev-%d", os.Getuid())
}

// logStarting is upstream's first line after the config loads, with its
// keys; "nexus-broker listening" adds what the split knows later.
func logStarting(cfg *config.Config, log *slog.Logger) {
	scope := ""
	if cfg.Auth != nil {
		scope = *cfg.Auth.AdminScope
	}
	log.Info("nexus-broker starting", "listen_addr", cfg.ListenAddr, "advertise_addr", cfg.AdvertiseAddr,
		"binaries", len(cfg.Binaries), "state_dir", cfg.StateDir, "max_concurrent", cfg.MaxConcurrent,
		"idle_timeout", cfg.IdleTimeout.D(), "max_turn_duration", cfg.MaxTurnDuration.D(), "queue_wait_timeout", cfg.QueueWaitTimeout.D(),
		"release_grace", cfg.ReleaseGrace.D(), "ready_timeout", cfg.ReadyTimeout.D(), "reattach_window", cfg.ReattachWindow.D(), "admin_scope", scope)
}

// WarnAmbiguousPrefixes is the boot WARN for two validators whose principal
// ids can be equal (config.Auth.AmbiguousPrefixes).
const WarnAmbiguousPrefixes = "two validators lack distinct principal_prefix values, so one id from each can name the same principal (and own its leases); give each a principal_prefix that no other one starts with"

// logAuth says at boot whether clients are authenticated: the spec's WARN
// when they are not, and a plainer second one when the port is reachable
// from beyond this host.
func logAuth(cfg *config.Config, log *slog.Logger) {
	if cfg.Auth != nil {
		log.Info("client authentication enabled", "validators", cfg.Auth.ValidatorNames(), "admin_scope", *cfg.Auth.AdminScope)
		for _, pair := range cfg.Auth.AmbiguousPrefixes() {
			log.Warn(WarnAmbiguousPrefixes, "validators", pair[0]+","+pair[1])
		}
		return
	}
	log.Warn("client authentication is DISABLED: broker config has no auth block, so any caller that can reach this broker can claim, release and list leases")
	if !cfg.ListenLoopback() {
		log.Warn("listen_addr is not loopback-only and no auth block is configured: anyone who can reach this port controls every lease (claim, connect, release, read session ids); add an auth: block or bind listen_addr to 127.0.0.1",
			"listen_addr", cfg.ListenAddr)
	}
}
