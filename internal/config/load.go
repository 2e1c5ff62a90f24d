package config

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"time"

	"gopkg.in/yaml.v3"
)

// Duration is a time.Duration written in YAML as "30s", "5m" or "1h30m".
type Duration time.Duration

// D returns the value as a time.Duration.
func (d Duration) D() time.Duration { return time.Duration(d) }

// Size is a byte count written in YAML as a non-negative integer.
type Size int64

var (
	durationType = reflect.TypeFor[Duration]()
	sizeType     = reflect.TypeFor[Size]()
)

// Load reads and validates the file at path.
func Load(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("broker config: %w", err)
	}
	return Parse(data)
}

// Parse decodes and validates broker.yaml text. Every error starts with
// "broker config: " and names the key path it is about.
func Parse(data []byte) (*Config, error) {
	c := Default()
	c.Binaries = nil // decoded from the file; the reserved entry is synthesized after
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, fmt.Errorf("broker config: %w", err)
	}
	if len(doc.Content) == 0 { // an empty file: every default
		return c, c.validate()
	}
	root := doc.Content[0]
	if root.Kind != yaml.MappingNode {
		return nil, errors.New("broker config: the file must be a mapping of keys (listen_addr: …), not a " + kindName(root))
	}
	if err := refuseUnsupported(root); err != nil {
		return nil, err
	}
	if err := check(root, reflect.TypeFor[Config](), ""); err != nil {
		return nil, fmt.Errorf("broker config: %w", err)
	}
	if err := root.Decode(c); err != nil {
		return nil, fmt.Errorf("broker config: %w", err)
	}
	return c, c.validate()
}

// refuseUnsupported names the spec's blocks this build does not implement
// yet. Ignoring an auth: block would run a broker its operator believes is
// authenticated wide open, so each is a boot refusal rather than a no-op.
func refuseUnsupported(root *yaml.Node) error {
	for i := 0; i+1 < len(root.Content); i += 2 {
		switch k := root.Content[i].Value; k {
		case "auth", "agents", "a2a":
			return fmt.Errorf("broker config: %s: this build of nexus-broker does not support the %s: block yet; remove it (see README, \"Where we differ\")", k, k)
		}
	}
	return nil
}

// check walks node against t, refusing unknown keys and malformed scalars by
// key path before yaml.v3 decodes anything (its own errors name a line, not a
// key).
func check(node *yaml.Node, t reflect.Type, path string) error {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if node.Kind == yaml.AliasNode {
		node = node.Alias
	}
	if node.Kind == yaml.ScalarNode && node.Tag == "!!null" {
		return nil
	}
	switch {
	case t == durationType:
		if node.Kind != yaml.ScalarNode {
			return fmt.Errorf("%s: want a duration such as 30s or 5m, got a %s", path, kindName(node))
		}
		if _, err := parseDuration(node.Value); err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		return nil
	case t == sizeType:
		if node.Kind != yaml.ScalarNode {
			return fmt.Errorf("%s: want a byte count, got a %s", path, kindName(node))
		}
		if _, err := parseSize(node.Value); err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		return nil
	}
	switch t.Kind() {
	case reflect.Struct:
		if node.Kind != yaml.MappingNode {
			return fmt.Errorf("%s: want a mapping of keys, got a %s", orRoot(path), kindName(node))
		}
		fields := yamlFields(t)
		for i := 0; i+1 < len(node.Content); i += 2 {
			key := node.Content[i].Value
			f, ok := fields[key]
			if !ok {
				return fmt.Errorf("%s: unknown key; known keys here are %s", join(path, key), strings.Join(sortedKeys(fields), ", "))
			}
			if err := check(node.Content[i+1], f.Type, join(path, key)); err != nil {
				return err
			}
		}
	case reflect.Map:
		if node.Kind != yaml.MappingNode {
			return fmt.Errorf("%s: want a mapping, got a %s", path, kindName(node))
		}
		for i := 0; i+1 < len(node.Content); i += 2 {
			if err := check(node.Content[i+1], t.Elem(), join(path, node.Content[i].Value)); err != nil {
				return err
			}
		}
	case reflect.Slice:
		if node.Kind != yaml.SequenceNode {
			return fmt.Errorf("%s: want a list, got a %s", path, kindName(node))
		}
		for i, n := range node.Content {
			if err := check(n, t.Elem(), fmt.Sprintf("%s[%d]", path, i)); err != nil {
				return err
			}
		}
	case reflect.String:
		if node.Kind != yaml.ScalarNode {
			return fmt.Errorf("%s: want a string, got a %s", path, kindName(node))
		}
	case reflect.Int:
		if node.Kind != yaml.ScalarNode {
			return fmt.Errorf("%s: want an integer, got a %s", path, kindName(node))
		}
		if _, err := strconv.ParseInt(node.Value, 0, strconv.IntSize); err != nil {
			return fmt.Errorf("%s: want an integer, got %q", path, node.Value)
		}
	}
	return nil
}

