package config

import (
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/config/core"
)

// specExample is the commented listing of "Running the broker".
const specExample = `# broker.yaml
listen_addr: ":8080"          # HTTP/WS gateway bind address
advertise_addr: ""            # address CLIENTS use to reach this broker; required behind a proxy/LB
binaries:                     # named nexus variants this broker may spawn (see below)
  nexus:                      # reserved name; always present, declare it to override the path
    path: "nexus"
# nexus_binary_path: "nexus"  # DEPRECATED alias for binaries.nexus.path; still honoured
max_concurrent: 8             # max live instances; <=0 = unlimited
idle_timeout: 5m              # release a QUIET lease after this much inactivity; <=0 disables
max_turn_duration: 30m        # bound on an in-flight turn, which is otherwise exempt from idle_timeout
queue_wait_timeout: 30s       # how long an over-cap claim waits in the FIFO queue; <=0 = no waiting
max_queue_depth: 64           # how many claims may be PARKED in that queue at once; <=0 = unlimited
max_leases_per_principal: 0   # live leases one authenticated principal may hold; 0 = off
max_queued_per_principal: 0   # queued claims one authenticated principal may hold; 0 = off
release_grace: 10s            # graceful-shutdown grace before SIGTERM, then SIGKILL
ready_timeout: 30s            # ceiling on instance BOOT; raise it for a slow-starting config
session_report_grace: 5s      # post-ready wait for the instance's session id; claim still succeeds if it elapses
max_claim_body: 1048576       # ceiling on the claim request body (1 MiB); it carries the whole config
state_dir: ""                 # per-broker dir for the lease journal; empty = in-memory only
broker_id: ""                 # stamped on every lease record; generated + persisted when empty
reattach_window: 60s          # how long a lease restored after a restart waits for its instance
`

// specRegistryExample is the nexus/vision/pinned listing of "Serving
// several nexus variants".
const specRegistryExample = `# broker.yaml
binaries:
  nexus:                                 # reserved name; declare it only to pin the path
    path: "/usr/local/bin/nexus"

  vision:
    path: "~/builds/nexus-vision"        # ` + "`~`" + ` is expanded
    label: "Nexus (vision)"              # presentational only
    description: "Multimodal build with the image tools compiled in"
    args: ["-profile", "vision"]         # appended AFTER the broker's -config / -recall
    env:
      NEXUS_VISION: "1"                  # layered UNDER the broker's NEXUS_BROKER_* vars

  pinned:
    path: "nexus-0.9"                    # no path separator → looked up on the broker's PATH
    description: "Pinned 0.9 build for regression triage"
`

// specRunAsExample is the listing of "Running instances as another user".
const specRunAsExample = `# broker.yaml
run_as:                          # default for entries that declare none
  uid: 1500
  gid: 1500

binaries:
  vision:
    path: /opt/builds/nexus-vision
    run_as:                      # replaces the default outright — never merged
      uid: 1501
      gid: 1501

  support:
    path: /opt/builds/nexus-support
    run_as:
      uid: 1502
      gid: 1502
    env:
      HOME: /var/lib/nexus/support    # keep this variant's state off a home dir
`

// specEnvExample is the "after" listing of the environment migration.
const specEnvExample = `inherit_env:                     # names only; the values come from the broker's env
  - ANTHROPIC_API_KEY
  - OPENAI_API_KEY
binaries:
  nexus:
    path: /usr/local/bin/nexus
  vision:
    path: /opt/builds/nexus-vision
    env:                         # set outright — a property of this variant
      NEXUS_VISION: "1"
`

const wildcardWarn = `advertise_addr is not set and listen_addr names no host`

func ptr[T any](v T) *T { return &v }

func TestDefaults(t *testing.T) {
	want := Default()
	for _, d := range []struct{ name, yaml string }{
		{"empty file", ""},
		{"comments only", "# broker.yaml\n# listen_addr: \":9090\"\n\n   # indented\n"},
		{"bare document marker", "---\n"},
		{"null document", "~\n"},
	} {
		t.Run(d.name, func(t *testing.T) {
			c, err := Parse([]byte(d.yaml))
			if err != nil {
				t.Fatal(err)
			}
			assertWarnings(t, c, wildcardWarn)
			c.Warnings = nil
			if !reflect.DeepEqual(c, want) {
				t.Errorf("got %+v\nwant the defaults %+v", c, want)
			}
		})
	}
}

// TestDefaultValues pins every default against the spec's broker.yaml
// listing, so a changed constant cannot pass unnoticed.
func TestDefaultValues(t *testing.T) {
	c := Default()
	for _, d := range []struct {
		key       string
		got, want any
	}{
		{"listen_addr", c.ListenAddr, ":8080"},
		{"advertise_addr", c.AdvertiseAddr, ""},
		{"binaries", c.Binaries, map[string]*core.Entry{"nexus": {Path: "nexus"}}},
		{"nexus_binary_path", c.NexusBinaryPath, (*string)(nil)},
		{"max_concurrent", c.MaxConcurrent, 8},
		{"idle_timeout", c.IdleTimeout.D(), 5 * time.Minute},
		{"max_turn_duration", c.MaxTurnDuration.D(), 30 * time.Minute},
		{"queue_wait_timeout", c.QueueWaitTimeout.D(), 30 * time.Second},
		{"max_queue_depth", c.MaxQueueDepth, 64},
		{"max_leases_per_principal", c.MaxLeasesPerPrincipal, 0},
		{"max_queued_per_principal", c.MaxQueuedPerPrincipal, 0},
		{"release_grace", c.ReleaseGrace.D(), 10 * time.Second},
		{"ready_timeout", c.ReadyTimeout.D(), 30 * time.Second},
		{"session_report_grace", c.SessionReportGrace.D(), 5 * time.Second},
		{"max_claim_body", c.MaxClaimBody, core.Size(1048576)},
		{"state_dir", c.StateDir, ""},
		{"broker_id", c.BrokerID, ""},
		{"reattach_window", c.ReattachWindow.D(), 60 * time.Second},
		{"client_replay_buffer_bytes", c.ClientReplayBufferBytes, core.Size(1 << 20)},
		{"max_client_frame", c.MaxClientFrame, core.Size(32768)},
		{"inherit_env", c.InheritEnv, []string(nil)},
		{"run_as", c.RunAs, (*core.RunAs)(nil)},
		{"spawnd", c.Spawnd, core.Spawnd{}},
		{"console", c.Console, Console{}},
	} {
		if !reflect.DeepEqual(d.got, d.want) {
			t.Errorf("%s: default %v, want %v", d.key, d.got, d.want)
		}
	}
}

