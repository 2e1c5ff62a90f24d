package brokerd

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/bootlog"
	gwspawner "github.com/nexus-broker/nexus-broker/internal/gateway/spawner"
	"github.com/nexus-broker/nexus-broker/internal/spawnclient"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc"
)

// stopTimeout bounds -stop: every teardown runs in parallel inside spawnd,
// each bounded by release_grace and its SIGKILL.
const stopTimeout = 2 * time.Minute

// stopReason is journaled for every lease -stop ends: the operator released
// them all.
const stopReason = "manual release"

// Stop is nexus-broker -stop: attach to the config's spawnd (never launching
// one, nor reloading it onto an edited file), release every lease it holds
// through spawnd's ordinary teardown, and return once all are gone. A
// running gateway sees the exits as any other; a launched spawnd then exits
// on its own once idle. With no spawnd running there is nothing to do.
func Stop(o Options) error {
	path, _, cfg, err := loadConfig(o)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), stopTimeout)
	defer cancel()
	runDir := spawnrpc.RunDir(cfg.Spawnd.RunDir, path)
	client, err := spawnclient.Dial(ctx, spawnclient.DialOptions{RunDir: runDir, ConfigPath: path, ConfigDigest: cfg.Digest, NoReload: true, Logger: o.Logger})
	if errors.Is(err, spawnclient.ErrNotRunning) {
		// make stop twice, or after the launched spawnd's idle exit.
		fmt.Fprintf(os.Stdout, "nothing to stop: no nexus-spawnd is running for %s (run directory %s)\n", path, runDir)
		return nil
	}
	if err != nil {
		return bootlog.Wrap(AttachSpawnd, err)
	}
	defer client.Close()
	list, err := client.List(ctx)
	if err != nil {
		return fmt.Errorf("listing nexus-spawnd's leases: %w", err)
	}
	var wg sync.WaitGroup
	errs := make([]error, len(list))
	for i, l := range list {
		wg.Go(func() {
			// No socket to ask the instance over from here: its grace
			// starts at SIGTERM, which nexus answers with a clean exit.
			errs[i] = client.Terminate(ctx, gwspawner.Termination{LeaseID: l.LeaseID, Reason: stopReason, SkipGrace: true})
		})
	}
	wg.Wait()
	failed := 0
	for i, err := range errs {
		if err != nil {
			failed++
			o.Logger.Error("releasing lease failed", "lease_id", list[i].LeaseID, "error", err)
		}
	}
	fmt.Fprintf(os.Stdout, "released %d of %d leases of nexus-spawnd pid %d (%s)\n", len(errs)-failed, len(errs), client.Endpoint().Pid, path)
	if failed > 0 {
		return fmt.Errorf("%d leases could not be released; see the errors above", failed)
	}
	return nil
}
