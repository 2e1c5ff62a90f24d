// Package config is broker.yaml as the gateway reads it: the keys both
// processes read (internal/config/core, embedded) and the gateway's own
// sections layered on top (the admission caps and timers, auth:, agents:,
// a2a:, console:, pools:), decoded by core's one strict loader, validated, and
// diffed on a SIGHUP reload (core.ReloadDiff).
//
// nexus-spawnd links only core: it never looks at auth:, and the gateway
// never looks at run_as or an entry's path/args/env. Resolving entries
// against the filesystem is spawnd's job (internal/spawnd).
//
// Of the project it imports only internal/config/core: none of the
// packages that read it (the lease core and its layers, internal/a2a,
// internal/cluster, internal/auth, spawnd's client; internal/gateway's
// layers_test.go checks it).
package config

import (
	"time"

	"github.com/nexus-broker/nexus-broker/internal/config/core"
)

// Config is the whole of broker.yaml after defaults are applied.
type Config struct {
	core.Config `yaml:",inline"`

	IdleTimeout           core.Duration `yaml:"idle_timeout" reload:"sighup"`
	MaxTurnDuration       core.Duration `yaml:"max_turn_duration" reload:"sighup"`
	QueueWaitTimeout      core.Duration `yaml:"queue_wait_timeout" reload:"sighup"`
	MaxQueueDepth         int           `yaml:"max_queue_depth"`
	MaxLeasesPerPrincipal int           `yaml:"max_leases_per_principal"`
	MaxQueuedPerPrincipal int           `yaml:"max_queued_per_principal"`
	ReadyTimeout          core.Duration `yaml:"ready_timeout" reload:"sighup"`
	SessionReportGrace    core.Duration `yaml:"session_report_grace" reload:"sighup"`
	ReattachWindow        core.Duration `yaml:"reattach_window"`
	// ClientReplayBufferBytes bounds each lease's replay buffer; 0 keeps
	// sequencing and retains nothing.
	ClientReplayBufferBytes core.Size `yaml:"client_replay_buffer_bytes"`
	// MaxClientFrame bounds one client → instance frame as written to the
	// instance (ours): a stock instance reads at most 32 KiB and drops its
	// socket on a larger frame, losing it silently.
	MaxClientFrame core.Size `yaml:"max_client_frame" reload:"sighup"`
	// ControlSocket (ours) is where the gateway takes nexus-broker -drain
	// and -undrain: an absolute path in a directory the gateway's user
	// owns; empty means control.sock in spawnd's run directory, which only
	// a gateway of spawnd's own uid can write (boot-only).
	ControlSocket string `yaml:"control_socket"`

	// Auth is the auth: block; nil means authentication is disabled.
	Auth *Auth `yaml:"auth"`

	// Console configures GET /console (ours, not upstream's).
	Console Console `yaml:"console" reload:"sighup"`
	// Agents are the A2A profiles, keyed by trimmed name; nil without any.
	// They reload only on a broker that booted with the ingress on; the
	// gateway reports them as boot-only otherwise.
	Agents map[string]*Agent `yaml:"agents" reload:"sighup"`
	// Pools are the pools: of warm instances (ours); nil without any.
	// AllPools adds those of the profiles with warm:.
	Pools []Pool `yaml:"pools" reload:"sighup"`
	// A2A is the task store's policy (boot-only).
	A2A A2A `yaml:"a2a"`
	// Cluster is the cluster: block (ours, boot-only); nil means
	// single-broker mode.
	Cluster *Cluster `yaml:"cluster"`

	// Warnings are the boot WARNs validation found (not errors).
	Warnings []string `yaml:"-"`
	// Deprecations are WARNs about deprecated keys the file still uses,
	// said at boot and again by every reload of such a file.
	Deprecations []string `yaml:"-"`
}

// WarnNexusBinaryPath is upstream's WARN for the deprecated alias.
const WarnNexusBinaryPath = `nexus_binary_path is deprecated: declare it as binaries.nexus.path instead. Its value was folded into the "nexus" registry entry for this boot.`

// Console configures the operator page. With an auth: block the page needs
// auth.admin_scope and these keys change nothing.
type Console struct {
	// AllowRemote serves the page without an auth: block to callers that
	// are not on loopback. Off by default: without auth the page shows and
	// releases every lease.
	AllowRemote bool `yaml:"allow_remote"`
}

// Defaults of the spec for the gateway's keys.
const (
	DefaultMaxConcurrent           = core.DefaultMaxConcurrent
	DefaultIdleTimeout             = 5 * time.Minute
	DefaultMaxTurnDuration         = 30 * time.Minute
	DefaultQueueWaitTimeout        = 30 * time.Second
	DefaultMaxQueueDepth           = 64
	DefaultReadyTimeout            = 30 * time.Second
	DefaultSessionReportGrace      = 5 * time.Second
	DefaultMaxClaimBody            = core.DefaultMaxClaimBody
	DefaultReattachWindow          = 60 * time.Second
	DefaultClientReplayBufferBytes = 1 << 20
	DefaultMaxClientFrame          = 32 << 10
	// MaxMaxClientFrame is the largest max_client_frame: the gateway's
	// WebSocket read limit.
	MaxMaxClientFrame = 16 << 20
)

// Default returns a Config holding every default, with the synthesized
// reserved entry.
func Default() *Config {
	return &Config{
		Config:                  *core.Default(),
		IdleTimeout:             core.Duration(DefaultIdleTimeout),
		MaxTurnDuration:         core.Duration(DefaultMaxTurnDuration),
		QueueWaitTimeout:        core.Duration(DefaultQueueWaitTimeout),
		MaxQueueDepth:           DefaultMaxQueueDepth,
		ReadyTimeout:            core.Duration(DefaultReadyTimeout),
		SessionReportGrace:      core.Duration(DefaultSessionReportGrace),
		ReattachWindow:          core.Duration(DefaultReattachWindow),
		ClientReplayBufferBytes: DefaultClientReplayBufferBytes,
		MaxClientFrame:          DefaultMaxClientFrame,
		A2A:                     defaultA2A(),
	}
}

// Load reads and validates the file at path, then reads the engine config
// of every pool (readPools), which Parse leaves unread.
func Load(path string) (*Config, error) {
	c, err := core.LoadWith(path, Parse)
	if err != nil {
		return nil, err
	}
	if err := c.readPools(); err != nil {
		return nil, err
	}
	return c, nil
}

// Parse decodes and validates broker.yaml text, every key of it. Every
// error starts with "broker config: " and names the key path it is about.
func Parse(data []byte) (*Config, error) {
	c := Default()
	c.Binaries = nil // decoded from the file; Validate synthesizes the reserved entry
	if err := core.Decode(data, c, nil); err != nil {
		return nil, err
	}
	// Before core's Validate, which trims advertise_addr for spawnd.
	if err := c.validateAdvertise(); err != nil {
		return nil, err
	}
	if err := c.Config.Validate(); err != nil {
		return nil, err
	}
	if err := c.validate(); err != nil {
		return nil, err
	}
	return c, nil
}
