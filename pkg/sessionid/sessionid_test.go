package sessionid

import (
	"strings"
	"testing"
)

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		id string
		ok bool
	}{
		{"0123456789abcdef0123456789abcdef", true}, // what a stock nexus mints
		{"a", true},
		{"A.b_c-d", true},
		{"_x", true},
		{strings.Repeat("a", MaxLen), true},
		{"", false},
		{"-h", false},
		{".hidden", false},
		{"..", false},
		{"../..", false},
		{"a/b", false},
		{"a\nb", false},
		{"a b", false},
		{"a\x00b", false},
		{"é", false},
		{strings.Repeat("a", MaxLen+1), false},
	} {
		err := Validate(tc.id)
		if (err == nil) != tc.ok {
			t.Errorf("Validate(%q) = %v, want ok=%v", tc.id, err, tc.ok)
		}
		if err != nil && !strings.Contains(err.Error(), Rule) {
			t.Errorf("Validate(%q) = %q does not name the rule", tc.id, err)
		}
	}
	// A hostile id is not echoed whole.
	if err := Validate(strings.Repeat("x", 1<<20)); len(err.Error()) > 200 {
		t.Errorf("a 1 MiB id gave a %d-byte error", len(err.Error()))
	}
}

func FuzzValidate(f *testing.F) {
	for _, s := range []string{"abc", "-h", "a/b", "../..", "a\nb", strings.Repeat("z", 129)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, id string) {
		if Validate(id) != nil {
			return
		}
		if len(id) == 0 || len(id) > MaxLen || strings.ContainsAny(id, "/\\\x00\n ") || id[0] == '-' || id[0] == '.' {
			t.Fatalf("Validate accepted %q", id)
		}
	})
}
