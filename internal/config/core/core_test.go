package core

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// spawnd reads a file holding every gateway section, even ones the gateway
// would refuse: their mistakes are the gateway's to report.
func TestParseToleratesGatewaySections(t *testing.T) {
	c, err := Parse([]byte(`
state_dir: /var/lib/nexus-broker
max_queue_depth: "many"
idle_timeout: {not: a duration}
auth: {validators: [{type: bogus, whatever: 1}]}
agents: {"bad name!": {}}
a2a: {tasks: {ttl: -1s, unknown: 2}}
console: [1, 2]
`))
	if err != nil {
		t.Fatal(err)
	}
	if c.StateDir != "/var/lib/nexus-broker" || c.Binaries[ReservedEntry] == nil {
		t.Errorf("got %+v", c)
	}
}

// Unknown keys of spawnd's own schema are named together, at every level,
// beside the first other mistake.
func TestParseNamesEveryUnknownKey(t *testing.T) {
	_, err := Parse([]byte(`
stat_dir: /x
release_grace: soon
binaries: {v: {path: /v, pat: 1, run_as: {uid: 1, gid: 1, gdi: 2}}}
spawnd: {run_dri: /run/x}
`))
	if err == nil {
		t.Fatal("no error")
	}
	for _, want := range []string{"broker config: 4 unknown keys", "stat_dir: unknown key", "binaries.v.pat: unknown key",
		"binaries.v.run_as.gdi: unknown key", "spawnd.run_dri: unknown key", "release_grace: invalid duration", "allowed here are a2a, advertise_addr, agents, auth, binaries,"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q:\n%v", want, err)
		}
	}
}

func TestLoadDigest(t *testing.T) {
	path := filepath.Join(t.TempDir(), "broker.yaml")
	data := []byte("state_dir: /s\nauth: {validators: []}\n")
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	// sha256sum of the bytes above.
	if want := "9e3e3929b80222a02213ad0b8fdaf358e91e76159b578deb725e053aeecdd2f9"; c.Digest != want {
		t.Errorf("digest %s, want %s", c.Digest, want)
	}
}

// spawnd's own bounds default from the gateway's caps, and are its own
// when written.
func TestSpawndLimitDefaults(t *testing.T) {
	for _, tc := range []struct {
		yaml        string
		leases      int
		configBytes int64
	}{
		{"", 2 * DefaultMaxConcurrent, 2 * DefaultMaxConcurrent * DefaultMaxClaimBody},
		{"max_concurrent: 0\n", UnlimitedMaxLeases, UnlimitedMaxLeases * DefaultMaxClaimBody},
		{"max_concurrent: -3\nmax_claim_body: 10\n", UnlimitedMaxLeases, UnlimitedMaxLeases * 10},
		{"max_concurrent: 5\nspawnd: {max_leases: 3}\n", 3, 3 * DefaultMaxClaimBody},
		{"spawnd: {max_config_bytes: 99}\n", 2 * DefaultMaxConcurrent, 99},
	} {
		c, err := Parse([]byte(tc.yaml))
		if err != nil {
			t.Fatalf("%q: %v", tc.yaml, err)
		}
		if c.Leases() != tc.leases || c.ConfigBytes() != tc.configBytes {
			t.Errorf("%q: max_leases %d, max_config_bytes %d; want %d, %d", tc.yaml, c.Leases(), c.ConfigBytes(), tc.leases, tc.configBytes)
		}
	}
	for yaml, key := range map[string]string{"spawnd: {max_leases: 0}\n": "spawnd.max_leases", "spawnd: {max_config_bytes: 0}\n": "spawnd.max_config_bytes"} {
		if _, err := Parse([]byte(yaml)); err == nil || !strings.Contains(err.Error(), key+": must be positive") {
			t.Errorf("%q: %v, want an error naming %s", yaml, err, key)
		}
	}
}
