package auth

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"

	"github.com/nexus-broker/nexus-broker/internal/config"
)

// static is a token table. Tokens are held by their SHA-256, so a lookup
// compares digests, not the secrets themselves.
type static struct {
	byDigest map[[sha256.Size]byte]Principal
}

func newStatic(i int, v *config.Validator) (*static, error) {
	s := &static{byDigest: map[[sha256.Size]byte]Principal{}}
	seen := map[[sha256.Size]byte]int{}
	for j, t := range v.Tokens {
		tok, err := config.ResolveSecret(config.TokenPath(i, j), "token", t.Token, t.TokenEnv)
		if err != nil {
			return nil, err
		}
		d := sha256.Sum256([]byte(tok))
		if k, dup := seen[d]; dup {
			return nil, fmt.Errorf("broker config: %s: the same token as %s; one token names one principal, so remove or change one",
				config.TokenPath(i, j), config.TokenPath(i, k))
		}
		seen[d] = j
		s.byDigest[d] = Principal{ID: t.Principal, Tenant: t.Tenant, Scopes: t.Scopes}
	}
	return s, nil
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
