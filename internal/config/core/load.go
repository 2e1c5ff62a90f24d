package core

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"

	"gopkg.in/yaml.v3"
)

// Duration is a time.Duration written in YAML as "30s", "5m", "1h30m" or 0.
type Duration time.Duration

// D returns the value as a time.Duration.
func (d Duration) D() time.Duration { return time.Duration(d) }

// Size is a byte count written in YAML as a non-negative integer.
type Size int64

var (
	durationType    = reflect.TypeFor[Duration]()
	sizeType        = reflect.TypeFor[Size]()
	unmarshalerType = reflect.TypeFor[yaml.Unmarshaler]()
)

// Narrower is a schema struct whose allowed keys depend on its node (an auth
// validator's type:); keys it leaves out are unknown.
type Narrower interface {
	NarrowKeys(node *yaml.Node, fields map[string]reflect.StructField, path string) (map[string]reflect.StructField, error)
}

// Load reads the file at path and validates spawnd's keys.
func Load(path string) (*Config, error) { return LoadWith(path, Parse) }

// LoadWith reads the file at path, parses it with parse (Parse, or the
// gateway's) and stamps it with the digest of the bytes read.
func LoadWith[P interface{ base() *Config }](path string, parse func([]byte) (P, error)) (P, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		var none P
		return none, fmt.Errorf("broker config: %w (check the -config path and the file's permissions)", err)
	}
	c, err := parse(data)
	if err != nil {
		return c, err
	}
	sum := sha256.Sum256(data)
	c.base().Digest = hex.EncodeToString(sum[:])
	return c, nil
}

func (c *Config) base() *Config { return c }

// Canonical is path absolute with every symlink resolved: a config file's
// identity, naming its default run directory.
func Canonical(path string) (string, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return "", fmt.Errorf("broker config: %w", err)
	}
	real, err := filepath.EvalSymlinks(abs)
	if err != nil {
		return "", fmt.Errorf("broker config: %w (check the -config path)", err)
	}
	return real, nil
}

// ExpandHome expands a leading ~ in a broker.yaml path to this process's
// HOME, as the spec's examples ("~/.nexus/broker") expect.
func ExpandHome(p string) (string, error) {
	if p != "~" && !strings.HasPrefix(p, "~/") {
		return p, nil
	}
	home := os.Getenv("HOME")
	if home == "" {
		return "", fmt.Errorf("path %q starts with ~, but %s's environment has no HOME; write the path out in full", p, filepath.Base(os.Args[0]))
	}
	return filepath.Join(home, p[1:]), nil
}

// Parse decodes broker.yaml text as spawnd reads it, the gateway's keys
// unread. Every error starts "broker config: " and names its key path.
func Parse(data []byte) (*Config, error) {
	c := Default()
	c.Binaries = nil // decoded from the file; Validate synthesizes the reserved entry
	if err := Decode(data, c, GatewayKeys); err != nil {
		return nil, err
	}
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return c, nil
}

// Decode checks broker.yaml text against dst's schema (a struct pointer,
// which may embed Config inline) and decodes it, naming every unknown key at
// every level in one error; top-level keys in tolerate are skipped.
func Decode(data []byte, dst any, tolerate []string) error {
	root, err := document(data)
	if root == nil || err != nil {
		return err
	}
	w := &checker{done: map[aliasVisit]bool{}, tolerate: tolerate}
	w.keep(w.check(root, reflect.TypeOf(dst).Elem(), ""))
	if err := w.unknownKeys(w.err); err != nil {
		return fmt.Errorf("broker config: %w", err)
	}
	// Left to fail here: yaml.v3's limit on alias expansion.
	if err := root.Decode(dst); err != nil {
		return fmt.Errorf("broker config: %w", err)
	}
	return nil
}

// document returns the top-level mapping, nil for a file with no keys.
func document(data []byte) (*yaml.Node, error) {
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, nil
		}
		return nil, fmt.Errorf("broker config: not valid YAML: %w", err)
	}
	// yaml.Unmarshal would silently drop what follows a stray ---.
	for {
		var next yaml.Node
		err := dec.Decode(&next)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("broker config: not valid YAML: %w", err)
		}
		if n := next.Content[0]; !isNull(n) {
			return nil, fmt.Errorf("broker config: line %d: another YAML document starts here; broker.yaml is one document, so remove the --- separator and merge the keys", n.Line)
		}
	}
	root := doc.Content[0]
	switch {
	case isNull(root):
		return nil, nil
	case root.Kind != yaml.MappingNode:
		return nil, fmt.Errorf("broker config: the file must be a mapping of keys (listen_addr: …), not %s", describe(root))
	}
	return root, nil
}