func TestSpecExample(t *testing.T) {
	c, err := Parse([]byte(specExample))
	if err != nil {
		t.Fatal(err)
	}
	assertWarnings(t, c, wildcardWarn)
	c.Warnings = nil
	if want := Default(); !reflect.DeepEqual(c, want) {
		t.Errorf("the spec's listing states every default, but parsed as\n%+v\nnot\n%+v", c, want)
	}

	// The same listing with every value moved off its default.
	changed := strings.NewReplacer(
		`listen_addr: ":8080"`, `listen_addr: "127.0.0.1:9090"`,
		`advertise_addr: ""`, `advertise_addr: "broker-1.example.com:9090"`,
		`path: "nexus"`, `path: "/opt/nexus"`,
		"max_concurrent: 8", "max_concurrent: 0",
		"idle_timeout: 5m", "idle_timeout: 0",
		"max_turn_duration: 30m", "max_turn_duration: 1h30m",
		"queue_wait_timeout: 30s", "queue_wait_timeout: -1s",
		"max_queue_depth: 64", "max_queue_depth: 3",
		"max_leases_per_principal: 0", "max_leases_per_principal: 2",
		"max_queued_per_principal: 0", "max_queued_per_principal: 4",
		"release_grace: 10s", "release_grace: 1s",
		"ready_timeout: 30s", "ready_timeout: 2m",
		"session_report_grace: 5s", "session_report_grace: 500ms",
		"max_claim_body: 1048576", "max_claim_body: 0x200000",
		`state_dir: ""`, `state_dir: "~/.nexus/broker"`,
		`broker_id: ""`, `broker_id: "b1"`,
		"reattach_window: 60s", "reattach_window: 2m",
	).Replace(specExample)
	c, err = Parse([]byte(changed))
	if err != nil {
		t.Fatal(err)
	}
	assertWarnings(t, c)
	want := &Config{
		Config: core.Config{
			ListenAddr:    "127.0.0.1:9090",
			AdvertiseAddr: "broker-1.example.com:9090",
			Binaries:      map[string]*core.Entry{"nexus": {Path: "/opt/nexus"}},
			ReleaseGrace:  core.Duration(time.Second),
			StateDir:      "~/.nexus/broker",
			BrokerID:      "b1",
			MaxConcurrent: 0,
			MaxClaimBody:  2 << 20,
		},
		IdleTimeout:             0,
		MaxTurnDuration:         core.Duration(90 * time.Minute),
		QueueWaitTimeout:        core.Duration(-time.Second),
		MaxQueueDepth:           3,
		MaxLeasesPerPrincipal:   2,
		MaxQueuedPerPrincipal:   4,
		ReadyTimeout:            core.Duration(2 * time.Minute),
		SessionReportGrace:      core.Duration(500 * time.Millisecond),
		ReattachWindow:          core.Duration(2 * time.Minute),
		ClientReplayBufferBytes: DefaultClientReplayBufferBytes,
		MaxClientFrame:          DefaultMaxClientFrame,
		A2A:                     defaultA2A(),
	}
	if !reflect.DeepEqual(c, want) {
		t.Errorf("got\n%+v\nwant\n%+v", c, want)
	}
}

func TestSpecRegistryExamples(t *testing.T) {
	for _, d := range []struct {
		name, yaml string
		want       *Config
	}{
		{"nexus/vision/pinned", specRegistryExample, &Config{Config: core.Config{Binaries: map[string]*core.Entry{
			"nexus": {Path: "/usr/local/bin/nexus"},
			"vision": {
				Path:        "~/builds/nexus-vision",
				Label:       ptr("Nexus (vision)"),
				Description: ptr("Multimodal build with the image tools compiled in"),
				Args:        []string{"-profile", "vision"},
				Env:         map[string]string{"NEXUS_VISION": "1"},
			},
			"pinned": {Path: "nexus-0.9", Description: ptr("Pinned 0.9 build for regression triage")},
		}}}},
		{"run_as", specRunAsExample, &Config{
			Config: core.Config{
				RunAs: &core.RunAs{UID: ptr(1500), GID: ptr(1500)},
				Binaries: map[string]*core.Entry{
					"nexus":  {Path: "nexus"},
					"vision": {Path: "/opt/builds/nexus-vision", RunAs: &core.RunAs{UID: ptr(1501), GID: ptr(1501)}},
					"support": {
						Path:  "/opt/builds/nexus-support",
						RunAs: &core.RunAs{UID: ptr(1502), GID: ptr(1502)},
						Env:   map[string]string{"HOME": "/var/lib/nexus/support"},
					},
				},
			},
		}},
		{"inherit_env", specEnvExample, &Config{
			Config: core.Config{
				InheritEnv: []string{"ANTHROPIC_API_KEY", "OPENAI_API_KEY"},
				Binaries: map[string]*core.Entry{
					"nexus":  {Path: "/usr/local/bin/nexus"},
					"vision": {Path: "/opt/builds/nexus-vision", Env: map[string]string{"NEXUS_VISION": "1"}},
				},
			},
		}},
		{"nexus_binary_path migration, before", `nexus_binary_path: "/usr/local/bin/nexus"`, &Config{
			Config: core.Config{
				NexusBinaryPath: ptr("/usr/local/bin/nexus"),
				Binaries:        map[string]*core.Entry{"nexus": {Path: "/usr/local/bin/nexus"}},
			},
		}},
		{"nexus_binary_path migration, after", "binaries:\n  nexus:\n    path: \"/usr/local/bin/nexus\"\n", &Config{
			Config: core.Config{
				Binaries: map[string]*core.Entry{"nexus": {Path: "/usr/local/bin/nexus"}},
			},
		}},
	} {
		t.Run(d.name, func(t *testing.T) {
			c, err := Parse([]byte(d.yaml))
			if err != nil {
				t.Fatal(err)
			}
			want := Default()
			want.Binaries = d.want.Binaries
			want.NexusBinaryPath = d.want.NexusBinaryPath
			want.RunAs = d.want.RunAs
			want.InheritEnv = d.want.InheritEnv
			if c.NexusBinaryPath != nil && (len(c.Deprecations) != 1 || c.Deprecations[0] != WarnNexusBinaryPath) {
				t.Errorf("nexus_binary_path written, Deprecations = %q", c.Deprecations)
			}
			c.Warnings, c.Deprecations = nil, nil
			if !reflect.DeepEqual(c, want) {
				t.Errorf("got\n%+v\nwant\n%+v", c, want)
			}
			for name, e := range d.want.Binaries {
				if got := c.EntryRunAs(name); !reflect.DeepEqual(got, firstRunAs(e.RunAs, d.want.RunAs)) {
					t.Errorf("EntryRunAs(%q) = %v", name, got)
				}
			}
		})
	}
}

