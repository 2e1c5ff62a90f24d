package config

import (
	"bytes"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/config/core"
)

// Pool is one pools: entry (ours): warm instances of one entry booted with
// one engine config, kept ready for the claims that name both.
type Pool struct {
	// Name is in logs, the metric label and GET /leases.
	Name string `yaml:"name"`
	// Binary is the registry entry the pool's instances run.
	Binary string `yaml:"binary"`
	// ConfigFile is the engine config they boot with, read by Load at
	// boot and on every reload, never by Parse.
	ConfigFile string `yaml:"config_file"`
	// MinIdle is how many warm instances are kept ready.
	MinIdle int `yaml:"min_idle"`
	// MaxAge recycles an instance left unclaimed this long.
	MaxAge core.Duration `yaml:"max_age"`
	// Config is ConfigFile's content, as Load read it.
	Config []byte `yaml:"-"`
}

// Defaults and bounds of pools: and warm:.
const (
	DefaultPoolMaxAge = time.Hour
	// maxPoolName keeps a pool's name short enough for a metric label
	// and a log line.
	maxPoolName = 64
)

// errTenancyPools is why tenancy: refuses pools: and warm:.
const errTenancyPools = "cannot be used with tenancy: a warm instance would boot before its principal is known, and tenancy boots every instance as its principal's uid; remove tenancy: or the pool"

// validatePools checks pools: and every profile's warm: against the
// registry, each other, tenancy: and max_concurrent, after normalizeAgents.
// It reads no file: Load does (readPools).
func (c *Config) validatePools() error {
	if len(c.Pools) == 0 {
		c.Pools = nil
	}
	names := map[string]string{} // pool name → the key that declared it
	sum := 0
	for i := range c.Pools {
		p := &c.Pools[i]
		key := fmt.Sprintf("pools[%d]", i)
		if c.Tenancy != nil {
			return fmt.Errorf("broker config: %s: pools %s", key, errTenancyPools)
		}
		p.Name = strings.TrimSpace(p.Name)
		if p.Name == "" {
			return fmt.Errorf("broker config: %s.name: required; give the pool a short name (it labels its metrics and its leases in GET /leases)", key)
		}
		if err := checkPoolName(key+".name", p.Name); err != nil {
			return err
		}
		if prev, dup := names[p.Name]; dup {
			return fmt.Errorf("broker config: %s.name: %q is already the name of %s; pool names are unique", key, p.Name, prev)
		}
		names[p.Name] = key
		p.Binary = strings.TrimSpace(p.Binary)
		if p.Binary == "" {
			return fmt.Errorf("broker config: %s.binary: required; name the binaries: entry the pool's instances run", key)
		}
		if c.Binaries[p.Binary] == nil {
			return fmt.Errorf("broker config: %s.binary: %q is not a binaries: entry; this broker spawns: %s", key, p.Binary, strings.Join(slices.Sorted(maps.Keys(c.Binaries)), ", "))
		}
		if strings.TrimSpace(p.ConfigFile) == "" {
			return fmt.Errorf("broker config: %s.config_file: required; give the engine config file the pool's instances boot with", key)
		}
		if err := core.CheckNoNUL(key+".config_file", p.ConfigFile); err != nil {
			return err
		}
		if p.MinIdle < 1 {
			return fmt.Errorf("broker config: %s.min_idle: must be at least 1 (the warm instances kept ready), got %d; remove the pool to keep none", key, p.MinIdle)
		}
		switch {
		case p.MaxAge < 0:
			return fmt.Errorf("broker config: %s.max_age: must be positive (an unclaimed instance is recycled after it), got %s; remove the key for the default %s", key, p.MaxAge.D(), DefaultPoolMaxAge)
		case p.MaxAge == 0:
			p.MaxAge = core.Duration(DefaultPoolMaxAge)
		}
		sum += p.MinIdle
	}
	for _, name := range slices.Sorted(maps.Keys(c.Agents)) {
		a, key := c.Agents[name], "agents."+name+".warm"
		switch {
		case a.Warm < 0:
			return fmt.Errorf("broker config: %s: must not be negative, got %d; 0 (the default) keeps no warm instance", key, a.Warm)
		case a.Warm == 0:
			continue
		case c.Tenancy != nil:
			return fmt.Errorf("broker config: %s: warm instances %s", key, errTenancyPools)
		}
		if err := checkPoolName(key, name); err != nil {
			return err
		}
		if prev, dup := names[name]; dup {
			return fmt.Errorf("broker config: %s: the profile's pool is named %q, already the name of %s; pool names are unique, so rename the pool or the profile", key, name, prev)
		}
		names[name] = key
		sum += a.Warm
	}
	if c.MaxConcurrent != Unlimited && sum >= c.MaxConcurrent {
		return fmt.Errorf("broker config: pools: the warm instances (min_idle of every pool, with every warm:) sum to %d, not below max_concurrent %d, so a claim of any other config would never find a slot; lower them or raise max_concurrent", sum, c.MaxConcurrent)
	}
	return nil
}

