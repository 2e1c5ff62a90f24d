package spawnproof

import (
	"crypto/sha256"
	"strings"
	"testing"
)

func TestMatches(t *testing.T) {
	secret := strings.Repeat("ab", 32)
	v := Of(secret)
	if len(v) != Size {
		t.Fatalf("verifier of %d bytes, want %d", len(v), Size)
	}
	if plain := sha256.Sum256([]byte(secret)); string(plain[:]) == string(v) {
		t.Fatal("the verifier is the secret's bare SHA-256: no domain separation")
	}
	for _, c := range []struct {
		name     string
		verifier []byte
		secret   string
		want     bool
	}{
		{"its secret", v, secret, true},
		{"another secret", v, strings.Repeat("ab", 31) + "ac", false},
		{"no secret", v, "", false},
		{"the verifier as the secret", v, string(v), false},
		{"no verifier", nil, secret, false},
		{"no verifier, no secret", nil, "", false},
		{"a short verifier", v[:16], secret, false},
		{"zero verifier", make([]byte, Size), secret, false},
	} {
		if got := Matches(c.verifier, c.secret); got != c.want {
			t.Errorf("%s: Matches = %v, want %v", c.name, got, c.want)
		}
	}
}

// TestUnknownCostsWhatWrongDoes: a check against no verifier allocates what
// one against a live lease's does (nothing), so it runs the same code.
func TestUnknownCostsWhatWrongDoes(t *testing.T) {
	v, secret := Of("x"), strings.Repeat("0", 64)
	live := testing.AllocsPerRun(100, func() { Matches(v, secret) })
	unknown := testing.AllocsPerRun(100, func() { Matches(nil, secret) })
	if live != unknown {
		t.Fatalf("a check allocates %v against a live verifier, %v against none", live, unknown)
	}
}