func firstRunAs(a, b *core.RunAs) *core.RunAs {
	if a != nil {
		return a
	}
	return b
}

// okCases parse; check inspects the result.
var okCases = []struct {
	name, yaml string
	check      func(t *testing.T, c *Config)
}{
	{"reattach_window 0 is the default", "reattach_window: 0", func(t *testing.T, c *Config) {
		wantDuration(t, "reattach_window", c.ReattachWindow, DefaultReattachWindow)
	}},
	{"reattach_window \"0\" is the default", `reattach_window: "0"`, func(t *testing.T, c *Config) {
		wantDuration(t, "reattach_window", c.ReattachWindow, DefaultReattachWindow)
	}},
	{"reattach_window negative is the default", "reattach_window: -5s", func(t *testing.T, c *Config) {
		wantDuration(t, "reattach_window", c.ReattachWindow, DefaultReattachWindow)
	}},
	{"durations", "idle_timeout: 0\nmax_turn_duration: 1h30m\nrelease_grace: \" 2s \"\nsession_report_grace: 1ms", func(t *testing.T, c *Config) {
		wantDuration(t, "idle_timeout", c.IdleTimeout, 0)
		wantDuration(t, "max_turn_duration", c.MaxTurnDuration, 90*time.Minute)
		wantDuration(t, "release_grace", c.ReleaseGrace, 2*time.Second)
		wantDuration(t, "session_report_grace", c.SessionReportGrace, time.Millisecond)
	}},
	{"sizes", "client_replay_buffer_bytes: 0\nmax_claim_body: 1_048_577", func(t *testing.T, c *Config) {
		if c.ClientReplayBufferBytes != 0 || c.MaxClaimBody != 1048577 {
			t.Errorf("client_replay_buffer_bytes %d, max_claim_body %d", c.ClientReplayBufferBytes, c.MaxClaimBody)
		}
	}},
	{"max_client_frame bounds", "max_client_frame: 1", func(t *testing.T, c *Config) {
		if c.MaxClientFrame != 1 {
			t.Errorf("max_client_frame %d, want 1", c.MaxClientFrame)
		}
	}},
	{"max_client_frame at the read limit", "max_client_frame: 16777216", func(t *testing.T, c *Config) {
		if c.MaxClientFrame != 16<<20 {
			t.Errorf("max_client_frame %d, want 16777216", c.MaxClientFrame)
		}
	}},
	{"control_socket", "control_socket: /run/nexus-broker-gateway//control.sock", func(t *testing.T, c *Config) {
		if c.ControlSocket != "/run/nexus-broker-gateway/control.sock" {
			t.Errorf("control_socket %q, want /run/nexus-broker-gateway/control.sock", c.ControlSocket)
		}
	}},
	{"nexus synthesized beside other entries", "binaries:\n  vision:\n    path: /opt/v\n", func(t *testing.T, c *Config) {
		wantEntries(t, c, map[string]string{"nexus": "nexus", "vision": "/opt/v"})
	}},
	{"empty binaries block", "binaries:\n", func(t *testing.T, c *Config) {
		wantEntries(t, c, map[string]string{"nexus": "nexus"})
	}},
	{"entry names trimmed", "binaries:\n  \" vision \":\n    path: /opt/v\n  \"nexus\t\":\n    path: /opt/n\n", func(t *testing.T, c *Config) {
		wantEntries(t, c, map[string]string{"nexus": "/opt/n", "vision": "/opt/v"})
	}},
	{"empty args and env are none", "binaries:\n  v:\n    path: x\n    args: []\n    env: {}\ninherit_env: []\n", func(t *testing.T, c *Config) {
		if e := c.Binaries["v"]; e.Args != nil || e.Env != nil || c.InheritEnv != nil {
			t.Errorf("args %#v env %#v inherit_env %#v, want all nil", e.Args, e.Env, c.InheritEnv)
		}
	}},
	{"empty spawnd block", "spawnd:\n", func(t *testing.T, c *Config) {
		if !reflect.DeepEqual(c.Spawnd, core.Spawnd{}) {
			t.Errorf("spawnd %+v", c.Spawnd)
		}
	}},
	{"spawnd block", "spawnd:\n  run_dir: /run/nexus-broker\n  gateway_uid: 990\n  socket_gid: 0\n", func(t *testing.T, c *Config) {
		want := core.Spawnd{RunDir: "/run/nexus-broker", GatewayUID: ptr(990), SocketGID: ptr(0)}
		if !reflect.DeepEqual(c.Spawnd, want) {
			t.Errorf("spawnd %+v", c.Spawnd)
		}
	}},
	{"console block", "console:\n  allow_remote: true\n", func(t *testing.T, c *Config) {
		if !c.Console.AllowRemote {
			t.Errorf("console %+v", c.Console)
		}
	}},
	{"run_as aliased into an entry", "run_as: &ra {uid: 7, gid: 8}\nbinaries:\n  v:\n    path: x\n    run_as: *ra\n", func(t *testing.T, c *Config) {
		if got := c.EntryRunAs("v").String(); got != "7:8" {
			t.Errorf("binaries.v.run_as = %s", got)
		}
	}},
	{"one alias shared by two entries", "run_as: &ra {uid: 7, gid: 8}\nbinaries:\n  a: {path: x, run_as: *ra}\n  b: {path: y, run_as: *ra}\n", func(t *testing.T, c *Config) {
		if a, b := c.EntryRunAs("a"), c.EntryRunAs("b"); a.String() != "7:8" || b.String() != "7:8" {
			t.Errorf("binaries.a.run_as = %s, binaries.b.run_as = %s", a, b)
		}
	}},
	{"run_as uid 0 and the largest id", "run_as: {uid: 0, gid: 4294967294}", func(t *testing.T, c *Config) {
		if got := c.EntryRunAs("nexus").String(); got != "0:4294967294" {
			t.Errorf("run_as = %s", got)
		}
	}},
	{"advertise bare host:port", "advertise_addr: broker-1.example.com:8080", func(t *testing.T, c *Config) {
		wantAdvertise(t, c, "broker-1.example.com:8080")
	}},
	{"advertise bare IPv6", `advertise_addr: "[2001:db8::1]:8080"`, func(t *testing.T, c *Config) {
		wantAdvertise(t, c, "[2001:db8::1]:8080")
	}},
	{"advertise ws", "advertise_addr: ws://10.0.0.5:8080", func(t *testing.T, c *Config) {
		wantAdvertise(t, c, "ws://10.0.0.5:8080")
	}},
	{"advertise http", "advertise_addr: http://broker:80", func(t *testing.T, c *Config) {
		wantAdvertise(t, c, "http://broker:80")
	}},
	{"advertise trimmed, trailing slash dropped", `advertise_addr: " ws://broker:80/ "`, func(t *testing.T, c *Config) {
		wantAdvertise(t, c, "ws://broker:80")
	}},
	{"advertise wss warns", "advertise_addr: wss://broker-1.example.com:443", func(t *testing.T, c *Config) {
		wantAdvertise(t, c, "wss://broker-1.example.com:443", `advertise_addr names a TLS scheme`)
	}},
	// The spec's own examples leave the port to the scheme.
	{"advertise wss without a port", `advertise_addr: "wss://broker-1.example.com"`, func(t *testing.T, c *Config) {
		wantAdvertise(t, c, "wss://broker-1.example.com", "advertise_addr names a TLS scheme")
	}},
	{"advertise https without a port", `advertise_addr: "https://broker.example"`, func(t *testing.T, c *Config) {
		wantAdvertise(t, c, "https://broker.example", "advertise_addr names a TLS scheme")
	}},
	{"wildcard listen 0.0.0.0 warns", `listen_addr: "0.0.0.0:8080"`, func(t *testing.T, c *Config) {
		assertWarnings(t, c, wildcardWarn)
	}},
	{"wildcard listen [::] warns", `listen_addr: "[::]:8080"`, func(t *testing.T, c *Config) {
		assertWarnings(t, c, wildcardWarn)
	}},
	{"loopback listen does not warn", `listen_addr: "127.0.0.1:0"`, func(t *testing.T, c *Config) {
		assertWarnings(t, c)
	}},
	{"wildcard listen with advertise does not warn", "listen_addr: \":8080\"\nadvertise_addr: broker:8080", func(t *testing.T, c *Config) {
		assertWarnings(t, c)
	}},
	{"integers in hex and with underscores", "max_concurrent: 0x10\nmax_queue_depth: 1_000", func(t *testing.T, c *Config) {
		if c.MaxConcurrent != 16 || c.MaxQueueDepth != 1000 {
			t.Errorf("max_concurrent %d, max_queue_depth %d", c.MaxConcurrent, c.MaxQueueDepth)
		}
	}},
	{"a negative cap is unlimited, reported as 0", "max_concurrent: -5\nmax_queue_depth: -1", func(t *testing.T, c *Config) {
		if c.MaxConcurrent != 0 || c.MaxQueueDepth != 0 {
			t.Errorf("max_concurrent %d, max_queue_depth %d, want 0 and 0", c.MaxConcurrent, c.MaxQueueDepth)
		}
	}},
	{"a label written empty is kept apart from an unset one", "binaries:\n  a:\n    path: x\n    label: \"\"\n    description: \"\"\n  b:\n    path: x\n", func(t *testing.T, c *Config) {
		a, b := c.Binaries["a"], c.Binaries["b"]
		if a.Label == nil || *a.Label != "" || a.Description == nil || *a.Description != "" {
			t.Errorf("entry a (label and description \"\"): label %v, description %v", a.Label, a.Description)
		}
		if b.Label != nil || b.Description != nil {
			t.Errorf("entry b (neither written): label %v, description %v", b.Label, b.Description)
		}
	}},
	{"leading document marker", "---\nmax_concurrent: 2\n", func(t *testing.T, c *Config) {
		if c.MaxConcurrent != 2 {
			t.Errorf("max_concurrent %d", c.MaxConcurrent)
		}
	}},
	{"trailing empty document", "max_concurrent: 2\n---\n", func(t *testing.T, c *Config) {
		if c.MaxConcurrent != 2 {
			t.Errorf("max_concurrent %d", c.MaxConcurrent)
		}
	}},
	{"non-string values for string keys", "broker_id: 42\nbinaries:\n  v:\n    path: x\n    label: true\n    env: {N: 1}\n", func(t *testing.T, c *Config) {
		if e := c.Binaries["v"]; c.BrokerID != "42" || e.Label == nil || *e.Label != "true" || e.Env["N"] != "1" {
			t.Errorf("broker_id %q, label %v, env %v", c.BrokerID, e.Label, e.Env)
		}
	}},
}

