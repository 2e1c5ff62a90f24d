package config

import (
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/nexus-broker/nexus-broker/internal/config/core"
)

// reloadClass is the classification ReloadDiff must make of every
// top-level key: the spec's "Changing config without a restart: SIGHUP"
// boot-only list, spawnd: (ours), and the rest reloadable.
var reloadClass = []struct {
	key, changed string
	reloadable   bool
}{
	{"binaries", "binaries: {vision: {path: /opt/v}}", true},
	{"inherit_env", "inherit_env: [ANTHROPIC_API_KEY]", true},
	{"run_as", "run_as: {uid: 1500, gid: 1500}", true},
	{"max_concurrent", "max_concurrent: 2", true},
	{"idle_timeout", "idle_timeout: 1m", true},
	{"max_turn_duration", "max_turn_duration: 1h", true},
	{"release_grace", "release_grace: 1s", true},
	{"ready_timeout", "ready_timeout: 2m", true},
	{"session_report_grace", "session_report_grace: 1s", true},
	{"max_claim_body", "max_claim_body: 2097152", true},
	{"console", "console: {allow_remote: true}", true},
	{"agents", "agents: {support: {config: /etc/support.yaml, card: {name: S, description: D, version: \"1\"}}}", true},
	{"pools", "pools: [{name: p, binary: nexus, config_file: /e.yaml, min_idle: 1}]", true},
	{"a2a", "a2a: {tasks: {ttl: 1h}}", false},
	{"listen_addr", `listen_addr: "127.0.0.1:9090"`, false},
	{"advertise_addr", "advertise_addr: broker:8080", false},
	{"state_dir", "state_dir: /var/lib/nexus-broker", false},
	{"broker_id", "broker_id: b1", false},
	{"reattach_window", "reattach_window: 2m", false},
	{"client_replay_buffer_bytes", "client_replay_buffer_bytes: 0", false},
	{"max_client_frame", "max_client_frame: 65536", true},
	{"control_socket", "control_socket: /run/nexus-broker-gateway/control.sock", false},
	{"queue_wait_timeout", "queue_wait_timeout: 1s", true},
	{"max_queue_depth", "max_queue_depth: 1", false},
	{"max_leases_per_principal", "max_leases_per_principal: 1", false},
	{"max_queued_per_principal", "max_queued_per_principal: 1", false},
	{"spawnd", "spawnd: {run_dir: /run/nexus-broker}", false},
	{"tenancy", "tenancy: {uid_range: 200000-200009, homes_dir: /h, sandbox: none}", false},
	{"auth", "auth: {validators: [{type: static, tokens: [{token: t, principal: p}]}]}", false},
	{"cluster", "cluster: {urls: \"nats://127.0.0.1:4222\", secret_env: S}", false},
}

// TestReloadClassCoversEveryKey fails when a key is added to Config without
// deciding whether a SIGHUP applies it.
func TestReloadClassCoversEveryKey(t *testing.T) {
	var classified []string
	for _, k := range reloadClass {
		classified = append(classified, k.key)
	}
	want := append(classified, "nexus_binary_path") // folded into binaries
	got := topKeys(reflect.TypeFor[Config]())
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("Config keys %v\nclassified %v", got, want)
	}
}

// topKeys are the top-level keys of schema t, sorted, with those of an
// inline struct as its own.
func topKeys(t reflect.Type) []string {
	var keys []string
	for f := range t.Fields() {
		name, opts, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		if opts == "inline" {
			keys = append(keys, topKeys(f.Type)...)
		} else if name != "-" {
			keys = append(keys, name)
		}
	}
	slices.Sort(keys)
	return keys
}

// TestGatewayKeys keeps the keys nexus-spawnd tolerates unread equal to
// the gateway's own: a key added to Config but not to core.GatewayKeys
// would make spawnd refuse every file that sets it.
func TestGatewayKeys(t *testing.T) {
	own := map[string]bool{}
	for _, k := range topKeys(reflect.TypeFor[core.Config]()) {
		own[k] = true
	}
	var gateway []string
	for _, k := range topKeys(reflect.TypeFor[Config]()) {
		if !own[k] {
			gateway = append(gateway, k)
		}
	}
	if want := slices.Sorted(slices.Values(core.GatewayKeys)); !slices.Equal(gateway, want) {
		t.Errorf("the gateway's own keys are %v, core.GatewayKeys %v", gateway, want)
	}
}

// reloadBase is written under both sides of a key's case when the change
// alone would not load: agents: profiles need a dialable listen address,
// cluster: a state_dir and an advertise_addr, tenancy: a state_dir.
var reloadBase = map[string]string{"agents": "listen_addr: \"127.0.0.1:8080\"\n", "cluster": "state_dir: /s\nadvertise_addr: \"h:1\"\n", "tenancy": "state_dir: /s\n"}

func TestReloadDiffEachKey(t *testing.T) {
	for _, k := range reloadClass {
		t.Run(k.key, func(t *testing.T) {
			base := mustParse(t, reloadBase[k.key])
			next := mustParse(t, reloadBase[k.key]+k.changed)
			var wantR, wantB []string
			if k.reloadable {
				wantR = []string{k.key}
			} else {
				wantB = []string{k.key}
			}
			// Either direction names the same key.
			for _, pair := range [][2]*Config{{base, next}, {next, base}} {
				r, b := core.ReloadDiff(pair[0], pair[1])
				if !slices.Equal(r, wantR) || !slices.Equal(b, wantB) {
					t.Errorf("ReloadDiff = %v, %v; want %v, %v", r, b, wantR, wantB)
				}
			}
		})
	}
}

