// Package core is the part of broker.yaml both processes read: the keys
// nexus-spawnd acts on, and the one strict loader every key goes through
// (Decode), which names the key path of every mistake and unknown key in one
// error. The gateway's sections are layered on top by internal/config, which
// spawnd does not link; spawnd tolerates them unread (GatewayKeys). Both
// digest the same bytes, so they agree on the file's identity.
//
// Both nexus-broker and nexus-spawnd link it, so it may import none of
// the gateway's layers nor anything else gateway-side
// (internal/gateway/layers_test.go and cmd/nexus-spawnd's deps test check
// it).
package core

import (
	"fmt"
	"time"
)

// Config is the keys of broker.yaml spawnd reads, after defaults.
type Config struct {
	ListenAddr string `yaml:"listen_addr"`
	// AdvertiseAddr is empty, host:port, or ws|wss|http|https://host[:port];
	// after validation it carries no surrounding whitespace and no trailing /.
	AdvertiseAddr string `yaml:"advertise_addr"`
	// Binaries is the registry, keyed by trimmed entry name. After
	// validation it always holds the reserved "nexus" entry.
	Binaries map[string]*Entry `yaml:"binaries" reload:"sighup"`
	// NexusBinaryPath is the deprecated alias for binaries.nexus.path.
	NexusBinaryPath *string `yaml:"nexus_binary_path"`
	// MaxConcurrent is the gateway's cap on live instances (0: unlimited);
	// spawnd derives spawnd.max_leases from it.
	MaxConcurrent int `yaml:"max_concurrent" reload:"sighup"`

	ReleaseGrace Duration `yaml:"release_grace" reload:"sighup"`
	// MaxClaimBody bounds a claim's body, which carries its config; spawnd
	// derives spawnd.max_config_bytes from it.
	MaxClaimBody Size   `yaml:"max_claim_body" reload:"sighup"`
	StateDir     string `yaml:"state_dir"`
	BrokerID     string `yaml:"broker_id"`

	// InheritEnv names broker environment variables a spawn may carry.
	InheritEnv []string `yaml:"inherit_env" reload:"sighup"`
	// RunAs is the default credential for entries that declare none.
	RunAs *RunAs `yaml:"run_as" reload:"sighup"`

	// Spawnd holds the keys of the supervisor split (ours, not upstream's).
	Spawnd Spawnd `yaml:"spawnd"`
	// Tenancy (ours) gives each principal a uid of its own; nil is off.
	Tenancy *Tenancy `yaml:"tenancy"`

	// Digest is the file's hex SHA-256, which the gateway and spawnd
	// compare to know they run one version.
	Digest string `yaml:"-"`
}

// GatewayKeys are the top-level keys only the gateway reads and reports
// mistakes in; internal/config's tests keep the list equal to its schema.
var GatewayKeys = []string{
	"a2a", "agents", "auth", "client_replay_buffer_bytes", "cluster", "console", "control_socket", "idle_timeout",
	"max_client_frame", "max_leases_per_principal", "max_queue_depth",
	"max_queued_per_principal", "max_turn_duration", "pools", "queue_wait_timeout",
	"ready_timeout", "reattach_window", "session_report_grace",
}

// Entry is one binaries: registry entry.
type Entry struct {
	Path string `yaml:"path"`
	// Label and Description are nil when not written (GET /binaries omits
	// them, and keeps "").
	Label       *string           `yaml:"label"`
	Description *string           `yaml:"description"`
	Args        []string          `yaml:"args"`
	Env         map[string]string `yaml:"env"`
	RunAs       *RunAs            `yaml:"run_as"`
	// AllowPrivilegeEscalation (ours) starts instances without
	// no_new_privs, so a setuid binary they exec gains its privilege.
	AllowPrivilegeEscalation bool `yaml:"allow_privilege_escalation"`
	// MemoryMax, PidsMax and CPUWeight (ours) go to each instance's cgroup
	// (memory.max, pids.max, cpu.weight); 0 leaves the limit unset.
	MemoryMax Size `yaml:"memory_max"`
	PidsMax   int  `yaml:"pids_max"`
	CPUWeight int  `yaml:"cpu_weight"`
}