func yamlFields(t reflect.Type) map[string]reflect.StructField {
	m := map[string]reflect.StructField{}
	for f := range t.Fields() {
		name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		if name != "" && name != "-" {
			m[name] = f
		}
	}
	return m
}

func sortedKeys[V any](m map[string]V) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

func orRoot(path string) string {
	if path == "" {
		return "(top level)"
	}
	return path
}

func kindName(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "mapping"
	case yaml.SequenceNode:
		return "list"
	case yaml.ScalarNode:
		return fmt.Sprintf("scalar %q", n.Value)
	}
	return "document"
}

func parseDuration(s string) (time.Duration, error) {
	if s == "0" {
		return 0, nil
	}
	d, err := time.ParseDuration(strings.TrimSpace(s))
	if err != nil {
		return 0, fmt.Errorf("invalid duration %q: want a number with a unit, such as 30s, 5m or 1h30m", s)
	}
	return d, nil
}

func parseSize(s string) (int64, error) {
	n, err := strconv.ParseInt(strings.TrimSpace(s), 0, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("invalid byte count %q: want a whole number of bytes, 0 or more (1048576 is 1 MiB)", s)
	}
	return n, nil
}

// UnmarshalYAML decodes a duration checked by check.
func (d *Duration) UnmarshalYAML(n *yaml.Node) error {
	v, err := parseDuration(n.Value)
	*d = Duration(v)
	return err
}

// UnmarshalYAML decodes a size checked by check.
func (s *Size) UnmarshalYAML(n *yaml.Node) error {
	v, err := parseSize(n.Value)
	*s = Size(v)
	return err
}

// validate applies the cross-key rules.
func (c *Config) validate() error {
	if err := c.normalizeBinaries(); err != nil {
		return err
	}
	if c.ReadyTimeout <= 0 {
		return fmt.Errorf("broker config: ready_timeout: must be positive (it bounds an instance's boot), got %s", c.ReadyTimeout.D())
	}
	if c.ReattachWindow <= 0 {
		// 0 is not "wait forever": an unbounded wait is the orphan the
		// window exists to prevent.
		c.ReattachWindow = Duration(DefaultReattachWindow)
	}
	if err := c.validateRunAs(c.RunAs, "run_as"); err != nil {
		return err
	}
	for _, name := range sortedKeys(c.Binaries) {
		if err := c.validateRunAs(c.Binaries[name].RunAs, "binaries."+name+".run_as"); err != nil {
			return err
		}
	}
	for i, n := range c.InheritEnv {
		switch {
		case n == "*":
			return fmt.Errorf("broker config: inherit_env[%d]: \"*\" is not supported: a wildcard would hand every variable this process holds to whoever claims an instance; list the names instead", i)
		case n == "" || strings.ContainsAny(n, "=\x00"):
			return fmt.Errorf("broker config: inherit_env[%d]: %q is not an environment variable name", i, n)
		}
	}
	if err := c.validateAdvertise(); err != nil {
		return err
	}
	return nil
}