func TestParseOK(t *testing.T) {
	for _, tc := range okCases {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Parse([]byte(tc.yaml))
			if err != nil {
				t.Fatal(err)
			}
			tc.check(t, c)
		})
	}
}

// errorCases are refused; key is the key path the error must lead with
// ("" for errors about the file as a whole) and want a phrase it must hold.
var errorCases = []struct{ name, yaml, key, want string }{
	// Unknown keys, at every level.
	{"unknown top-level key", "listen_adr: \":8080\"", "listen_adr", "unknown key; the keys allowed here are a2a, advertise_addr, agents, auth, binaries,"},
	{"unknown entry key", "binaries:\n  vision:\n    path: x\n    pth: y\n", "binaries.vision.pth", "unknown key; the keys allowed here are allow_privilege_escalation, args, cpu_weight, description, env, label, memory_max, path, pids_max, run_as"},
	{"negative pids_max", "binaries:\n  vision:\n    path: x\n    pids_max: -1\n", "binaries.vision.pids_max", "-1 is negative"},
	{"cpu_weight too large", "binaries:\n  vision:\n    path: x\n    cpu_weight: 10001\n", "binaries.vision.cpu_weight", "outside 1..10000"},
	{"unknown entry run_as key", "binaries:\n  vision:\n    path: x\n    run_as: {uid: 1, gid: 1, uidd: 2}\n", "binaries.vision.run_as.uidd", "unknown key; the keys allowed here are gid, uid"},
	{"unknown run_as key", "run_as:\n  uid: 1\n  gid: 1\n  user: nexus\n", "run_as.user", "unknown key"},
	{"unknown spawnd key", "spawnd:\n  run_dri: /run\n", "spawnd.run_dri", "unknown key; the keys allowed here are cgroup_root, gateway_uid, max_config_bytes, max_leases, run_dir, socket_gid"},
	{"unknown console key", "console:\n  allow_remotely: true\n", "console.allow_remotely", "unknown key; the keys allowed here are allow_remote"},
	{"alias reused as another type", "binaries:\n  a: &e {path: a}\n  b: *e\nrun_as: *e\n", "run_as.path", "unknown key; the keys allowed here are gid, uid"},
	{"unknown key in an aliased entry", "binaries:\n  a: &e {path: a, bogus: 1}\n", "binaries.a.bogus", "unknown key"},

	// Durations.
	{"duration without a unit", "idle_timeout: 300", "idle_timeout", `invalid duration "300": want a number with a unit`},
	{"duration in words", "max_turn_duration: 5 minutes", "max_turn_duration", "invalid duration"},
	{"duration as a list", "release_grace: [10s]", "release_grace", "want a duration such as 30s or 5m, got a list"},
	{"duration overflow", "queue_wait_timeout: 9999999999h", "queue_wait_timeout", "invalid duration"},
	{"reattach_window garbage", "reattach_window: soon", "reattach_window", "invalid duration"},
	{"session_report_grace empty", "session_report_grace: \"\"", "session_report_grace", "invalid duration"},

	// ready_timeout.
	{"ready_timeout zero", "ready_timeout: 0", "ready_timeout", "must be positive"},
	{"ready_timeout 0s", "ready_timeout: 0s", "ready_timeout", "must be positive"},
	{"session_report_grace zero", "session_report_grace: 0", "session_report_grace", "must be positive"},
	{"session_report_grace negative", "session_report_grace: -5s", "session_report_grace", "must be positive"},
	{"ready_timeout negative", "ready_timeout: -30s", "ready_timeout", "must be positive"},
	{"ready_timeout unparsable", "ready_timeout: 30", "ready_timeout", "invalid duration"},
	{"ready_timeout empty", "ready_timeout:", "ready_timeout", "has no value"},

	// Sizes.
	{"size negative", "max_claim_body: -1", "max_claim_body", "invalid byte count"},
	{"size with a unit", "client_replay_buffer_bytes: 1MiB", "client_replay_buffer_bytes", "invalid byte count"},
	{"size fractional", "client_replay_buffer_bytes: 1.5", "client_replay_buffer_bytes", "invalid byte count"},
	{"size mapping", "max_claim_body: {bytes: 1}", "max_claim_body", "want a byte count such as 1048576, got a mapping"},
	{"max_claim_body zero", "max_claim_body: 0", "max_claim_body", "must be positive"},
	{"max_client_frame zero", "max_client_frame: 0", "max_client_frame", "must be between 1 and 16777216"},
	{"max_client_frame past the read limit", "max_client_frame: 16777217", "max_client_frame", "must be between 1 and 16777216"},
	{"max_client_frame negative", "max_client_frame: -1", "max_client_frame", "invalid byte count"},

	// control_socket.
	{"control_socket relative", "control_socket: control.sock", "control_socket", `"control.sock" is not an absolute path`},
	{"control_socket too long", "control_socket: /run/" + strings.Repeat("x", 103), "control_socket", "is 108 bytes, over the unix socket limit of 107"},
	{"control_socket a list", "control_socket: [/run/a]", "control_socket", "want a string, got a list"},

	// Integers.
	{"integer fractional", "max_concurrent: 8.5", "max_concurrent", `want a whole number, got "8.5"`},
	{"integer quoted", `max_queue_depth: "64"`, "max_queue_depth", `want a whole number, got the string "64"`},
	{"integer word", "max_leases_per_principal: two", "max_leases_per_principal", "want a whole number"},
	{"integer overflow", "max_queued_per_principal: 99999999999999999999", "max_queued_per_principal", "want a whole number"},
	{"integer beyond int64", "max_concurrent: 0xFFFFFFFFFFFFFFFF", "max_concurrent", `want a whole number, got "0xFFFFFFFFFFFFFFFF"`},
	{"integer list", "max_concurrent: [8]", "max_concurrent", "want a whole number, got a list"},

	// Strings and blocks of the wrong shape.
	{"string as a list", "state_dir: [a]", "state_dir", "want a string, got a list"},
	{"binaries as a list", "binaries:\n  - path: x\n", "binaries", "want a mapping of keys, got a list"},
	{"entry as a string", "binaries:\n  vision: /opt/v\n", "binaries.vision", `want a mapping of keys, got the string "/opt/v"`},
	{"args not a list", "binaries:\n  v:\n    path: x\n    args: -v\n", "binaries.v.args", "want a list"},
	{"args element a mapping", "binaries:\n  v:\n    path: x\n    args: [{a: b}]\n", "binaries.v.args[0]", "want a string, got a mapping"},
	{"env a list", "binaries:\n  v:\n    path: x\n    env: [A]\n", "binaries.v.env", "want a mapping of keys, got a list"},
	{"env value a list", "binaries:\n  v:\n    path: x\n    env: {A: [1]}\n", "binaries.v.env.A", "want a string, got a list"},
	{"spawnd a scalar", "spawnd: /run", "spawnd", "want a mapping of keys"},
	{"inherit_env a string", "inherit_env: ANTHROPIC_API_KEY", "inherit_env", `want a list, got the string "ANTHROPIC_API_KEY"`},

	// Empty values where one was meant.
	{"listen_addr empty", "listen_addr:", "listen_addr", "has no value; give it one, or remove the key"},
	{"entry empty", "binaries:\n  vision:\n", "binaries.vision", "has no value"},
	{"env value empty", "binaries:\n  v:\n    path: x\n    env: {A: ~}\n", "binaries.v.env.A", "has no value"},
	{"inherit_env element empty", "inherit_env: [~]", "inherit_env[0]", "has no value"},

	// nexus_binary_path.
	{"nexus_binary_path with binaries.nexus.path", "nexus_binary_path: /a\nbinaries:\n  nexus:\n    path: /b\n", "nexus_binary_path", "set together with binaries.nexus.path"},
	{"nexus_binary_path with trimmed binaries.nexus", "nexus_binary_path: /a\nbinaries:\n  \" nexus\":\n    path: /b\n", "nexus_binary_path", "set together with binaries.nexus.path"},
	{"nexus_binary_path empty string", `nexus_binary_path: ""`, "nexus_binary_path", `set to ""; remove the key to take the default`},
	{"nexus_binary_path blank", `nexus_binary_path: "   "`, "nexus_binary_path", `set to ""`},
	{"nexus_binary_path null", "nexus_binary_path:", "nexus_binary_path", "has no value"},
	{"nexus_binary_path NUL", `nexus_binary_path: "/a\0b"`, "nexus_binary_path", "NUL"},

	// core.Entry names and paths.
	{"entry names collide after trim", "binaries:\n  vision:\n    path: a\n  \" vision\":\n    path: b\n", "binaries.vision", `" vision" and "vision" are the same name`},
	{"entry name blank", "binaries:\n  \"  \":\n    path: a\n", "binaries", "is empty once whitespace is trimmed"},
	{"entry name null", "binaries:\n  ~:\n    path: a\n", "binaries", "a key must be a plain name"},
	{"entry without path", "binaries:\n  vision:\n    label: V\n", "binaries.vision.path", "required"},
	{"entry with blank path", "binaries:\n  vision:\n    path: \" \"\n", "binaries.vision.path", "required"},
	{"nexus entry without path", "binaries:\n  nexus: {}\n", "binaries.nexus.path", "required"},
	{"entry path NUL", "binaries:\n  v:\n    path: \"a\\0\"\n", "binaries.v.path", "NUL"},
	{"entry arg NUL", "binaries:\n  v:\n    path: a\n    args: [ok, \"b\\0\"]\n", "binaries.v.args[1]", "NUL"},
	{"entry env name with =", "binaries:\n  v:\n    path: a\n    env: {\"A=B\": x}\n", "binaries.v.env", `"A=B" is not an environment variable name`},
	{"entry env value NUL", "binaries:\n  v:\n    path: a\n    env: {A: \"\\0\"}\n", "binaries.v.env.A", "NUL"},

	// run_as, wherever it is written.
	{"run_as uid only", "run_as: {uid: 1500}", "run_as.gid", "required whenever run_as is written"},
	{"run_as gid only", "run_as: {gid: 1500}", "run_as.uid", "required whenever run_as is written"},
	{"run_as empty mapping", "run_as: {}", "run_as.uid", "required"},
	{"run_as empty", "run_as:", "run_as", "has no value"},
	{"run_as negative uid", "run_as: {uid: -1, gid: 1}", "run_as.uid", "-1 is not a usable uid"},
	{"run_as negative gid", "run_as: {uid: 1, gid: -2}", "run_as.gid", "-2 is not a usable gid"},
	{"run_as uid (uid_t)-1", "run_as: {uid: 4294967295, gid: 1}", "run_as.uid", "4294967295 is not a usable uid"},
	{"run_as uid a name", "run_as: {uid: nexus, gid: 1}", "run_as.uid", `want a whole number, got the string "nexus"`},
	{"run_as uid quoted", `run_as: {uid: "1500", gid: 1}`, "run_as.uid", "want a whole number"},
	{"run_as uid null", "run_as: {uid: ~, gid: 1}", "run_as.uid", "has no value"},
	{"run_as a list", "run_as: [1500, 1500]", "run_as", "want a mapping of keys, got a list"},
	{"entry run_as gid missing", "binaries:\n  vision:\n    path: x\n    run_as: {uid: 1501}\n", "binaries.vision.run_as.gid", "required"},
	{"trimmed entry run_as uid missing", "binaries:\n  \" vision \":\n    path: x\n    run_as: {gid: 1501}\n", "binaries.vision.run_as.uid", "required"},
	{"entry run_as negative", "binaries:\n  vision:\n    path: x\n    run_as: {uid: 1, gid: -1}\n", "binaries.vision.run_as.gid", "not a usable gid"},
	{"spawnd gateway_uid negative", "spawnd: {gateway_uid: -1}", "spawnd.gateway_uid", "not a usable uid"},
	{"spawnd socket_gid too large", "spawnd: {socket_gid: 4294967296}", "spawnd.socket_gid", "not a usable gid"},

	// inherit_env.
	{"inherit_env wildcard", `inherit_env: ["*"]`, "inherit_env[0]", "wildcards are not supported"},
	{"inherit_env glob", "inherit_env: [HOME, \"AWS_*\"]", "inherit_env[1]", "wildcards are not supported"},
	{"inherit_env empty name", `inherit_env: [""]`, "inherit_env[0]", "is not an environment variable name"},
	{"inherit_env assignment", `inherit_env: ["A=B"]`, "inherit_env[0]", "is not an environment variable name"},
	{"inherit_env space", `inherit_env: ["A B"]`, "inherit_env[0]", "is not an environment variable name"},

	// advertise_addr and listen_addr.
	{"advertise no port", "advertise_addr: broker-1.example.com", "advertise_addr", "has no port"},
	{"advertise empty port", "advertise_addr: \"broker:\"", "advertise_addr", "has no port"},
	{"advertise scheme empty port", "advertise_addr: \"ws://broker:\"", "advertise_addr", "has no port"},
	{"advertise wildcard 0.0.0.0", `advertise_addr: "0.0.0.0:8080"`, "advertise_addr", "wildcard host"},
	{"advertise wildcard empty host", `advertise_addr: ":8080"`, "advertise_addr", "wildcard host"},
	{"advertise wildcard ::", `advertise_addr: "[::]:8080"`, "advertise_addr", "wildcard host"},
	{"advertise wildcard with scheme", `advertise_addr: "wss://0.0.0.0:443"`, "advertise_addr", "wildcard host"},
	{"advertise scheme without host", `advertise_addr: "ws://"`, "advertise_addr", "wildcard host"},
	{"advertise path", `advertise_addr: "ws://broker:8080/lease"`, "advertise_addr", "carries a path"},
	{"advertise bare path", `advertise_addr: "broker:8080/x"`, "advertise_addr", "carries a path"},
	{"advertise query", `advertise_addr: "https://broker:443?x=1"`, "advertise_addr", "carries a path, query or user"},
	{"advertise user", `advertise_addr: "ws://me@broker:80"`, "advertise_addr", "carries a path, query or user"},
	{"advertise scheme", `advertise_addr: "ftp://broker:21"`, "advertise_addr", `scheme "ftp" is not one of ws, wss, http, https`},
	{"advertise port range", `advertise_addr: "broker:99999"`, "advertise_addr", "not a port number"},
	{"advertise port zero", `advertise_addr: "broker:0"`, "advertise_addr", "not a port number"},
	{"advertise unparsable", `advertise_addr: "broker:http"`, "advertise_addr", "is not host:port"},
	{"listen_addr without port", `listen_addr: "8080"`, "listen_addr", `"8080" is not host:port; write ":8080"`},
	{"listen_addr blank", `listen_addr: ""`, "listen_addr", "is not host:port"},

	// Keys and documents yaml.v3 would otherwise misread.
	{"duplicate top-level key", "max_concurrent: 1\nmax_concurrent: 2\n", "max_concurrent", "written twice (lines 1 and 2)"},
	{"duplicate entry", "binaries:\n  v: {path: a}\n  v: {path: b}\n", "binaries.v", "written twice (lines 2 and 3)"},
	{"merge key", "binaries:\n  v:\n    <<: {path: a}\n", "binaries.v", "merge keys (<<) are not supported"},
	{"non-scalar key", "? [a]\n: 1\n", "(top level)", "a key must be a plain name, not a list"},
	{"alias as a key", "binaries:\n  &k a: {path: x}\n  *k : {path: y}\n", "binaries", "a key must be a plain name, not an alias (*k)"},
	{"binary key", "binaries:\n  !!binary dmlzaW9u: {path: a}\n", "binaries", "a key must be a plain name"},
	{"second document", "max_concurrent: 1\n---\nmax_concurrent: 2\n", "", "line 3: another YAML document starts here"},
	{"third document", "max_concurrent: 1\n---\n---\nmax_concurrent: 2\n", "", "line 4: another YAML document starts here"},
	{"not a mapping", "- listen_addr: \":8080\"\n", "", "the file must be a mapping of keys (listen_addr: …), not a list"},
	{"a scalar", "hello", "", `not the string "hello"`},
	{"invalid YAML", "binaries: [\n", "", "not valid YAML"},
	{"invalid second document", "a: 1\n---\n[\n", "", "not valid YAML"},
	{"tab indentation", "binaries:\n\tv: {path: a}\n", "", "not valid YAML"},
}

