package config

import (
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/config/core"
)

// agentWith is a profile for the listen address agents: need, with extra
// keys (warm:) inline.
func agentWith(name, extra string) string {
	return "listen_addr: \"127.0.0.1:8080\"\nagents:\n  " + name + ": {config: /e/" + name + ".yaml, card: {name: N, description: D, version: \"1\"}" + extra + "}\n"
}

// poolErrorCases are pools: and warm: files Parse refuses, each naming its
// key (TestParseErrors runs them; FuzzParse seeds with them).
var poolErrorCases = []struct{ name, yaml, key, want string }{
	{"pool without a name", "pools: [{binary: nexus, config_file: /e.yaml, min_idle: 1}]", "pools[0].name", "required"},
	{"pool name of spaces", "pools: [{name: \"  \", binary: nexus, config_file: /e.yaml, min_idle: 1}]", "pools[0].name", "required"},
	{"pool name with a slash", "pools: [{name: a/b, binary: nexus, config_file: /e.yaml, min_idle: 1}]", "pools[0].name", `"a/b" is not a usable pool name`},
	{"pool name too long", "pools: [{name: " + strings.Repeat("p", 65) + ", binary: nexus, config_file: /e.yaml, min_idle: 1}]", "pools[0].name", "is 65 bytes"},
	{"pool names twice", "pools: [{name: a, binary: nexus, config_file: /e.yaml, min_idle: 1}, {name: \" a\", binary: nexus, config_file: /f.yaml, min_idle: 1}]", "pools[1].name", `"a" is already the name of pools[0]`},
	{"pool without a binary", "pools: [{name: a, config_file: /e.yaml, min_idle: 1}]", "pools[0].binary", "required"},
	{"pool of an unknown binary", "pools: [{name: a, binary: nexus, config_file: /e.yaml, min_idle: 1}, {name: b, binary: x, config_file: /e.yaml, min_idle: 1}]", "pools[1].binary", `"x" is not a binaries: entry; this broker spawns: nexus`},
	{"pool without a config_file", "pools: [{name: a, binary: nexus, min_idle: 1}]", "pools[0].config_file", "required"},
	{"pool config_file with a NUL", "pools: [{name: a, binary: nexus, config_file: \"/e\\0\", min_idle: 1}]", "pools[0].config_file", "NUL"},
	{"pool without min_idle", "pools: [{name: a, binary: nexus, config_file: /e.yaml}]", "pools[0].min_idle", "must be at least 1"},
	{"pool min_idle negative", "pools: [{name: a, binary: nexus, config_file: /e.yaml, min_idle: -1}]", "pools[0].min_idle", "got -1"},
	{"pool max_age negative", "pools: [{name: a, binary: nexus, config_file: /e.yaml, min_idle: 1, max_age: -1m}]", "pools[0].max_age", "must be positive"},
	{"pool max_age garbage", "pools: [{name: a, binary: nexus, config_file: /e.yaml, min_idle: 1, max_age: soon}]", "pools[0].max_age", "invalid duration"},
	{"unknown pool key", "pools: [{name: a, binary: nexus, config: /e.yaml, min_idle: 1}]", "pools[0].config", "unknown key; the keys allowed here are binary, config_file, max_age, min_idle, name"},
	{"pools not a list", "pools: {name: a}", "pools", "want a list"},
	{"min_idle at max_concurrent", "max_concurrent: 4\npools: [{name: a, binary: nexus, config_file: /e.yaml, min_idle: 2}, {name: b, binary: nexus, config_file: /f.yaml, min_idle: 2}]", "pools", "sum to 4, not below max_concurrent 4"},
	{"min_idle with warm at max_concurrent", "max_concurrent: 3\npools: [{name: a, binary: nexus, config_file: /e.yaml, min_idle: 1}]\n" + agentWith("s", ", warm: 2"), "pools", "sum to 3, not below max_concurrent 3"},
	{"warm negative", agentWith("s", ", warm: -1"), "agents.s.warm", "must not be negative, got -1"},
	{"warm named as a pool", "pools: [{name: s, binary: nexus, config_file: /e.yaml, min_idle: 1}]\n" + agentWith("s", ", warm: 1"), "agents.s.warm", `named "s", already the name of pools[0]`},
	{"warm profile name too long", agentWith(strings.Repeat("s", 65), ", warm: 1"), "agents." + strings.Repeat("s", 65) + ".warm", "is 65 bytes"},
	{"pools with tenancy", "state_dir: /s\ntenancy: {uid_range: 200000-200009, homes_dir: /h, sandbox: none}\npools: [{name: a, binary: nexus, config_file: /e.yaml, min_idle: 1}]", "pools[0]", "pools cannot be used with tenancy: a warm instance would boot before its principal is known"},
	{"warm with tenancy", "state_dir: /s\ntenancy: {uid_range: 200000-200009, homes_dir: /h, sandbox: none}\n" + agentWith("s", ", warm: 1"), "agents.s.warm", "warm instances cannot be used with tenancy"},
}

