// Package config is broker.yaml: its schema, the spec's defaults, strict
// decoding that names the key path of every mistake, validation, and the
// diff a SIGHUP reload reports (ReloadDiff).
//
// One file serves both processes, and each reads only its own keys: spawnd
// never looks at auth:, the gateway never looks at run_as or an entry's
// path/args/env. Resolving entries against the filesystem is spawnd's job
// (internal/spawnd), not this package's.
package config

import (
	"fmt"
	"time"
)

// Config is the whole of broker.yaml after defaults are applied.
type Config struct {
	ListenAddr string `yaml:"listen_addr"`
	// AdvertiseAddr is empty, host:port, or ws|wss|http|https://host[:port];
	// after Load it carries no surrounding whitespace and no trailing /.
	AdvertiseAddr string `yaml:"advertise_addr"`
	// Binaries is the registry, keyed by trimmed entry name. After Load it
	// always holds the reserved "nexus" entry.
	Binaries map[string]*Entry `yaml:"binaries"`
	// NexusBinaryPath is the deprecated alias for binaries.nexus.path.
	NexusBinaryPath *string `yaml:"nexus_binary_path"`

	MaxConcurrent         int      `yaml:"max_concurrent"`
	IdleTimeout           Duration `yaml:"idle_timeout"`
	MaxTurnDuration       Duration `yaml:"max_turn_duration"`
	QueueWaitTimeout      Duration `yaml:"queue_wait_timeout"`
	MaxQueueDepth         int      `yaml:"max_queue_depth"`
	MaxLeasesPerPrincipal int      `yaml:"max_leases_per_principal"`
	MaxQueuedPerPrincipal int      `yaml:"max_queued_per_principal"`
	ReleaseGrace          Duration `yaml:"release_grace"`
	ReadyTimeout          Duration `yaml:"ready_timeout"`
	SessionReportGrace    Duration `yaml:"session_report_grace"`
	MaxClaimBody          Size     `yaml:"max_claim_body"`
	StateDir              string   `yaml:"state_dir"`
	BrokerID              string   `yaml:"broker_id"`
	ReattachWindow        Duration `yaml:"reattach_window"`
	// ClientReplayBufferBytes bounds each lease's replay buffer; 0 keeps
	// sequencing and retains nothing.
	ClientReplayBufferBytes Size `yaml:"client_replay_buffer_bytes"`

	// InheritEnv names broker environment variables a spawn may carry.
	InheritEnv []string `yaml:"inherit_env"`
	// RunAs is the default credential for entries that declare none.
	RunAs *RunAs `yaml:"run_as"`

	// Auth is the auth: block; nil means authentication is disabled.
	Auth *Auth `yaml:"auth"`

	// Spawnd holds the keys of the supervisor split (ours, not upstream's).
	Spawnd Spawnd `yaml:"spawnd"`

	// Console configures GET /console (ours, not upstream's).
	Console Console `yaml:"console"`
	// Agents are the A2A profiles, keyed by trimmed name; nil without any.
	Agents map[string]*Agent `yaml:"agents"`
	// A2A is the task store's policy (boot-only).
	A2A A2A `yaml:"a2a"`

	// Warnings are the boot WARNs validation found (not errors).
	Warnings []string `yaml:"-"`
	// Digest identifies the file's content (hex SHA-256), set by Load: the
	// gateway and spawnd compare it to know they run one version.
	Digest string `yaml:"-"`
}

// Entry is one binaries: registry entry.
type Entry struct {
	Path string `yaml:"path"`
	// Label and Description are nil when not written: GET /binaries omits
	// an unset one and keeps one written as "".
	Label       *string           `yaml:"label"`
	Description *string           `yaml:"description"`
	Args        []string          `yaml:"args"`
	Env         map[string]string `yaml:"env"`
	RunAs       *RunAs            `yaml:"run_as"`
	// AllowPrivilegeEscalation (ours) starts the entry's instances without
	// no_new_privs, so a setuid or file-capability binary they exec gains
	// its privilege. Off by default.
	AllowPrivilegeEscalation bool `yaml:"allow_privilege_escalation"`
	// MemoryMax, PidsMax and CPUWeight (ours) are written to each
	// instance's cgroup (memory.max, pids.max, cpu.weight); 0 leaves the
	// limit unset. They need cgroup v2 containment with the controller.
	MemoryMax Size `yaml:"memory_max"`
	PidsMax   int  `yaml:"pids_max"`
	CPUWeight int  `yaml:"cpu_weight"`
}

