package config

import (
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/config/core"
)

// Agent is one agents: profile: the A2A identity a name publishes, and what
// running it means (a registry entry and a nexus config file).
type Agent struct {
	// Binary is the registry entry instances of this profile spawn; empty
	// means the reserved entry.
	Binary string `yaml:"binary"`
	// Config is the nexus config file instances boot with. The gateway
	// resolves (~/…) and reads it at boot and on every reload.
	Config string `yaml:"config"`
	Card   Card   `yaml:"card"`
	// Warm is how many instances of this profile are kept booted (ours):
	// a pool named as the profile (AllPools); 0 keeps none.
	Warm int `yaml:"warm"`
	// WarmConfig is Config's content when Warm > 0, as Load read it.
	WarmConfig []byte `yaml:"-"`
}

// Card is the operator-authored part of a profile's Agent Card. What the
// broker serves (interfaces, capabilities, security schemes) is derived,
// never configured, so a card cannot advertise something false.
type Card struct {
	Name             string        `yaml:"name"`
	Description      string        `yaml:"description"`
	Version          string        `yaml:"version"`
	DocumentationURL string        `yaml:"documentation_url"`
	IconURL          string        `yaml:"icon_url"`
	Provider         *CardProvider `yaml:"provider"`
	// The media types the agent takes and gives when a message does not
	// say: upstream's keys; unset, text/plain, all the IO envelope carries.
	DefaultInputModes  []string `yaml:"default_input_modes"`
	DefaultOutputModes []string `yaml:"default_output_modes"`
	Skills             []Skill  `yaml:"skills"`
}

// CardProvider is the card's provider block.
type CardProvider struct {
	Organization string `yaml:"organization"`
	URL          string `yaml:"url"`
}

// Skill is one skill a card lists.
type Skill struct {
	ID          string   `yaml:"id"`
	Name        string   `yaml:"name"`
	Description string   `yaml:"description"`
	Tags        []string `yaml:"tags"`
	Examples    []string `yaml:"examples"`
	// InputModes and OutputModes narrow the card's defaults for this skill.
	InputModes  []string `yaml:"input_modes"`
	OutputModes []string `yaml:"output_modes"`
}

// A2A is the a2a: block: one retention policy for the broker's one task
// store, deliberately not per profile.
type A2A struct {
	// StateDir is where the gateway keeps the task store and the context
	// index (ours): state_dir when empty. In the production split
	// state_dir is nexus-spawnd's, private to its uid, and the gateway
	// cannot write there; it names a directory of the gateway's own.
	StateDir string   `yaml:"state_dir"`
	Tasks    A2ATasks `yaml:"tasks"`
}

// A2AStateDir is the directory of the A2A task store and context index:
// a2a.state_dir, else state_dir with its ~ expanded as spawnd expands it;
// empty keeps both in memory.
func (c *Config) A2AStateDir() (string, error) {
	if c.A2A.StateDir != "" {
		return c.A2A.StateDir, nil
	}
	dir, err := core.ExpandHome(c.StateDir)
	if err != nil {
		return "", fmt.Errorf("broker config: state_dir: %w", err)
	}
	return dir, nil
}

// A2ATasks are the task store's knobs.
type A2ATasks struct {
	// TTL is how long a finished task stays readable.
	TTL core.Duration `yaml:"ttl"`
	// MaxPerContext is how many tasks are kept per (caller, profile,
	// contextId).
	MaxPerContext int `yaml:"max_per_context"`
	// InputTimeout is how long a task may wait in INPUT_REQUIRED; 0
	// disables the deadline.
	InputTimeout core.Duration `yaml:"input_timeout"`
	// MaxStoreBytes bounds the text the store holds in total (ours: it
	// replaces upstream's 16 KiB cap per stored text, so an answer reads
	// back whole).
	MaxStoreBytes core.Size `yaml:"max_store_bytes"`
}

// Defaults of the a2a: block.
const (
	DefaultA2ATaskTTL        = 24 * time.Hour
	DefaultA2AMaxPerContext  = 50
	DefaultA2AInputTimeout   = 15 * time.Minute
	DefaultA2AMaxStoreBytes  = 256 << 20
	profileNameAllowedSymbol = "-_."
)

func defaultA2A() A2A {
	return A2A{Tasks: A2ATasks{
		TTL:           core.Duration(DefaultA2ATaskTTL),
		MaxPerContext: DefaultA2AMaxPerContext,
		InputTimeout:  core.Duration(DefaultA2AInputTimeout),
		MaxStoreBytes: DefaultA2AMaxStoreBytes,
	}}
}