// specPoolsExample is issue 28's listing of pools:.
const specPoolsExample = `pools:
  - name: default                 # required; in logs, the metric label, GET /leases
    binary: nexus                 # a binaries: entry
    config_file: /etc/nexus-broker/engines/default.yaml   # the engine config they boot with
    min_idle: 4                   # warm instances kept ready (>= 1)
    max_age: 1h                   # recycled after this, unclaimed (default 1h)
`

func TestPools(t *testing.T) {
	if got := mustParse(t, specPoolsExample).Pools; !reflect.DeepEqual(got, []Pool{{Name: "default", Binary: "nexus", ConfigFile: "/etc/nexus-broker/engines/default.yaml", MinIdle: 4, MaxAge: core.Duration(time.Hour)}}) {
		t.Errorf("the listing's pools: = %+v", got)
	}

	c := mustParse(t, `max_concurrent: 6
binaries: {vision: {path: /opt/v}}
pools:
  - {name: " default ", binary: " nexus ", config_file: /e/default.yaml, min_idle: 2}
  - {name: vision, binary: vision, config_file: ~/v.yaml, min_idle: 1, max_age: 10m}
agents:
  support: {config: /e/support.yaml, card: {name: S, description: D, version: "1"}, warm: 2}
  cold: {binary: vision, config: /e/cold.yaml, card: {name: C, description: D, version: "1"}, warm: 0}
listen_addr: "127.0.0.1:8080"
`)
	want := []Pool{
		{Name: "default", Binary: "nexus", ConfigFile: "/e/default.yaml", MinIdle: 2, MaxAge: core.Duration(time.Hour)},
		{Name: "vision", Binary: "vision", ConfigFile: "~/v.yaml", MinIdle: 1, MaxAge: core.Duration(10 * time.Minute)},
		{Name: "support", Binary: "nexus", ConfigFile: "/e/support.yaml", MinIdle: 2, MaxAge: core.Duration(time.Hour)},
	}
	if got := c.AllPools(); !reflect.DeepEqual(got, want) {
		t.Errorf("AllPools = %+v\nwant %+v", got, want)
	}
	if n := len(c.Pools); n != 2 {
		t.Errorf("pools: holds %d, want 2 (the warm profile is not one of them)", n)
	}
	// Unlimited max_concurrent bounds no sum; pools: [] is no pools.
	if c := mustParse(t, "max_concurrent: 0\npools: [{name: a, binary: nexus, config_file: /e.yaml, min_idle: 100}]"); len(c.AllPools()) != 1 {
		t.Errorf("AllPools = %+v", c.AllPools())
	}
	if c := mustParse(t, "pools: []"); c.Pools != nil || c.AllPools() != nil {
		t.Errorf("pools: [] = %+v", c.Pools)
	}
	// tenancy: with warm: 0 is no warm instance.
	mustParse(t, "state_dir: /s\ntenancy: {uid_range: 200000-200009, homes_dir: /h, sandbox: none}\n"+agentWith("s", ", warm: 0"))
}

