package config

import (
	"fmt"
	"path/filepath"

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
	if err := c.validatePools(); err != nil {
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
	if err := c.validateControlSocket(); err != nil {
		return err
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

// maxSocketPath is sun_path's 108 bytes less the terminating NUL: a longer
// path binds (through a shorter one, renamed) but can never be dialled.
const maxSocketPath = 107

// validateControlSocket checks control_socket: absolute, and short enough
// for a unix socket.
func (c *Config) validateControlSocket() error {
	p := c.ControlSocket
	switch {
	case p == "":
		return nil
	case !filepath.IsAbs(p):
		return fmt.Errorf("broker config: control_socket: %q is not an absolute path; give the socket's full path in a directory the gateway's user owns, such as /run/nexus-broker-gateway/control.sock, or remove the key for control.sock in spawnd's run directory", p)
	case len(p) > maxSocketPath:
		return fmt.Errorf("broker config: control_socket: %q is %d bytes, over the unix socket limit of %d; choose a shorter path", p, len(p), maxSocketPath)
	}
	c.ControlSocket = filepath.Clean(p)
	return nil
}