func TestReloadDiff(t *testing.T) {
	for _, d := range []struct {
		name, cur, next    string
		reloadable, bootOn []string
	}{
		{"identical", specExample, specExample, nil, nil},
		{"defaults written out equal no file", "", specExample, nil, nil},
		{"warnings ignored", "", "advertise_addr: wss://b:443", nil, []string{"advertise_addr"}},
		{"comments and order do not matter",
			"max_concurrent: 2 # two\nidle_timeout: 1m\n",
			"idle_timeout: 60s\nmax_concurrent: 2\n", nil, nil},
		{"nexus_binary_path folded: same path either way",
			"nexus_binary_path: /usr/local/bin/nexus",
			"binaries:\n  nexus:\n    path: /usr/local/bin/nexus\n", nil, nil},
		{"nexus_binary_path changed is binaries",
			"nexus_binary_path: /a", "nexus_binary_path: /b", []string{"binaries"}, nil},
		{"nexus_binary_path removed is binaries",
			"nexus_binary_path: /a", "", []string{"binaries"}, nil},
		{"entry name whitespace is no change",
			"binaries: {vision: {path: /v}}", "binaries: {\" vision \": {path: /v}}", nil, nil},
		{"empty args is no change",
			"binaries: {v: {path: /v}}", "binaries: {v: {path: /v, args: [], env: {}}}", nil, nil},
		{"entry run_as changed is binaries",
			"binaries: {v: {path: /v, run_as: {uid: 1, gid: 1}}}",
			"binaries: {v: {path: /v, run_as: {uid: 1, gid: 2}}}", []string{"binaries"}, nil},
		{"reattach_window 0 is the default",
			"reattach_window: 60s", "reattach_window: 0", nil, nil},
		{"advertise_addr spelling normalized",
			"advertise_addr: ws://b:80", `advertise_addr: " ws://b:80/ "`, nil, nil},
		{"mixed, in the schema's order",
			"",
			"spawnd: {gateway_uid: 990}\nmax_concurrent: 1\nlisten_addr: \"127.0.0.1:1\"\nbinaries: {v: {path: /v}}\nmax_queue_depth: 1\nidle_timeout: 1s\n",
			[]string{"binaries", "max_concurrent", "idle_timeout"},
			[]string{"listen_addr", "spawnd", "max_queue_depth"}},
		{"the spec's example order",
			"", "auth: {validators: [{type: static, tokens: [{token: t, principal: p}]}]}\nlisten_addr: \"127.0.0.1:1\"\n",
			nil, []string{"listen_addr", "auth"}},
	} {
		t.Run(d.name, func(t *testing.T) {
			r, b := core.ReloadDiff(mustParse(t, d.cur), mustParse(t, d.next))
			if !reflect.DeepEqual(r, d.reloadable) || !reflect.DeepEqual(b, d.bootOn) {
				t.Errorf("ReloadDiff = %v, %v; want %v, %v", r, b, d.reloadable, d.bootOn)
			}
		})
	}
}

func mustParse(t *testing.T, yaml string) *Config {
	t.Helper()
	c, err := Parse([]byte(yaml))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestReloadedTakesOnlyReloadableKeys(t *testing.T) {
	boot, err := Parse([]byte("listen_addr: \"127.0.0.1:1\"\nmax_concurrent: 2\nmax_queue_depth: 5\n"))
	if err != nil {
		t.Fatal(err)
	}
	next, err := Parse([]byte("listen_addr: \"127.0.0.1:2\"\nmax_concurrent: 9\nmax_queue_depth: 7\nidle_timeout: 1m\n"))
	if err != nil {
		t.Fatal(err)
	}
	got := core.Reloaded(boot, next)
	if got.ListenAddr != "127.0.0.1:1" || got.MaxQueueDepth != boot.MaxQueueDepth {
		t.Fatalf("a boot-only key changed: %+v", got)
	}
	if got.MaxConcurrent != 9 || got.IdleTimeout.D().String() != "1m0s" {
		t.Fatalf("a reloadable key was not applied: %+v", got)
	}
	if reloadable, bootOnly := core.ReloadDiff(got, next); len(reloadable) != 0 || strings.Join(bootOnly, ",") != "listen_addr,max_queue_depth" {
		t.Fatalf("after Reloaded, diff = %v / %v", reloadable, bootOnly)
	}
}

// Both processes name a version of the file by the same digest: the
// gateway hands spawnd the digest it validated on every reload.
func TestBothLoadersAgreeOnDigest(t *testing.T) {
	path := filepath.Join(t.TempDir(), "broker.yaml")
	if err := os.WriteFile(path, []byte(specExample), 0o600); err != nil {
		t.Fatal(err)
	}
	gw, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	sp, err := core.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	if gw.Digest == "" || gw.Digest != sp.Digest {
		t.Errorf("the gateway's digest %q, nexus-spawnd's %q", gw.Digest, sp.Digest)
	}
}