// checker walks the document against the schema, refusing unknown keys and
// malformed values by key path before yaml.v3 decodes anything (whose errors
// name a line, not a key).
type checker struct {
	// done records alias targets checked as a type, so a node aliased many
	// times is walked once.
	done    map[aliasVisit]bool
	unknown []string // every unknown key, for one error
	// err is the first other mistake; the walk goes on for unknown keys.
	err      error
	tolerate []string
}

// keep records a child's mistake and lets the walk go on.
func (w *checker) keep(err error) {
	if w.err == nil {
		w.err = err
	}
}

// unknownKeys folds the unknown keys into one error, followed by err.
func (w *checker) unknownKeys(err error) error {
	if len(w.unknown) == 0 {
		return err
	}
	msg := strings.Join(w.unknown, "; ")
	if len(w.unknown) > 1 {
		msg = fmt.Sprintf("%d unknown keys: %s", len(w.unknown), msg)
	}
	if err != nil {
		return fmt.Errorf("%s; and %w", msg, err)
	}
	return errors.New(msg)
}

type aliasVisit struct {
	node *yaml.Node
	t    reflect.Type
}

func (w *checker) check(node *yaml.Node, t reflect.Type, path string) error {
	if node.Kind == yaml.AliasNode {
		// The schema has no recursive type, so a self-referencing anchor
		// fails a kind check within a few levels.
		v := aliasVisit{node.Alias, t}
		if w.done[v] {
			return nil
		}
		if err := w.check(node.Alias, t, path); err != nil {
			return err
		}
		w.done[v] = true
		return nil
	}
	if isNull(node) {
		// An empty scalar or run_as is almost always a value meant to be
		// there.
		switch t.Kind() {
		case reflect.Map, reflect.Slice, reflect.Struct:
			return nil
		}
		return fmt.Errorf("%s: has no value; give it one, or remove the key", path)
	}
	if t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t.Kind() == reflect.Slice && t.Elem().Kind() == reflect.String && reflect.PointerTo(t).Implements(unmarshalerType) {
		// A list of strings with its own decoding takes a string too.
		if node.Kind == yaml.SequenceNode {
			t = reflect.TypeFor[[]string]()
		} else {
			return checkScalar(node, reflect.TypeFor[string](), path)
		}
	}
	switch t.Kind() {
	case reflect.Struct:
		if err := checkKeys(node, path); err != nil {
			return err
		}
		fields := YAMLFields(t)
		if n, ok := reflect.New(t).Interface().(Narrower); ok {
			var err error
			if fields, err = n.NarrowKeys(node, fields, path); err != nil {
				return err
			}
		}
		for i := 0; i+1 < len(node.Content); i += 2 {
			key := node.Content[i].Value
			if path == "" && slices.Contains(w.tolerate, key) {
				continue
			}
			f, ok := fields[key]
			if !ok {
				allowed := sortedKeys(fields)
				if path == "" {
					allowed = slices.Sorted(slices.Values(slices.Concat(allowed, w.tolerate)))
				}
				w.unknown = append(w.unknown, fmt.Sprintf("%s: unknown key; the keys allowed here are %s", Join(path, key), strings.Join(allowed, ", ")))
				continue
			}
			w.keep(w.check(node.Content[i+1], f.Type, Join(path, key)))
		}
	case reflect.Map:
		if err := checkKeys(node, path); err != nil {
			return err
		}
		for i := 0; i+1 < len(node.Content); i += 2 {
			w.keep(w.check(node.Content[i+1], t.Elem(), Join(path, node.Content[i].Value)))
		}
	case reflect.Slice:
		if node.Kind != yaml.SequenceNode {
			return fmt.Errorf("%s: want a list, got %s", path, describe(node))
		}
		for i, n := range node.Content {
			w.keep(w.check(n, t.Elem(), fmt.Sprintf("%s[%d]", path, i)))
		}
	default:
		return checkScalar(node, t, path)
	}
	return nil
}