// RunAs is a numeric credential; both ids are required.
type RunAs struct {
	UID *int `yaml:"uid"`
	GID *int `yaml:"gid"`
}

// String renders "uid:gid".
func (r *RunAs) String() string { return fmt.Sprintf("%d:%d", *r.UID, *r.GID) }

// Spawnd configures the privileged daemon and how the gateway reaches it.
type Spawnd struct {
	// RunDir holds the RPC socket and spawnd.json, 0750; empty means one
	// per config file (spawnrpc.RunDir).
	RunDir string `yaml:"run_dir"`
	// GatewayUID is the only uid spawnd accepts RPC from; unset, its own.
	GatewayUID *int `yaml:"gateway_uid"`
	// SocketGID is the run directory's group, so the gateway's user can
	// reach the socket; unset, spawnd's.
	SocketGID *int `yaml:"socket_gid"`
	// CgroupRoot is a writable, delegated cgroup v2 directory for
	// <broker_id>/<lease_id>; empty means spawnd's own cgroup when systemd
	// delegated it, else none (process groups only).
	CgroupRoot string `yaml:"cgroup_root"`
	// MaxLeases bounds the leases spawnd holds that are not being torn
	// down; nil is DefaultMaxLeases.
	MaxLeases *int `yaml:"max_leases"`
	// MaxConfigBytes bounds the live temp configs' total size; nil is
	// max_leases × max_claim_body.
	MaxConfigBytes *Size `yaml:"max_config_bytes"`
}

// Leases is spawnd.max_leases in force: as written, else twice
// max_concurrent, else (max_concurrent unlimited) UnlimitedMaxLeases.
func (c *Config) Leases() int {
	switch {
	case c.Spawnd.MaxLeases != nil:
		return *c.Spawnd.MaxLeases
	case c.MaxConcurrent > 0:
		return 2 * c.MaxConcurrent
	}
	return UnlimitedMaxLeases
}

// ConfigBytes is spawnd.max_config_bytes in force: as written, else
// max_leases × max_claim_body.
func (c *Config) ConfigBytes() int64 {
	if c.Spawnd.MaxConfigBytes != nil {
		return int64(*c.Spawnd.MaxConfigBytes)
	}
	return int64(c.Leases()) * int64(c.MaxClaimBody)
}

// UnlimitedMaxLeases is spawnd.max_leases' default where max_concurrent
// sets no bound: spawnd itself always has one.
const UnlimitedMaxLeases = 4096

// MaxCPUWeight is the largest cpu.weight the kernel accepts.
const MaxCPUWeight = 10000

// Gateway is the uid spawnd accepts RPC from: gateway_uid, else own.
func (s Spawnd) Gateway(own int) int {
	if s.GatewayUID != nil {
		return *s.GatewayUID
	}
	return own
}

// ReservedEntry is always present: what a claim naming no binary spawns.
const ReservedEntry = "nexus"

// NoStateDirWarning is nexus-spawnd's boot WARN without a state_dir. A
// gateway that launched spawnd does not repeat it: it logs upstream's own.
const NoStateDirWarning = "state_dir is not set: leases are kept in memory only, so after a nexus-spawnd restart no running instance " +
	"is re-adopted or can prove its identity again, and resumes are not checked against the binary that created their session; " +
	"set state_dir to keep them"

// Defaults of the spec for these keys.
const (
	DefaultListenAddr    = ":8080"
	DefaultReleaseGrace  = 10 * time.Second
	DefaultMaxConcurrent = 8
	DefaultMaxClaimBody  = 1 << 20
)

// Default returns a Config holding every default and the reserved entry.
func Default() *Config {
	return &Config{
		ListenAddr:    DefaultListenAddr,
		ReleaseGrace:  Duration(DefaultReleaseGrace),
		MaxConcurrent: DefaultMaxConcurrent,
		MaxClaimBody:  DefaultMaxClaimBody,
		Binaries:      map[string]*Entry{ReservedEntry: {Path: ReservedEntry}},
	}
}

// EntryRunAs is the credential entry name spawns under: the entry's own
// run_as, else the broker-level default, else nil (spawnd's own).
func (c *Config) EntryRunAs(name string) *RunAs {
	if e := c.Binaries[name]; e != nil && e.RunAs != nil {
		return e.RunAs
	}
	return c.RunAs
}
