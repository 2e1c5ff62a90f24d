package core

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"unicode"
)

// maxID is the largest uid or gid accepted: (uid_t)-1 tells setresuid to
// leave the id unchanged, which would run instances as spawnd (root).
const maxID = 1<<32 - 2

// Validate checks spawnd's keys and normalizes them (trimmed entry names,
// the reserved entry); the gateway calls it before its own checks.
func (c *Config) Validate() error {
	if _, _, err := net.SplitHostPort(c.ListenAddr); err != nil {
		return fmt.Errorf(`broker config: listen_addr: %q is not host:port; write ":8080" to listen on every interface, or "127.0.0.1:8080" for loopback only`, c.ListenAddr)
	}
	// spawnd only journals advertise_addr, in the gateway's shape of it.
	c.AdvertiseAddr = strings.TrimSuffix(strings.TrimSpace(c.AdvertiseAddr), "/")
	if err := c.normalizeBinaries(); err != nil {
		return err
	}
	if len(c.InheritEnv) == 0 {
		c.InheritEnv = nil // inherit_env: [] and no key are the same config
	}
	for i, n := range c.InheritEnv {
		key := fmt.Sprintf("inherit_env[%d]", i)
		if strings.Contains(n, "*") {
			return fmt.Errorf("broker config: %s: %q: wildcards are not supported; a claim's config names the variable its provider reads and where its value is sent, so a wildcard would hand every variable the broker holds to whoever claims an instance; list each name instead", key, n)
		}
		if err := CheckEnvName(key, n); err != nil {
			return err
		}
	}
	if err := checkRunAs(c.RunAs, "run_as"); err != nil {
		return err
	}
	if err := c.checkLimits(); err != nil {
		return err
	}
	if err := c.validateTenancy(); err != nil {
		return err
	}
	if err := checkID(c.Spawnd.GatewayUID, "spawnd.gateway_uid", "uid"); err != nil {
		return err
	}
	return checkID(c.Spawnd.SocketGID, "spawnd.socket_gid", "gid")
}

// Unlimited is the max_concurrent that sets no bound; any value below it
// is normalized to it.
const Unlimited = 0

// checkLimits checks the caps both processes read and normalizes
// max_concurrent's "<= 0 = unlimited" to one value, so GET /leases and the
// gauges report 0 rather than the negative number written.
func (c *Config) checkLimits() error {
	if c.MaxClaimBody <= 0 {
		return fmt.Errorf("broker config: max_claim_body: must be positive (a claim body carries the whole engine config), got %d; remove the key for the default %d (1 MiB)", c.MaxClaimBody, DefaultMaxClaimBody)
	}
	c.MaxConcurrent = max(c.MaxConcurrent, Unlimited)
	if n := c.Spawnd.MaxLeases; n != nil && *n <= 0 {
		return fmt.Errorf("broker config: spawnd.max_leases: must be positive (nexus-spawnd always bounds the leases it holds), got %d; remove the key for the default (twice max_concurrent, or %d)", *n, UnlimitedMaxLeases)
	}
	if n := c.Spawnd.MaxConfigBytes; n != nil && *n <= 0 {
		return fmt.Errorf("broker config: spawnd.max_config_bytes: must be positive (it bounds the temp configs of live leases), got %d; remove the key for the default (max_leases × max_claim_body)", *n)
	}
	return nil
}

// normalizeBinaries keys the registry by trimmed name, folds the deprecated
// nexus_binary_path into it, and synthesizes the reserved entry.
func (c *Config) normalizeBinaries() error {
	byName := make(map[string]*Entry, len(c.Binaries)+1)
	written := make(map[string]string, len(c.Binaries)) // trimmed name → as written
	for _, raw := range sortedKeys(c.Binaries) {
		name := strings.TrimSpace(raw)
		if name == "" {
			return fmt.Errorf("broker config: binaries: the entry name %q is empty once whitespace is trimmed; give the entry a name", raw)
		}
		if prev, dup := written[name]; dup {
			return fmt.Errorf("broker config: binaries.%s: %q and %q are the same name once surrounding whitespace is trimmed; rename or remove one", name, prev, raw)
		}
		written[name] = raw
		e := c.Binaries[raw]
		if err := e.validate("binaries." + name); err != nil {
			return err
		}
		byName[name] = e
	}
	if p := c.NexusBinaryPath; p != nil {
		// Either precedence would silently spawn a binary some operators
		// did not mean.
		if _, ok := byName[ReservedEntry]; ok {
			return errors.New("broker config: nexus_binary_path: set together with binaries.nexus.path, and neither wins; keep binaries.nexus.path and remove the deprecated nexus_binary_path")
		}
		if strings.TrimSpace(*p) == "" {
			return errors.New(`broker config: nexus_binary_path: set to ""; remove the key to take the default (nexus, looked up on PATH)`)
		}
		if err := CheckNoNUL("nexus_binary_path", *p); err != nil {
			return err
		}
		byName[ReservedEntry] = &Entry{Path: *p}
	}
	if _, ok := byName[ReservedEntry]; !ok {
		byName[ReservedEntry] = &Entry{Path: ReservedEntry}
	}
	c.Binaries = byName
	return nil
}

