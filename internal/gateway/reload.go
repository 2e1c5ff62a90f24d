package gateway

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/config"
	"github.com/nexus-broker/nexus-broker/internal/config/core"
	"github.com/nexus-broker/nexus-broker/internal/gateway/spawner"
)

// reloadTimeout bounds the wait for spawnd's verdict on a reload.
const reloadTimeout = 30 * time.Second

// Reload is SIGHUP: validate the file, have spawnd validate and swap its own
// keys, then swap the gateway's. A rejection at any step leaves everything
// in force. No live instance is signalled, but every live lease's idle and
// turn deadlines move to the new values at once. ctx ends the wait for
// spawnd's answer, so a SIGTERM is not held behind a hung spawnd.
func (g *Gateway) Reload(ctx context.Context, path string) error {
	g.log.Info("SIGHUP received, reloading config", "path", path)
	next, err := config.Load(path)
	if err != nil {
		return g.reloadRejected(path, err)
	}
	cur := g.cfg.Load()
	// No A2A routes were registered at boot without agents:, so a reload
	// cannot switch the ingress on: reported and ignored like a boot-only key.
	switchOn := len(g.boot.Agents) == 0 && len(next.Agents) > 0
	if switchOn {
		next.Agents = nil
	}
	reloadable, bootOnly := core.ReloadDiff(cur, next)
	// a2a: is named by the part that changed, as the spec names a2a.tasks.
	if i := slices.Index(bootOnly, "a2a"); i >= 0 {
		var parts []string
		if cur.A2A.Tasks != next.A2A.Tasks {
			parts = append(parts, "a2a.tasks")
		}
		if cur.A2A.StateDir != next.A2A.StateDir {
			parts = append(parts, "a2a.state_dir")
		}
		bootOnly = slices.Replace(bootOnly, i, i+1, parts...)
	}
	if switchOn {
		bootOnly = append(bootOnly, "agents")
	}
	applies := make([]func(), 0, len(g.layers))
	for _, l := range g.layers {
		apply, err := l.Reload(next)
		if err != nil {
			return g.reloadRejected(path, err)
		}
		applies = append(applies, apply)
	}
	ctx, cancel := context.WithTimeout(ctx, reloadTimeout)
	defer cancel()
	// spawnd re-reads the file itself, and applies it only if it is still
	// the version validated here.
	res, err := g.sp.Reload(ctx, next.Digest)
	if err != nil {
		return g.reloadRejected(path, fmt.Errorf("nexus-spawnd did not answer the reload: %s", spawner.MessageOf(err)))
	}
	if !res.Applied {
		return g.reloadRejected(path, errors.New(res.Error))
	}
	applied := core.Reloaded(g.boot, next) // boot-only keys keep the values in force
	g.cfg.Store(applied)
	g.setBinaries(res.Binaries)
	for _, apply := range applies {
		apply()
	}
	g.cap.SetMax(applied.MaxConcurrent)
	g.cap.SetWait(applied.QueueWaitTimeout.D())
	g.pools.m.Set(g.pools.specs(applied))
	g.pools.m.SlotFreed() // a raised max_concurrent may have freed some
	for _, l := range g.liveLeases() {
		l.rearm()
	}
	g.m.ConfigReloads.Inc("applied")
	for _, w := range next.Deprecations {
		g.log.Warn(w, "path", path)
	}
	// Said only of a reload that applied: a rejected one changed nothing.
	if len(bootOnly) > 0 {
		g.log.Warn("config reload: these keys changed in the file but are only read at boot, so the values in force are unchanged; restart the broker to apply them",
			"path", path, "keys", strings.Join(bootOnly, ","))
	}
	if len(reloadable) == 0 {
		g.log.Info("config reload applied; no reloadable key changed", "path", path)
		return nil
	}
	g.log.Info("config reload applied", "path", path, "changed", strings.Join(reloadable, ","),
		"binaries", len(res.Binaries), "agents", len(applied.Agents),
		"max_concurrent", applied.MaxConcurrent, "idle_timeout", applied.IdleTimeout.D(),
		"queue_wait_timeout", applied.QueueWaitTimeout.D(), "release_grace", applied.ReleaseGrace.D(),
		"ready_timeout", applied.ReadyTimeout.D())
	return nil
}

func (g *Gateway) reloadRejected(path string, err error) error {
	g.m.ConfigReloads.Inc("rejected")
	g.log.Error("config reload rejected; the configuration already in force is unchanged", "path", path, "error", err.Error())
	return err
}
