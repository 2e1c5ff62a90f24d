package core

import (
	"strings"
	"testing"
)

// Each mistake in tenancy: is a boot error naming its key.
func TestTenancyConfigErrors(t *testing.T) {
	const ok = "state_dir: /s\ntenancy: {uid_range: 200000-265535, homes_dir: /var/lib/h, sandbox: strict}\n"
	c, err := Parse([]byte(ok))
	if err != nil {
		t.Fatal(err)
	}
	if lo, hi := c.Tenancy.Range(); lo != 200000 || hi != 265535 {
		t.Errorf("Range = %d-%d", lo, hi)
	}
	for _, tc := range []struct{ yaml, want string }{
		{"state_dir: /s\ntenancy: {uid_range: 200000, homes_dir: /h, sandbox: none}", `tenancy.uid_range: "200000" is not lo-hi`},
		{"state_dir: /s\ntenancy: {uid_range: a-b, homes_dir: /h, sandbox: none}", `tenancy.uid_range: "a-b" is not lo-hi`},
		{"state_dir: /s\ntenancy: {uid_range: 300-200, homes_dir: /h, sandbox: none}", "tenancy.uid_range: \"300-200\" has lo > hi"},
		{"state_dir: /s\ntenancy: {uid_range: 0-200, homes_dir: /h, sandbox: none}", "tenancy.uid_range: starts at 0"},
		{"state_dir: /s\ntenancy: {uid_range: 1-4294967295, homes_dir: /h, sandbox: none}", "tenancy.uid_range: \"1-4294967295\" ends past"},
		{"state_dir: /s\ntenancy: {uid_range: 1-2, homes_dir: homes, sandbox: none}", `tenancy.homes_dir: "homes" is not an absolute path`},
		{"state_dir: /s\ntenancy: {uid_range: 1-2, homes_dir: /h}", `tenancy.sandbox: "" is neither none nor strict`},
		{"state_dir: /s\ntenancy: {uid_range: 1-2, homes_dir: /h, sandbox: loose}", `tenancy.sandbox: "loose" is neither`},
		{"tenancy: {uid_range: 1-2, homes_dir: /h, sandbox: none}", "tenancy: needs state_dir"},
		{"state_dir: /s\nrun_as: {uid: 5, gid: 5}\ntenancy: {uid_range: 1-2, homes_dir: /h, sandbox: none}", "tenancy: cannot go with run_as"},
		{"state_dir: /s\nbinaries: {v: {path: /v, run_as: {uid: 5, gid: 5}}}\ntenancy: {uid_range: 1-2, homes_dir: /h, sandbox: none}", "tenancy: cannot go with binaries.v.run_as"},
	} {
		if _, err := Parse([]byte(tc.yaml)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: %v, want %q", tc.yaml, err, tc.want)
		}
	}
}