// validate checks one registry entry written at key path.
func (e *Entry) validate(path string) error {
	if strings.TrimSpace(e.Path) == "" {
		return fmt.Errorf("broker config: %s.path: required; give the nexus build this entry spawns (an absolute path, ~/…, or a name looked up on PATH)", path)
	}
	if err := CheckNoNUL(path+".path", e.Path); err != nil {
		return err
	}
	for i, a := range e.Args {
		if err := CheckNoNUL(fmt.Sprintf("%s.args[%d]", path, i), a); err != nil {
			return err
		}
	}
	for _, k := range sortedKeys(e.Env) {
		if err := CheckEnvName(path+".env", k); err != nil {
			return err
		}
		if err := CheckNoNUL(path+".env."+k, e.Env[k]); err != nil {
			return err
		}
	}
	// Empty is none, which ReloadDiff must not report as a change.
	if len(e.Args) == 0 {
		e.Args = nil
	}
	if len(e.Env) == 0 {
		e.Env = nil
	}
	if e.PidsMax < 0 {
		return fmt.Errorf("broker config: %s.pids_max: %d is negative; give the most processes an instance may have, or 0 for no limit", path, e.PidsMax)
	}
	if e.CPUWeight < 0 || e.CPUWeight > MaxCPUWeight {
		return fmt.Errorf("broker config: %s.cpu_weight: %d is outside 1..%d (the kernel's cpu.weight range; 100 is the default share), or 0 to leave it unset", path, e.CPUWeight, MaxCPUWeight)
	}
	return checkRunAs(e.RunAs, path+".run_as")
}

// MaxBrokerIDLen bounds broker_id where it must be a token: in cluster mode
// (a subject token, in every lease id) and with per-lease cgroups.
const MaxBrokerIDLen = 64

// IsToken reports whether s is 1..max of [A-Za-z0-9_-]: names that end up
// in file and cgroup paths and subjects.
func IsToken(s string, max int) bool {
	if s == "" || len(s) > max {
		return false
	}
	for _, r := range s {
		if !('a' <= r && r <= 'z' || 'A' <= r && r <= 'Z' || '0' <= r && r <= '9' || r == '-' || r == '_') {
			return false
		}
	}
	return true
}

// CheckEnvName refuses what cannot be an environment variable name.
func CheckEnvName(key, n string) error {
	if n == "" || strings.ContainsAny(n, "=\x00") || strings.ContainsFunc(n, unicode.IsSpace) {
		return fmt.Errorf("broker config: %s: %q is not an environment variable name (no =, whitespace or NUL); write a name such as ANTHROPIC_API_KEY", key, n)
	}
	return nil
}

// CheckNoNUL refuses at boot what exec would refuse at every claim.
func CheckNoNUL(key, s string) error {
	if strings.ContainsRune(s, 0) {
		return fmt.Errorf("broker config: %s: contains a NUL byte, which no path, argument or environment value can carry; remove it", key)
	}
	return nil
}

func checkRunAs(r *RunAs, path string) error {
	if r == nil {
		return nil
	}
	switch {
	case r.UID == nil:
		return fmt.Errorf("broker config: %s.uid: required whenever run_as is written (a gid alone is not a boundary); add a numeric uid", path)
	case r.GID == nil:
		return fmt.Errorf("broker config: %s.gid: required whenever run_as is written (a uid alone leaves instances in the broker's primary group); add a numeric gid", path)
	}
	if err := checkID(r.UID, path+".uid", "uid"); err != nil {
		return err
	}
	return checkID(r.GID, path+".gid", "gid")
}

func checkID(id *int, key, what string) error {
	if id != nil && (*id < 0 || int64(*id) > maxID) {
		return fmt.Errorf("broker config: %s: %d is not a usable %s; give a number from 0 to %d", key, *id, what, int64(maxID))
	}
	return nil
}

// DialBack is NEXUS_BROKER_ADDR for a broker listening on listenAddr: its
// /instance route, a wildcard bind dialed on loopback. bound, the port the
// gateway reports, is taken only for port 0 and must otherwise be 0 or
// listenAddr's: the gateway never names the host.
func DialBack(listenAddr string, bound int) (string, error) {
	host, port, err := net.SplitHostPort(listenAddr)
	if err != nil {
		return "", fmt.Errorf("listen_addr %q: %w", listenAddr, err)
	}
	want, err := net.LookupPort("tcp", port)
	if err != nil {
		return "", fmt.Errorf("listen_addr %q: %w", listenAddr, err)
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsUnspecified() && ip.To4() == nil {
		host = "::1"
	} else if IsWildcard(host) {
		host = "127.0.0.1"
	}
	switch {
	case bound < 0 || bound > 65535:
		return "", fmt.Errorf("the gateway reports listening on port %d, which is no TCP port", bound)
	case want == 0 && bound == 0:
		return "", fmt.Errorf("listen_addr %q asks for any free port, and the gateway reported no port it bound", listenAddr)
	case want == 0:
		want = bound
	case bound != 0 && bound != want:
		return "", fmt.Errorf("the gateway reports listening on port %d, but listen_addr %q names port %d", bound, listenAddr, want)
	}
	return "ws://" + net.JoinHostPort(host, strconv.Itoa(want)) + "/instance", nil
}

// IsWildcard reports whether host binds every interface.
func IsWildcard(host string) bool {
	if host == "" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsUnspecified()
}