func (c *Config) normalizeBinaries() error {
	declared := map[string]*Entry{}
	for raw, e := range c.Binaries {
		name := strings.TrimSpace(raw)
		if name == "" {
			return errors.New("broker config: binaries: an entry name is empty")
		}
		if _, dup := declared[name]; dup {
			return fmt.Errorf("broker config: binaries: %q and another entry are the same name once whitespace is trimmed", raw)
		}
		if e == nil {
			return fmt.Errorf("broker config: binaries.%s: the entry is empty; path is required", name)
		}
		if strings.TrimSpace(e.Path) == "" {
			return fmt.Errorf("broker config: binaries.%s.path: required", name)
		}
		declared[name] = e
	}
	_, explicitNexus := declared[ReservedEntry]
	if c.NexusBinaryPath != nil {
		switch {
		case strings.TrimSpace(*c.NexusBinaryPath) == "":
			return errors.New("broker config: nexus_binary_path: set to \"\"; remove the key to take the default (a PATH lookup of nexus)")
		case explicitNexus:
			return errors.New("broker config: nexus_binary_path and binaries.nexus.path are both set; keep binaries.nexus.path and remove the deprecated nexus_binary_path")
		}
		declared[ReservedEntry] = &Entry{Path: *c.NexusBinaryPath}
	} else if !explicitNexus {
		declared[ReservedEntry] = &Entry{Path: ReservedEntry}
	}
	c.Binaries = declared
	return nil
}

func (c *Config) validateRunAs(r *RunAs, path string) error {
	if r == nil {
		return nil
	}
	switch {
	case r.UID == nil:
		return fmt.Errorf("broker config: %s.uid: required whenever run_as is written (a gid alone is not a boundary)", path)
	case r.GID == nil:
		return fmt.Errorf("broker config: %s.gid: required whenever run_as is written (a uid alone leaves instances in the broker's primary group)", path)
	case *r.UID < 0:
		return fmt.Errorf("broker config: %s.uid: %d is not a valid uid", path, *r.UID)
	case *r.GID < 0:
		return fmt.Errorf("broker config: %s.gid: %d is not a valid gid", path, *r.GID)
	}
	return nil
}

// validateAdvertise enforces the advertise_addr rules and records the two
// WARN shapes.
func (c *Config) validateAdvertise() error {
	a := strings.TrimSpace(c.AdvertiseAddr)
	if a == "" {
		if host, _, err := net.SplitHostPort(c.ListenAddr); err == nil && isWildcard(host) {
			c.Warnings = append(c.Warnings, fmt.Sprintf("listen_addr %q binds every interface and advertise_addr is empty, so ws_url is built from each claim's Host header; behind a proxy or load balancer set advertise_addr to the address clients use to reach this broker", c.ListenAddr))
		}
		return nil
	}
	hostport := a
	if scheme, _, ok := strings.Cut(a, "://"); ok {
		switch scheme {
		case "ws", "http":
		case "wss", "https":
			c.Warnings = append(c.Warnings, fmt.Sprintf("advertise_addr %q promises %s, but the broker serves cleartext only; this is right behind a TLS-terminating proxy, and wrong otherwise (advertise ws:// or a bare host:port to silence it)", a, scheme))
		default:
			return fmt.Errorf("broker config: advertise_addr: scheme %q is not one of ws, wss, http, https", scheme)
		}
		u, err := url.Parse(a)
		if err != nil {
			return fmt.Errorf("broker config: advertise_addr: %q does not parse: %v", a, err)
		}
		if (u.Path != "" && u.Path != "/") || u.RawQuery != "" || u.Fragment != "" || u.User != nil {
			return fmt.Errorf("broker config: advertise_addr: %q carries a path, query or user; give only scheme://host:port", a)
		}
		hostport = u.Host
	} else if strings.ContainsAny(a, "/?#") {
		return fmt.Errorf("broker config: advertise_addr: %q carries a path; give host:port or scheme://host:port", a)
	}
	host, port, err := net.SplitHostPort(hostport)
	if err != nil || port == "" {
		return fmt.Errorf("broker config: advertise_addr: %q has no port; give host:port, such as broker-1.example.com:8080", a)
	}
	if isWildcard(host) {
		return fmt.Errorf("broker config: advertise_addr: %q names a wildcard host, which no client can dial; give the address clients use", a)
	}
	if p, err := strconv.Atoi(port); err != nil || p <= 0 || p > 65535 {
		return fmt.Errorf("broker config: advertise_addr: port %q is not a port number", port)
	}
	return nil
}

func isWildcard(host string) bool {
	if host == "" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsUnspecified()
}