// checkKeys refuses what yaml.v3 would reject by line (duplicates), resolve
// surprisingly (<< merges) or drop silently (a key with no name).
func checkKeys(node *yaml.Node, path string) error {
	if node.Kind != yaml.MappingNode {
		return fmt.Errorf("%s: want a mapping of keys, got %s", orRoot(path), describe(node))
	}
	seen := map[string]int{}
	for i := 0; i+1 < len(node.Content); i += 2 {
		k := node.Content[i]
		switch {
		case k.Kind != yaml.ScalarNode:
			return fmt.Errorf("%s: line %d: a key must be a plain name, not %s", orRoot(path), k.Line, describe(k))
		case k.Value == "<<" && k.ShortTag() == "!!merge":
			return fmt.Errorf("%s: line %d: YAML merge keys (<<) are not supported here; write the keys out, or alias a whole value (run_as: *name)", orRoot(path), k.Line)
		case isNull(k) || k.ShortTag() == "!!binary":
			return fmt.Errorf("%s: line %d: a key must be a plain name, not %s", orRoot(path), k.Line, describe(k))
		}
		if line, dup := seen[k.Value]; dup {
			return fmt.Errorf("%s: written twice (lines %d and %d); keep one", Join(path, k.Value), line, k.Line)
		}
		seen[k.Value] = k.Line
	}
	return nil
}

// checkScalar decodes a leaf exactly as the real decode will, so the two
// cannot disagree about what is valid.
func checkScalar(node *yaml.Node, t reflect.Type, path string) error {
	var want string
	switch {
	case t == durationType:
		want = "a duration such as 30s or 5m"
	case t == sizeType:
		want = "a byte count such as 1048576"
	case t.Kind() == reflect.Int:
		want = "a whole number"
	default:
		want = "a string"
	}
	if node.Kind != yaml.ScalarNode {
		return fmt.Errorf("%s: want %s, got %s", path, want, describe(node))
	}
	// yaml.v3 reports a quoted "8" for an int by line, and reads 8.5 as 8.
	if t.Kind() == reflect.Int && node.ShortTag() != "!!int" {
		return fmt.Errorf("%s: want %s, got %s", path, want, describe(node))
	}
	if err := node.Decode(reflect.New(t).Interface()); err != nil {
		var te *yaml.TypeError
		if errors.As(err, &te) {
			return fmt.Errorf("%s: want %s, got %s", path, want, describe(node))
		}
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}

func isNull(n *yaml.Node) bool { return n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null" }

// YAMLFields maps each key of struct type t to its field, an inline
// struct's keys included (Index is the path from t).
func YAMLFields(t reflect.Type) map[string]reflect.StructField {
	m := map[string]reflect.StructField{}
	for f := range t.Fields() {
		name, opts, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		if opts == "inline" {
			for k, sub := range YAMLFields(f.Type) {
				sub.Index = slices.Concat(f.Index, sub.Index)
				m[k] = sub
			}
		} else if name != "" && name != "-" {
			m[name] = f
		}
	}
	return m
}

func sortedKeys[V any](m map[string]V) []string { return slices.Sorted(maps.Keys(m)) }

// Join is the key path of key under path.
func Join(path, key string) string {
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

// describe names what was written, for "want X, got Y" errors.
func describe(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	case yaml.AliasNode:
		return "an alias (*" + n.Value + ")"
	}
	switch n.ShortTag() {
	case "!!null":
		return "nothing"
	case "!!str":
		return "the string " + strconv.Quote(n.Value)
	}
	return strconv.Quote(n.Value)
}

// UnmarshalYAML decodes a duration such as 30s.
func (d *Duration) UnmarshalYAML(n *yaml.Node) error {
	v, err := time.ParseDuration(strings.TrimSpace(n.Value))
	if err != nil {
		return fmt.Errorf("invalid duration %q: want a number with a unit, such as 30s, 5m or 1h30m (or 0)", n.Value)
	}
	*d = Duration(v)
	return nil
}

// UnmarshalYAML decodes a byte count.
func (s *Size) UnmarshalYAML(n *yaml.Node) error {
	v, err := strconv.ParseInt(strings.TrimSpace(n.Value), 0, 64)
	if err != nil || v < 0 {
		return fmt.Errorf("invalid byte count %q: want a whole number of bytes, 0 or more (1048576 is 1 MiB)", n.Value)
	}
	*s = Size(v)
	return nil
}
