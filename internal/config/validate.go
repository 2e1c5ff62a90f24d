package config

import (
	"fmt"

	"github.com/nexus-broker/nexus-broker/internal/config/core"
)

// Unlimited is the max_concurrent and max_queue_depth that sets no bound;
// any value below it is normalized to it.
const Unlimited = core.Unlimited

// validate applies the rules of the gateway's keys, after core's, and
// normalizes what the gateway reads (unlimited caps, the default a zero
// reattach_window stands for).
func (c *Config) validate() error {
	if err := c.normalizeAgents(); err != nil {
		return err
	}
	if c.NexusBinaryPath != nil {
		c.Deprecations = append(c.Deprecations, WarnNexusBinaryPath)
	}
	if c.ReadyTimeout <= 0 {
		return fmt.Errorf("broker config: ready_timeout: must be positive (it bounds an instance's boot), got %s; raise it, or remove the key for the default %s", c.ReadyTimeout.D(), DefaultReadyTimeout)
	}
	if c.SessionReportGrace <= 0 {
		// Zero would make a new session's id unreportable to every claim.
		return fmt.Errorf("broker config: session_report_grace: must be positive (it is how long a claim waits for the instance's session id), got %s; raise it, or remove the key for the default %s", c.SessionReportGrace.D(), DefaultSessionReportGrace)
	}
	if c.MaxClientFrame < 1 || c.MaxClientFrame > MaxMaxClientFrame {
		return fmt.Errorf("broker config: max_client_frame: must be between 1 and %d (16 MiB, the WebSocket read limit) bytes, got %d; remove the key for the default %d (32 KiB, what a stock nexus instance reads)", MaxMaxClientFrame, c.MaxClientFrame, DefaultMaxClientFrame)
	}
	// "<= 0 = unlimited", as max_concurrent (core's checkLimits).
	c.MaxQueueDepth = max(c.MaxQueueDepth, Unlimited)
	if c.ReattachWindow <= 0 {
		// 0 is not "wait forever": an unbounded wait is the orphan the
		// window exists to prevent.
		c.ReattachWindow = core.Duration(DefaultReattachWindow)
	}
	if c.Auth != nil {
		if err := c.Auth.validate(); err != nil {
			return err
		}
		// A uid is keyed by principal id: two callers one id could name
		// would share one OS identity.
		if pairs := c.Auth.AmbiguousPrefixes(); c.Tenancy != nil && len(pairs) > 0 {
			return fmt.Errorf("broker config: tenancy: the validators %s and %s lack distinct principal_prefix values, so one principal id could name a caller of each, and they would share a uid; give each validator a principal_prefix no other one starts with",
				pairs[0][0], pairs[0][1])
		}
	}
	return c.validateCluster()
}