// normalizeAgents keys the profiles by trimmed name and checks each against
// the registry, after normalizeBinaries.
func (c *Config) normalizeAgents() error {
	if len(c.Agents) == 0 {
		c.Agents = nil
	}
	byName := make(map[string]*Agent, len(c.Agents))
	written := make(map[string]string, len(c.Agents))
	for _, raw := range slices.Sorted(maps.Keys(c.Agents)) {
		name := strings.TrimSpace(raw)
		if err := checkProfileName(raw, name); err != nil {
			return err
		}
		if prev, dup := written[name]; dup {
			return fmt.Errorf("broker config: agents.%s: %q and %q are the same profile name once surrounding whitespace is trimmed; rename or remove one", name, prev, raw)
		}
		written[name] = raw
		a := c.Agents[raw]
		if a == nil {
			return fmt.Errorf("broker config: agents.%s: has no value; give the profile a config and a card", name)
		}
		if err := a.validate("agents."+name, c); err != nil {
			return err
		}
		byName[name] = a
	}
	if len(byName) > 0 {
		c.Agents = byName
		if c.AdvertiseAddr == "" && c.ListenHost() == "" {
			return fmt.Errorf("broker config: advertise_addr: required with agents: profiles when listen_addr %q binds every interface, because an Agent Card must carry absolute URLs a client can dial; set advertise_addr to the address clients use", c.ListenAddr)
		}
	}
	if d := c.A2A.StateDir; d != "" && !filepath.IsAbs(d) {
		return fmt.Errorf("broker config: a2a.state_dir: must be an absolute path, got %q", d)
	}
	t := &c.A2A.Tasks
	switch {
	case t.TTL <= 0:
		return fmt.Errorf("broker config: a2a.tasks.ttl: must be positive (how long a finished task stays readable), got %s; remove the key for the default %s", t.TTL.D(), DefaultA2ATaskTTL)
	case t.MaxPerContext <= 0:
		return fmt.Errorf("broker config: a2a.tasks.max_per_context: must be positive, got %d; remove the key for the default %d", t.MaxPerContext, DefaultA2AMaxPerContext)
	case t.InputTimeout < 0:
		return fmt.Errorf("broker config: a2a.tasks.input_timeout: must not be negative, got %s; \"0s\" disables the deadline", t.InputTimeout.D())
	case t.MaxStoreBytes <= 0:
		return fmt.Errorf("broker config: a2a.tasks.max_store_bytes: must be positive, got %d; remove the key for the default %d (256 MiB)", t.MaxStoreBytes, DefaultA2AMaxStoreBytes)
	}
	return nil
}

// checkProfileName: a profile name is a URL path segment.
func checkProfileName(raw, name string) error {
	if name == "" {
		return fmt.Errorf("broker config: agents: the profile name %q is empty once whitespace is trimmed; give the profile a name", raw)
	}
	if !plainName(name) {
		return fmt.Errorf("broker config: agents.%s: %q is not a usable profile name; it is a URL path segment, so use letters, digits, -, _ and . only", name, raw)
	}
	if name == "." || name == ".." {
		return fmt.Errorf("broker config: agents.%s: %q is not a usable profile name (a dot segment); name it with letters or digits too", name, raw)
	}
	return nil
}

// plainName: name is letters, digits, -, _ and . only.
func plainName(name string) bool {
	for _, r := range name {
		if !(r < 128 && (r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune(profileNameAllowedSymbol, r))) {
			return false
		}
	}
	return true
}

func (a *Agent) validate(path string, c *Config) error {
	a.Binary = strings.TrimSpace(a.Binary)
	if a.Binary == "" {
		a.Binary = core.ReservedEntry
	}
	if c.Binaries[a.Binary] == nil {
		return fmt.Errorf("broker config: %s.binary: unknown entry %q; this broker spawns: %s", path, a.Binary, strings.Join(slices.Sorted(maps.Keys(c.Binaries)), ", "))
	}
	if strings.TrimSpace(a.Config) == "" {
		return fmt.Errorf("broker config: %s.config: required; give the nexus config file instances of this profile boot with", path)
	}
	if err := core.CheckNoNUL(path+".config", a.Config); err != nil {
		return err
	}
	card := &a.Card
	for _, f := range []struct{ key, v string }{{"name", card.Name}, {"description", card.Description}, {"version", card.Version}} {
		if strings.TrimSpace(f.v) == "" {
			return fmt.Errorf("broker config: %s.card.%s: required; an Agent Card must carry a %s", path, f.key, f.key)
		}
	}
	ids := map[string]bool{}
	for i, s := range card.Skills {
		key := fmt.Sprintf("%s.card.skills[%d]", path, i)
		for _, f := range []struct{ key, v string }{{"id", s.ID}, {"name", s.Name}, {"description", s.Description}} {
			if strings.TrimSpace(f.v) == "" {
				return fmt.Errorf("broker config: %s.%s: required; every skill has an id, a name and a description", key, f.key)
			}
		}
		if ids[s.ID] {
			return fmt.Errorf("broker config: %s.id: %q is listed twice; skill ids are unique within a card", key, s.ID)
		}
		ids[s.ID] = true
	}
	if p := card.Provider; p != nil && (strings.TrimSpace(p.Organization) == "" || strings.TrimSpace(p.URL) == "") {
		return fmt.Errorf("broker config: %s.card.provider: needs both organization and url, or remove the block", path)
	}
	return nil
}
