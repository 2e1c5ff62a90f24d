package spawnd

import (
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nexus-broker/nexus-broker/internal/config/core"
	"github.com/nexus-broker/nexus-broker/pkg/dialenv"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// settings is everything Reload may replace, resolved against this machine,
// and never modified: a spawn holding it keeps one consistent view.
type settings struct {
	cfg          *core.Config // what these settings were resolved from
	entries      map[string]*entry
	inherit      []string // inherit_env
	releaseGrace time.Duration
}

// entry is one binaries: entry, resolved.
type entry struct {
	name               string
	label, description *string // nil: not written
	path               string  // as written in broker.yaml, for the boot log
	resolved           string  // the absolute path spawnd execs
	args               []string
	env                map[string]string
	runAs              *credential       // nil: spawnd's own credential
	allowEscalation    bool              // allow_privilege_escalation: no no_new_privs
	limits             map[string]string // by key of limitFiles
	// passwdHome is the run_as user's passwd home; empty without run_as,
	// or when the entry's env sets HOME.
	passwdHome string
}

// credential is a run_as uid:gid.
type credential struct{ uid, gid uint32 }

func (c *credential) String() string { return fmt.Sprintf("%d:%d", c.uid, c.gid) }

// loadSettings reads broker.yaml for Reload and resolves it as New does.
func loadSettings(cfgPath string) (*settings, error) {
	cfg, err := core.Load(cfgPath)
	if err != nil {
		return nil, err
	}
	return resolve(cfg)
}

// resolve checks every entry of cfg against this machine; the first (by
// name) spawnd could not exec refuses the whole configuration.
func resolve(cfg *core.Config) (*settings, error) {
	s := &settings{
		cfg:          cfg,
		entries:      make(map[string]*entry, len(cfg.Binaries)),
		inherit:      cfg.InheritEnv,
		releaseGrace: cfg.ReleaseGrace.D(),
	}
	for i, n := range cfg.InheritEnv {
		if n == dialenv.BrokerAddr || n == dialenv.LeaseID || n == dialenv.SpawnSecret {
			return nil, fmt.Errorf("broker config: inherit_env[%d]: %s is set by the broker on every spawn and cannot be inherited; remove it", i, n)
		}
	}
	for _, name := range slices.Sorted(maps.Keys(cfg.Binaries)) {
		ce := cfg.Binaries[name]
		resolved, err := resolveEntryPath(name, ce.Path)
		if err != nil {
			return nil, err
		}
		e := &entry{
			name:        name,
			label:       ce.Label,
			description: ce.Description,
			path:        ce.Path,
			resolved:    resolved,
			args:        ce.Args,
			env:         ce.Env,

			allowEscalation: ce.AllowPrivilegeEscalation,
			limits:          map[string]string{},
		}
		for key, v := range map[string]int64{"memory_max": int64(ce.MemoryMax), "pids_max": int64(ce.PidsMax), "cpu_weight": int64(ce.CPUWeight)} {
			if v > 0 {
				e.limits[key] = strconv.FormatInt(v, 10)
			}
		}
		if r := cfg.EntryRunAs(name); r != nil {
			// core.Validate keeps both ids in 0..2³²-2: 2³²-1 would mean
			// "leave unchanged" to setresuid.
			e.runAs = &credential{uid: uint32(*r.UID), gid: uint32(*r.GID)}
			if err := checkRunAsIsNotTheGateway(name, e.runAs, cfg.Spawnd); err != nil {
				return nil, err
			}
			if _, ok := ce.Env["HOME"]; !ok {
				if e.passwdHome, err = passwdHome(name, *r.UID); err != nil {
					return nil, err
				}
			}
		}
		s.entries[name] = e
	}
	return s, nil
}

// resolveEntryPath turns an entry's path (~ expanded, a bare name looked up
// on spawnd's PATH) into the absolute path of a regular file with an execute
// bit; whether run_as may run it is only known at exec.
func resolveEntryPath(name, written string) (string, error) {
	p, err := core.ExpandHome(written)
	if err != nil {
		return "", fmt.Errorf("broker config: binaries: %s: %w", name, err)
	}
	if !strings.ContainsRune(p, '/') {
		found, err := exec.LookPath(p)
		if err != nil {
			return "", fmt.Errorf("broker config: binaries: %s: path %q has no path separator, so it was looked up on nexus-spawnd's PATH (%s), and no executable of that name is there; install it on that PATH or set binaries.%s.path to its absolute path",
				name, written, os.Getenv("PATH"), name)
		}
		p = found
	}
	abs, err := filepath.Abs(p)
	if err != nil {
		return "", fmt.Errorf("broker config: binaries: %s: path %q cannot be made absolute: %w", name, written, err)
	}
	refuse := func(why string, args ...any) error {
		return fmt.Errorf("broker config: binaries: %s: path %q (resolved %s) %s", name, written, abs, fmt.Sprintf(why, args...))
	}
	info, err := os.Stat(abs)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return "", refuse("does not exist; install the build there or point the entry at another path")
	case err != nil:
		return "", refuse("cannot be checked: %v", err)
	case info.IsDir():
		return "", refuse("is a directory; point the entry at the executable inside it")
	case !info.Mode().IsRegular():
		return "", refuse("is not a regular file (mode %s)", info.Mode())
	case info.Mode().Perm()&0o111 == 0:
		return "", refuse("is not executable (mode %s); chmod +x it or point the entry at another build", info.Mode().Perm())
	}
	return abs, nil
}