// checkPoolName: a pool's name labels metrics and appears in logs.
func checkPoolName(key, name string) error {
	if len(name) > maxPoolName {
		return fmt.Errorf("broker config: %s: %q is %d bytes; a pool's name labels its metrics, so keep it to %d", key, name, len(name), maxPoolName)
	}
	if !plainName(name) {
		return fmt.Errorf("broker config: %s: %q is not a usable pool name; it labels metrics and leases, so use letters, digits, -, _ and . only", key, name)
	}
	return nil
}

// readPools reads the engine config of every pool and warm profile, at
// boot and on every reload (Load; Parse reads no file). A pool whose
// entry and config equal another's would split the claims they match.
func (c *Config) readPools() error {
	for i := range c.Pools {
		p, key := &c.Pools[i], fmt.Sprintf("pools[%d].config_file", i)
		_, data, err := ReadEngineConfig(p.ConfigFile)
		if err != nil {
			return fmt.Errorf("broker config: %s: %w (the engine config the pool's instances boot with)", key, err)
		}
		if int64(len(data)) > int64(c.MaxClaimBody) {
			return fmt.Errorf("broker config: %s: %d bytes, over max_claim_body %d, so no claim could carry it; raise max_claim_body or shorten the config", key, len(data), c.MaxClaimBody)
		}
		p.Config = data
	}
	for name, a := range c.Agents {
		if a.Warm == 0 {
			continue
		}
		_, data, err := ReadEngineConfig(a.Config)
		if err != nil {
			return fmt.Errorf("broker config: agents.%s.config: %w (the nexus config its warm instances boot with)", name, err)
		}
		a.WarmConfig = data
	}
	all := c.AllPools()
	for i, p := range all {
		for _, q := range all[:i] {
			if p.Binary == q.Binary && bytes.Equal(p.Config, q.Config) {
				return fmt.Errorf("broker config: pools: %q and %q run the same entry %q with the same config, so a claim would match both; merge them into one", q.Name, p.Name, p.Binary)
			}
		}
	}
	return nil
}

// ReadEngineConfig reads an engine config file (a pool's config_file, a
// profile's config): ~ expanded, made absolute, a regular file. Its error
// names the file, not the key.
func ReadEngineConfig(file string) (path string, data []byte, err error) {
	path, err = core.ExpandHome(strings.TrimSpace(file))
	if err == nil {
		path, err = filepath.Abs(path)
	}
	if err != nil {
		return "", nil, err
	}
	if st, err := os.Stat(path); err != nil {
		return "", nil, err
	} else if !st.Mode().IsRegular() {
		return "", nil, fmt.Errorf("%s is not a regular file", path)
	}
	if data, err = os.ReadFile(path); err != nil {
		return "", nil, err
	}
	return path, data, nil
}

// AllPools is every pool in force: pools:, then one per profile with
// warm: (named as the profile, its entry, its config, min_idle its warm,
// the default max_age) in name order. Config is read by Load only.
func (c *Config) AllPools() []Pool {
	all := slices.Clone(c.Pools)
	for _, name := range slices.Sorted(maps.Keys(c.Agents)) {
		if a := c.Agents[name]; a.Warm > 0 {
			all = append(all, Pool{Name: name, Binary: a.Binary, ConfigFile: a.Config, MinIdle: a.Warm, MaxAge: core.Duration(DefaultPoolMaxAge), Config: a.WarmConfig})
		}
	}
	return all
}