// TestLoadReadsPoolConfigs: Load reads every pool's config_file and every
// warm profile's config, and refuses one it cannot use, naming the key.
func TestLoadReadsPoolConfigs(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	a, b := write("a.yaml", "model: a\n"), write("b.yaml", "model: b\n")
	t.Setenv("HOME", dir)
	profile := func(file string, warm int) string {
		return "listen_addr: \"127.0.0.1:8080\"\nagents:\n  s: {config: " + file + ", card: {name: N, description: D, version: \"1\"}, warm: " + strconv.Itoa(warm) + "}\n"
	}
	pool := func(name, file string) string {
		return "  - {name: " + name + ", binary: nexus, config_file: " + file + ", min_idle: 1}\n"
	}
	c, err := Load(write("ok.yaml", "pools:\n"+pool("p", "~/a.yaml")+profile(b, 1)))
	if err != nil {
		t.Fatal(err)
	}
	all := c.AllPools()
	if len(all) != 2 || string(all[0].Config) != "model: a\n" || string(all[1].Config) != "model: b\n" {
		t.Errorf("AllPools = %+v", all)
	}
	// A cold profile's config is the A2A door's to read, not Load's.
	if c, err := Load(write("cold.yaml", profile(filepath.Join(dir, "missing.yaml"), 0))); err != nil || c.Agents["s"].WarmConfig != nil {
		t.Errorf("a cold profile with a missing config: %v, %+v", err, c)
	}
	for _, tc := range []struct{ name, yaml, key, want string }{
		{"missing config_file", "pools:\n" + pool("p", filepath.Join(dir, "missing.yaml")), "pools[0].config_file", "no such file or directory"},
		{"config_file a directory", "pools:\n" + pool("p", a) + pool("q", dir), "pools[1].config_file", "is not a regular file"},
		{"config_file over max_claim_body", "max_claim_body: 4\npools:\n" + pool("p", a), "pools[0].config_file", "9 bytes, over max_claim_body 4"},
		{"warm profile's config missing", profile(filepath.Join(dir, "missing.yaml"), 2), "agents.s.config", "no such file or directory"},
		{"two pools of one config", "pools:\n" + pool("p", a) + pool("q", filepath.Join(dir, ".", "a.yaml")), "pools", `"p" and "q" run the same entry "nexus" with the same config`},
		{"a pool and a warm profile of one config", "pools:\n" + pool("p", a) + profile(a, 1), "pools", `"p" and "s" run the same entry`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Load(write("broker.yaml", tc.yaml))
			if err == nil {
				t.Fatalf("loaded %+v; want an error naming %q", c, tc.key)
			}
			if c != nil {
				t.Errorf("a Config came back beside the error")
			}
			if prefix := "broker config: " + tc.key + ": "; !strings.HasPrefix(err.Error(), prefix) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q\nwant %q…%q", err, prefix, tc.want)
			}
		})
	}
}

// TestPoolsReload: a SIGHUP re-reads config_file, so a changed engine
// config is a changed pools: key, and a warm profile's an agents: one.
func TestPoolsReload(t *testing.T) {
	dir := t.TempDir()
	engine, file := filepath.Join(dir, "e.yaml"), filepath.Join(dir, "broker.yaml")
	if err := os.WriteFile(engine, []byte("model: a\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	yaml := "listen_addr: \"127.0.0.1:8080\"\npools: [{name: p, binary: nexus, config_file: " + engine + ", min_idle: 1}]\n" +
		"agents: {s: {binary: echo, config: " + engine + ", card: {name: N, description: D, version: \"1\"}, warm: 1}}\nbinaries: {echo: {path: /e}}\n"
	if err := os.WriteFile(file, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	cur, err := Load(file)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(engine, []byte("model: b\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	next, err := Load(file)
	if err != nil {
		t.Fatal(err)
	}
	if r, b := core.ReloadDiff(cur, next); !reflect.DeepEqual(r, []string{"agents", "pools"}) || b != nil {
		t.Errorf("ReloadDiff = %v, %v; want agents and pools reloadable", r, b)
	}
	for _, p := range core.Reloaded(cur, next).AllPools() {
		if string(p.Config) != "model: b\n" {
			t.Errorf("pool %s in force after the reload boots with %q", p.Name, p.Config)
		}
	}
}
