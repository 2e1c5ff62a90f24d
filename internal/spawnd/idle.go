package spawnd

import (
	"context"
	"time"
)

// idleChecks is how many times per idle period ExitWhenIdle looks: the exit
// comes between one and 1+1/idleChecks periods after the daemon went idle.
const idleChecks = 10

// ExitWhenIdle calls stop once the daemon has held no lease and had no
// gateway attached (no Watch stream open: every gateway keeps one while it
// is attached) for a whole period of after. A spawnd a gateway launched for
// development uses it, so it does not outlive its use; one the operator
// runs (systemd) never does.
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
