package auth

import (
	"context"
	"crypto/sha256"
	"errors"

	"github.com/nexus-broker/nexus-broker/internal/config"
)

// static is a token table. Tokens are held by their SHA-256, so a lookup
// compares digests, not the secrets themselves.
type static struct {
	byDigest map[[sha256.Size]byte]Principal
}

func newStatic(v *config.Validator) *static {
	s := &static{byDigest: map[[sha256.Size]byte]Principal{}}
	for _, t := range v.Tokens {
		s.byDigest[sha256.Sum256([]byte(t.Token))] = Principal{ID: t.Principal, Tenant: t.Tenant, Scopes: t.Scopes}
	}
	return s
}

var errUnknownToken = errors.New("static: token not in the table")

func (s *static) validate(_ context.Context, c *Credential) (Principal, error) {
	if c.Bearer == "" {
		return Principal{}, errNotPresented
	}
	if p, ok := s.byDigest[sha256.Sum256([]byte(c.Bearer))]; ok {
		return p, nil
	}
	return Principal{}, errUnknownToken
}