func TestParseErrors(t *testing.T) {
	for _, tc := range slices.Concat(errorCases, authErrorCases, poolErrorCases) {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Parse([]byte(tc.yaml))
			if err == nil {
				t.Fatalf("parsed as %+v; want an error naming %q", c, tc.key)
			}
			if c != nil {
				t.Errorf("a Config came back beside the error")
			}
			msg := err.Error()
			prefix := "broker config: "
			if tc.key != "" {
				prefix += tc.key + ": "
			}
			if !strings.HasPrefix(msg, prefix) {
				t.Errorf("error %q\ndoes not start %q", msg, prefix)
			}
			if !strings.Contains(msg, tc.want) {
				t.Errorf("error %q\ndoes not say %q", msg, tc.want)
			}
		})
	}
}

// TestExcessiveAliasing: an alias bomb within the schema (every entry's env
// one aliased mapping) is walked once by the key check, then refused by
// yaml.v3's own expansion limit, still as a broker config error.
func TestExcessiveAliasing(t *testing.T) {
	var b strings.Builder
	b.WriteString("binaries:\n  e: {path: p, env: &env {")
	for i := range 500 {
		fmt.Fprintf(&b, "K%d: v, ", i)
	}
	b.WriteString("}}\n")
	for i := range 500 {
		fmt.Fprintf(&b, "  e%d: {path: p, env: *env}\n", i)
	}
	_, err := Parse([]byte(b.String()))
	if err == nil || !strings.HasPrefix(err.Error(), "broker config: ") || !strings.Contains(err.Error(), "excessive aliasing") {
		t.Errorf("got %v, want a broker config error about excessive aliasing", err)
	}
}

