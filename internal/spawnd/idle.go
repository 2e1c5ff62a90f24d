package spawnd

import (
	"context"
	"time"
)

// idleChecks is how often per idle period ExitWhenIdle looks.
const idleChecks = 10

// ExitWhenIdle calls stop once the daemon has held no lease and had no
// gateway attached (an attached gateway keeps a Watch stream) for after: a
// spawnd a gateway launched must not outlive its use.
func (d *Daemon) ExitWhenIdle(ctx context.Context, after time.Duration, stop func()) {
	tick := time.NewTicker(after / idleChecks)
	defer tick.Stop()
	var since time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-tick.C:
			switch {
			case !d.idle():
				since = time.Time{}
			case since.IsZero():
				since = now
			case now.Sub(since) >= after:
				d.log.Info("no lease and no gateway attached: exiting, as a launched nexus-spawnd does", "idle_exit", after.String())
				stop()
				return
			}
		}
	}
}

// idle reports whether the daemon holds no lease and no gateway watches it.
func (d *Daemon) idle() bool {
	d.mu.Lock()
	n := len(d.leases)
	d.mu.Unlock()
	return n == 0 && d.watchers.count() == 0
}