// RunAs is a numeric credential; both ids are required when the block is
// written.
type RunAs struct {
	UID *int `yaml:"uid"`
	GID *int `yaml:"gid"`
}

// String renders "uid:gid".
func (r *RunAs) String() string { return fmt.Sprintf("%d:%d", *r.UID, *r.GID) }

// Spawnd configures the privileged daemon and how the gateway reaches it.
type Spawnd struct {
	// RunDir holds the RPC socket and spawnd.json (the reattach config). It
	// is created 0750. Empty means one directory per config file under
	// $XDG_RUNTIME_DIR/nexus-broker, or /tmp/nexus-broker-<uid> without
	// XDG_RUNTIME_DIR (spawnrpc.DefaultRunDir).
	RunDir string `yaml:"run_dir"`
	// GatewayUID is the only uid spawnd accepts RPC connections from. Unset
	// means spawnd's own uid (development: one user runs both).
	GatewayUID *int `yaml:"gateway_uid"`
	// SocketGID is the group given the run directory so the gateway's user
	// can reach the socket. Unset leaves spawnd's group.
	SocketGID *int `yaml:"socket_gid"`
	// CgroupRoot is a writable, delegated cgroup v2 directory: each
	// instance is born in <cgroup_root>/<broker_id>/<lease_id>. Empty means
	// spawnd's own cgroup when systemd delegated it (Delegate=yes), else
	// none (process groups only).
	CgroupRoot string `yaml:"cgroup_root"`
}

// Console configures the operator page. With an auth: block the page needs
// auth.admin_scope and these keys change nothing.
type Console struct {
	// AllowRemote serves the page without an auth: block to callers that
	// are not on loopback. Off by default: without auth the page shows and
	// releases every lease.
	AllowRemote bool `yaml:"allow_remote"`
}

// MaxCPUWeight is the largest cpu.weight the kernel accepts.
const MaxCPUWeight = 10000

// Gateway is the uid spawnd accepts RPC from: gateway_uid, else own (the
// uid spawnd runs as: one user runs both processes).
func (s Spawnd) Gateway(own int) int {
	if s.GatewayUID != nil {
		return *s.GatewayUID
	}
	return own
}

// The reserved entry name: always present, what a claim naming no binary
// spawns.
const ReservedEntry = "nexus"

// Defaults of the spec.
const (
	DefaultListenAddr              = ":8080"
	DefaultMaxConcurrent           = 8
	DefaultIdleTimeout             = 5 * time.Minute
	DefaultMaxTurnDuration         = 30 * time.Minute
	DefaultQueueWaitTimeout        = 30 * time.Second
	DefaultMaxQueueDepth           = 64
	DefaultReleaseGrace            = 10 * time.Second
	DefaultReadyTimeout            = 30 * time.Second
	DefaultSessionReportGrace      = 5 * time.Second
	DefaultMaxClaimBody            = 1 << 20
	DefaultReattachWindow          = 60 * time.Second
	DefaultClientReplayBufferBytes = 1 << 20
)

// Default returns a Config holding every default, with the synthesized
// reserved entry.
func Default() *Config {
	c := &Config{
		ListenAddr:              DefaultListenAddr,
		MaxConcurrent:           DefaultMaxConcurrent,
		IdleTimeout:             Duration(DefaultIdleTimeout),
		MaxTurnDuration:         Duration(DefaultMaxTurnDuration),
		QueueWaitTimeout:        Duration(DefaultQueueWaitTimeout),
		MaxQueueDepth:           DefaultMaxQueueDepth,
		ReleaseGrace:            Duration(DefaultReleaseGrace),
		ReadyTimeout:            Duration(DefaultReadyTimeout),
		SessionReportGrace:      Duration(DefaultSessionReportGrace),
		MaxClaimBody:            DefaultMaxClaimBody,
		ReattachWindow:          Duration(DefaultReattachWindow),
		ClientReplayBufferBytes: DefaultClientReplayBufferBytes,
		A2A:                     defaultA2A(),
	}
	c.Binaries = map[string]*Entry{ReservedEntry: {Path: ReservedEntry}}
	return c
}

// EntryRunAs is the credential entry name spawns under: the entry's own
// run_as, else the broker-level default, else nil (spawnd's own).
func (c *Config) EntryRunAs(name string) *RunAs {
	if e := c.Binaries[name]; e != nil && e.RunAs != nil {
		return e.RunAs
	}
	return c.RunAs
}