// checkRunAsIsNotTheGateway refuses, where the gateway runs as another user
// than spawnd, a run_as that could call spawnd: the gateway's uid (what
// SO_PEERCRED admits) or the socket group. Where they share a uid, describe
// warns instead.
func checkRunAsIsNotTheGateway(name string, c *credential, sp core.Spawnd) error {
	gw := sp.Gateway(os.Getuid())
	switch {
	case gw == os.Getuid():
		return nil
	case int(c.uid) == gw:
		return fmt.Errorf("broker config: binaries: %s: run_as uid %d is spawnd.gateway_uid, the only uid nexus-spawnd takes requests from, "+
			"so its instances could ask nexus-spawnd for anything the gateway may; give the entry a user of its own", name, c.uid)
	case sp.SocketGID != nil && int(c.gid) == *sp.SocketGID:
		return fmt.Errorf("broker config: binaries: %s: run_as gid %d is spawnd.socket_gid, the group that reaches nexus-spawnd's socket, "+
			"so its instances could connect to nexus-spawnd; give the entry a group of its own", name, c.gid)
	}
	return nil
}

// passwdHome is a run_as uid's passwd home: HOME follows the credential, so
// an instance can create ~/.nexus where its uid may write.
func passwdHome(name string, uid int) (string, error) {
	u, err := user.LookupId(strconv.Itoa(uid))
	if err != nil {
		return "", fmt.Errorf("broker config: binaries: %s: run_as uid %d has no passwd entry (%v), so nexus-spawnd cannot tell which HOME its instances get; add that user or set binaries.%s.env.HOME",
			name, uid, err, name)
	}
	if !filepath.IsAbs(u.HomeDir) {
		return "", fmt.Errorf("broker config: binaries: %s: run_as uid %d has home %q in the passwd database, which is not an absolute path; set binaries.%s.env.HOME",
			name, uid, u.HomeDir, name)
	}
	return u.HomeDir, nil
}

// alwaysPass are the variables every spawn takes from spawnd's environment:
// HOME locates ~/.nexus, PATH makes exec and the shell tool work, and LANG
// and TZ keep text and times as the operator's host renders them.
var alwaysPass = []string{"HOME", "LANG", "PATH", "TZ"}

// dialBack is the broker-owned trio a spawn is given last, and with
// tenancy: the principal's home, which replaces any other HOME.
type dialBack struct{ addr, leaseID, secret, home string }

// spawnEnv builds a spawn's environment from nothing, in the spec's order,
// each layer replacing the last's values: the always-pass set, the
// inherit_env names lookup (spawnd's environment) holds, a run_as user's
// passwd HOME, the entry's env, the dial-back trio.
func spawnEnv(e *entry, inherit []string, lookup func(string) (string, bool), dial dialBack) *envList {
	env := &envList{values: map[string]string{}}
	for _, name := range slices.Concat(alwaysPass, inherit) {
		if v, ok := lookup(name); ok {
			env.set(name, v)
		}
	}
	if e.passwdHome != "" {
		env.set("HOME", e.passwdHome)
	}
	for _, k := range slices.Sorted(maps.Keys(e.env)) {
		env.set(k, e.env[k])
	}
	if dial.home != "" {
		env.set("HOME", dial.home)
	}
	env.set(dialenv.BrokerAddr, dial.addr)
	env.set(dialenv.LeaseID, dial.leaseID)
	env.set(dialenv.SpawnSecret, dial.secret)
	return env
}

// envList is an environment that keeps each name once.
type envList struct {
	names  []string
	values map[string]string
}

func (l *envList) set(name, value string) {
	if _, ok := l.values[name]; !ok {
		l.names = append(l.names, name)
	}
	l.values[name] = value
}

// pairs is the environment as exec wants it.
func (l *envList) pairs() []string {
	out := make([]string, len(l.names))
	for i, n := range l.names {
		out[i] = n + "=" + l.values[n]
	}
	return out
}

