package spawnd

import (
	"google.golang.org/grpc/codes"
)

// spawnd bounds its own work, whatever the gateway asks: a compromised
// gateway may spawn at most spawnd.max_leases instances (those being torn
// down do not count) holding at most spawnd.max_config_bytes of temp
// configs (core.Config.Leases, ConfigBytes).

// capacityRefusal refuses a Spawn of a config of n bytes past either bound,
// or returns nil. The caller holds d.mu.
func (d *Daemon) capacityRefusal(n int) error {
	cfg := d.settings.cfg
	live, held := 0, int64(0)
	for _, l := range d.leases {
		if l.state != stateTerminating {
			live++
		}
		held += l.configBytes
	}
	if max := cfg.Leases(); live >= max {
		return refusal(codes.ResourceExhausted, "Spawn: nexus-spawnd holds %d leases, spawnd.max_leases; refused until one ends", live)
	}
	if max := cfg.ConfigBytes(); held+int64(n) > max {
		return refusal(codes.ResourceExhausted, "Spawn: a config of %d bytes would take the live temp configs past spawnd.max_config_bytes (%d bytes, %d held); refused until a lease ends", n, max, held)
	}
	return nil
}
