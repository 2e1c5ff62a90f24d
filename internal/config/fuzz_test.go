package config

import (
	"reflect"
	"strings"
	"testing"

	"github.com/nexus-broker/nexus-broker/internal/config/core"
)

// FuzzParse holds Parse to its contract on any input: no panic; every
// error starts "broker config: "; every success has the reserved entry, a
// positive ready_timeout and reattach_window, a path on every entry, and
// pools of unique names, known entries, positive min_idle and max_age;
// and nexus-spawnd's loader (core.Parse) holds to the same contract and
// reads every file the gateway accepts, to the same values of its keys.
func FuzzParse(f *testing.F) {
	for _, s := range []string{"", specExample, specRegistryExample, specRunAsExample, specEnvExample, specAuthExample, specProxyExample} {
		f.Add(s)
	}
	for _, tc := range okCases {
		f.Add(tc.yaml)
	}
	for _, tc := range errorCases {
		f.Add(tc.yaml)
	}
	for _, tc := range authErrorCases {
		f.Add(tc.yaml)
	}
	// Inline pools: and warm: only: Parse reads no config_file (Load does).
	for _, tc := range poolErrorCases {
		f.Add(tc.yaml)
	}
	f.Add(specPoolsExample)
	for _, k := range reloadClass {
		f.Add(k.changed)
	}
	f.Fuzz(func(t *testing.T, data string) {
		own, ownErr := core.Parse([]byte(data))
		if ownErr != nil && (own != nil || !strings.HasPrefix(ownErr.Error(), "broker config: ")) {
			t.Errorf("nexus-spawnd's loader: %v (and %v)", ownErr, own)
		}
		c, err := Parse([]byte(data))
		if err != nil {
			if c != nil {
				t.Errorf("a Config came back beside %v", err)
			}
			if !strings.HasPrefix(err.Error(), "broker config: ") {
				t.Errorf("error %q does not start \"broker config: \"", err)
			}
			return
		}
		if e := c.Binaries[core.ReservedEntry]; e == nil {
			t.Errorf("no %q entry in %v", core.ReservedEntry, c.Binaries)
		}
		for name, e := range c.Binaries {
			if name != strings.TrimSpace(name) || name == "" || e == nil || strings.TrimSpace(e.Path) == "" {
				t.Errorf("entry %q is %+v", name, e)
			}
		}
		if c.ReadyTimeout <= 0 {
			t.Errorf("ready_timeout %s", c.ReadyTimeout.D())
		}
		if c.ReattachWindow <= 0 {
			t.Errorf("reattach_window %s", c.ReattachWindow.D())
		}
		names := map[string]bool{}
		for _, p := range c.AllPools() {
			if names[p.Name] || p.MinIdle < 1 || p.MaxAge <= 0 || c.Binaries[p.Binary] == nil || p.Config != nil {
				t.Errorf("pool %+v (Parse reads no config_file)", p)
			}
			names[p.Name] = true
		}
		if ownErr != nil {
			t.Fatalf("the gateway accepts the file, nexus-spawnd refuses it: %v", ownErr)
		}
		if !reflect.DeepEqual(*own, c.Config) {
			t.Errorf("nexus-spawnd reads\n%+v\nthe gateway\n%+v", *own, c.Config)
		}
		// A parsed config has nothing to reload against itself.
		if r, b := core.ReloadDiff(c, c); r != nil || b != nil {
			t.Errorf("ReloadDiff with itself = %v, %v", r, b)
		}
	})
}