// describe logs, at boot and after every applied reload, what each entry
// execs and the names (never values) of its environment, then one WARN per
// kind of doubtful setting.
func (d *Daemon) describe(s *settings) {
	var runAs, asRoot, runAsRoot, runAsGateway []string
	shared := s.cfg.Spawnd.Gateway(os.Getuid()) == os.Getuid()
	for _, name := range slices.Sorted(maps.Keys(s.entries)) {
		e := s.entries[name]
		env := spawnEnv(e, s.inherit, os.LookupEnv, dialBack{})
		attrs := []any{
			"name", name,
			"path", e.path,
			"resolved_path", e.resolved,
			"spawn_env", strings.Join(slices.Sorted(slices.Values(env.names)), ","),
		}
		if e.allowEscalation {
			attrs = append(attrs, "no_new_privs", false)
		}
		if e.runAs != nil {
			attrs = append(attrs, "run_as", e.runAs.String(), "run_as_home", env.values["HOME"])
			runAs = append(runAs, name)
			if e.runAs.uid == 0 {
				runAsRoot = append(runAsRoot, name)
			}
			if shared && int(e.runAs.uid) == os.Getuid() {
				runAsGateway = append(runAsGateway, name)
			}
		} else if os.Geteuid() == 0 && d.tenancy == nil { // tenancy: gives each principal its uid
			asRoot = append(asRoot, name)
		}
		d.log.Info("binary registry entry", attrs...)
	}
	var missing []string
	for _, name := range s.inherit {
		if _, ok := os.LookupEnv(name); !ok {
			missing = append(missing, name)
		}
	}
	if len(missing) > 0 {
		// Upstream's words; "this broker" is nexus-spawnd, as the key says.
		d.log.Warn("inherit_env names variables this broker's own environment does not hold, so no spawned instance will carry them; "+
			"export them into the broker's environment or set them under binaries.<name>.env",
			"missing", strings.Join(missing, ","), "environment", "nexus-spawnd's")
	}
	if len(asRoot) > 0 {
		// Upstream's "runs as the broker's uid" is root here: spawnd execs.
		d.log.Warn("these entries have no run_as and nexus-spawnd runs as root, so their instances run as root; "+
			"set run_as (a broker-level default covers every entry) to run them as an unprivileged user",
			"entries", strings.Join(asRoot, ","))
	}
	if len(runAsRoot) > 0 {
		d.log.Warn("these entries set run_as uid 0, so their instances run as root; give them an unprivileged user",
			"entries", strings.Join(runAsRoot, ","))
	}
	if len(runAsGateway) > 0 {
		d.log.Warn("these entries run_as the uid the gateway and nexus-spawnd share, so their instances could ask nexus-spawnd for anything the gateway may; "+
			"fine for one user's development setup, otherwise run the gateway as its own user (spawnd.gateway_uid) and give the entries another",
			"entries", strings.Join(runAsGateway, ","), "uid", os.Getuid())
	}
	switch {
	case len(runAs) == 0 || d.privileged:
	case os.Geteuid() != 0:
		// Upstream's words and key; the entries are ours.
		d.log.Warn("run_as is configured but this broker does not run as root, so it cannot set a spawned "+
			"instance's credentials at all — every claim selecting such an entry will fail to spawn. "+
			"Run the broker as root (or grant it CAP_SETUID and CAP_SETGID) or remove run_as",
			"euid", os.Geteuid(), "entries", strings.Join(runAs, ","))
	default: // root without the capabilities (a bounding set, a container)
		d.log.Warn("run_as is configured but nexus-spawnd lacks CAP_SETUID and CAP_SETGID, so every spawn of these entries will be refused; "+
			"run nexus-spawnd as root (or grant it both capabilities) or remove run_as",
			"entries", strings.Join(runAs, ","))
	}
}

// procSelfStatus holds the effective capabilities (tests point it at a
// copy).
var procSelfStatus = "/proc/self/status"

// hasSetIDCaps reports whether spawnd holds CAP_SETUID and CAP_SETGID: root
// may lack them (a hardened container), and a non-root spawnd may hold them.
func hasSetIDCaps() bool {
	data, err := os.ReadFile(procSelfStatus)
	if err != nil {
		return false
	}
	for line := range strings.Lines(string(data)) {
		if hex, ok := strings.CutPrefix(line, "CapEff:"); ok {
			caps, err := strconv.ParseUint(strings.TrimSpace(hex), 16, 64)
			want := uint64(1)<<unix.CAP_SETUID | uint64(1)<<unix.CAP_SETGID
			return err == nil && caps&want == want
		}
	}
	return false
}

// listing is the registry as the gateway sees it (the resolved path is for
// its boot summary only); an argv or environment never leaves spawnd.
func (s *settings) listing() []*spawnpb.Binary {
	out := make([]*spawnpb.Binary, 0, len(s.entries))
	for _, name := range slices.Sorted(maps.Keys(s.entries)) {
		e := s.entries[name]
		out = append(out, &spawnpb.Binary{Name: name, Label: e.label, Description: e.description, ResolvedPath: e.resolved})
	}
	return out
}

// spawndKeys are the keys whose changes a reload reports; the gateway
// reports its own. listen_addr is one: NEXUS_BROKER_ADDR is built from
// spawnd's boot copy, so a gateway restarted on another port must not attach
// to a spawnd sending instances to the old one. max_concurrent and
// max_claim_body are: spawnd's own bounds derive from them (limits.go).
var spawndKeys = []string{"binaries", "broker_id", "inherit_env", "listen_addr", "max_claim_body", "max_concurrent", "release_grace", "run_as", "spawnd", "state_dir", "tenancy"}

// ownKeys keeps the keys of a core.ReloadDiff list that spawnd reads.
func ownKeys(keys []string) []string {
	return slices.DeleteFunc(keys, func(k string) bool { return !slices.Contains(spawndKeys, k) })
}