func TestLoad(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "broker.yaml")
	if err := os.WriteFile(path, []byte(specRegistryExample), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	wantEntries(t, c, map[string]string{"nexus": "/usr/local/bin/nexus", "vision": "~/builds/nexus-vision", "pinned": "nexus-0.9"})

	if err := os.WriteFile(path, []byte("ready_timeout: 0\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(path); err == nil || !strings.HasPrefix(err.Error(), "broker config: ready_timeout: ") {
		t.Errorf("Load of a bad file: %v", err)
	}

	missing := filepath.Join(dir, "absent.yaml")
	if _, err := Load(missing); err == nil || !strings.HasPrefix(err.Error(), "broker config: ") || !strings.Contains(err.Error(), missing) {
		t.Errorf("Load of a missing file: %v", err)
	}
}

func TestRunAsString(t *testing.T) {
	if got := (&core.RunAs{UID: ptr(1501), GID: ptr(1502)}).String(); got != "1501:1502" {
		t.Errorf("String() = %q", got)
	}
}

func wantDuration(t *testing.T, key string, got core.Duration, want time.Duration) {
	t.Helper()
	if got.D() != want {
		t.Errorf("%s = %s, want %s", key, got.D(), want)
	}
}

func wantEntries(t *testing.T, c *Config, paths map[string]string) {
	t.Helper()
	got := map[string]string{}
	for name, e := range c.Binaries {
		got[name] = e.Path
	}
	if !reflect.DeepEqual(got, paths) {
		t.Errorf("binaries %v, want %v", got, paths)
	}
}

func wantAdvertise(t *testing.T, c *Config, addr string, warnings ...string) {
	t.Helper()
	if c.AdvertiseAddr != addr {
		t.Errorf("advertise_addr = %q, want %q", c.AdvertiseAddr, addr)
	}
	assertWarnings(t, c, warnings...)
}

// assertWarnings wants exactly one warning per phrase, in order.
func assertWarnings(t *testing.T, c *Config, phrases ...string) {
	t.Helper()
	if len(c.Warnings) != len(phrases) {
		t.Errorf("warnings %q, want %d", c.Warnings, len(phrases))
		return
	}
	for i, p := range phrases {
		if !strings.Contains(c.Warnings[i], p) {
			t.Errorf("warning %q does not say %q", c.Warnings[i], p)
		}
	}
}

// TestDialBack: NEXUS_BROKER_ADDR comes from listen_addr, a wildcard bind
// dialed on loopback; the gateway's reported port is taken only for port 0.
func TestDialBack(t *testing.T) {
	for _, tc := range []struct {
		listen string
		bound  int
		want   string
		err    string
	}{
		{listen: ":8080", want: "ws://127.0.0.1:8080/instance"},
		{listen: ":8080", bound: 8080, want: "ws://127.0.0.1:8080/instance"},
		{listen: "0.0.0.0:8080", want: "ws://127.0.0.1:8080/instance"},
		{listen: "[::]:8080", want: "ws://[::1]:8080/instance"},
		{listen: "10.1.2.3:9000", want: "ws://10.1.2.3:9000/instance"},
		{listen: "localhost:9000", want: "ws://localhost:9000/instance"},
		{listen: "127.0.0.1:0", bound: 41234, want: "ws://127.0.0.1:41234/instance"},
		{listen: "127.0.0.1:0", err: `listen_addr "127.0.0.1:0" asks for any free port, and the gateway reported no port it bound`},
		{listen: ":8080", bound: 9090, err: `the gateway reports listening on port 9090, but listen_addr ":8080" names port 8080`},
		{listen: "127.0.0.1:0", bound: 70000, err: "the gateway reports listening on port 70000, which is no TCP port"},
	} {
		got, err := core.DialBack(tc.listen, tc.bound)
		if got != tc.want || (err == nil) != (tc.err == "") || (err != nil && err.Error() != tc.err) {
			t.Errorf("core.DialBack(%q, %d) = %q, %v; want %q, %q", tc.listen, tc.bound, got, err, tc.want, tc.err)
		}
	}
}

// TestUnknownKeysAllNamed: every unknown key of a file, at every level, is
// named in the one error, ahead of any other mistake, so an operator fixes
// them in one edit rather than one boot attempt each.
func TestUnknownKeysAllNamed(t *testing.T) {
	yaml := "listen_adr: x\nidle_timeout: soon\nbinaries:\n  vision:\n    path: x\n    pth: y\n    run_as: {uid: 1, gid: 1, usr: 2}\nspawnd:\n  run_dri: /run\n"
	_, err := Parse([]byte(yaml))
	if err == nil {
		t.Fatal("parsed a file with four unknown keys")
	}
	msg := err.Error()
	if !strings.HasPrefix(msg, "broker config: 4 unknown keys: ") {
		t.Errorf("error %q does not lead with the count of unknown keys", msg)
	}
	for _, key := range []string{"listen_adr: unknown key", "binaries.vision.pth: unknown key", "binaries.vision.run_as.usr: unknown key", "spawnd.run_dri: unknown key", "idle_timeout: invalid duration"} {
		if !strings.Contains(msg, key) {
			t.Errorf("error %q does not say %q", msg, key)
		}
	}
}
