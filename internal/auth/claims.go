package auth

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"time"
)

// claimsPrincipal maps a token's claims to a principal. The principal claim
// must be a non-empty string or number: anything else would bind lease
// ownership to something that is not an identifier.
func claimsPrincipal(claims map[string]json.RawMessage, principalClaim, tenantClaim, scopesClaim string) (Principal, error) {
	id, ok := scalar(claims[principalClaim])
	if !ok || id == "" {
		return Principal{}, fmt.Errorf("the principal claim %q is absent, empty or not a scalar", principalClaim)
	}
	p := Principal{ID: id}
	if tenantClaim != "" {
		p.Tenant, _ = scalar(claims[tenantClaim])
	}
	if scopesClaim != "" {
		p.Scopes = scopes(claims[scopesClaim])
	}
	return p, nil
}

// scalar reads a JSON string or number as text.
func scalar(raw json.RawMessage) (string, bool) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 {
		return "", false
	}
	switch raw[0] {
	case '"':
		var s string
		if json.Unmarshal(raw, &s) != nil {
			return "", false
		}
		return s, true
	case '-', '0', '1', '2', '3', '4', '5', '6', '7', '8', '9':
		var n json.Number
		if json.Unmarshal(raw, &n) != nil {
			return "", false
		}
		return n.String(), true
	}
	return "", false
}

// scopes reads a space-separated string (scope) or an array of strings
// (scp).
func scopes(raw json.RawMessage) []string {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return strings.Fields(s)
	}
	var l []string
	if json.Unmarshal(raw, &l) == nil {
		return l
	}
	return nil
}

// maxCachedTokens bounds a validator's cache of verified tokens.
const maxCachedTokens = 4096

// tokenCache remembers verified tokens until their expiry, so a warm
// credential costs a map lookup, not a signature check or a round trip.
type tokenCache struct {
	mu sync.Mutex
	m  map[string]cachedToken
}

type cachedToken struct {
	p     Principal
	until time.Time
	gen   uint64
}

// get is tok's principal if it was put with generation gen and has not
// expired; the generation is what it was verified against (a key set's),
// 0 where nothing changes under it.
func (c *tokenCache) get(tok string, now time.Time, gen uint64) (Principal, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.m[tok]
	if !ok {
		return Principal{}, false
	}
	if !now.Before(e.until) || e.gen != gen {
		delete(c.m, tok)
		return Principal{}, false
	}
	return e.p, true
}

func (c *tokenCache) put(tok string, p Principal, until time.Time, now time.Time, gen uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		c.m = map[string]cachedToken{}
	}
	if len(c.m) >= maxCachedTokens {
		for k, e := range c.m {
			if !now.Before(e.until) || e.gen != gen {
				delete(c.m, k)
			}
		}
		if len(c.m) >= maxCachedTokens {
			clear(c.m)
		}
	}
	c.m[tok] = cachedToken{p, until, gen}
}
