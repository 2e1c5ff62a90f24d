package auth

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/coreos/go-oidc/v3/oidc"
	jose "github.com/go-jose/go-jose/v4"

	"github.com/nexus-broker/nexus-broker/internal/config"
)

const (
	// jwksRefetchInterval is the least time between two JWKS fetches: an
	// unknown kid triggers at most one fetch per interval, so a flood of
	// forged kids cannot turn into a flood against the issuer.
	jwksRefetchInterval = 10 * time.Second
	// fetchTimeout bounds one JWKS fetch or introspection call.
	fetchTimeout = 5 * time.Second
	// maxFetchBody bounds what is read of a JWKS or introspection answer.
	maxFetchBody = 1 << 20
)

// jwks verifies OIDC access tokens against an explicit jwks_url with
// go-oidc, checking the audience list itself (go-oidc checks one).
type jwks struct {
	cfg      *config.Validator
	verifier *oidc.IDTokenVerifier
	keys     *keySet
	cache    tokenCache
	now      func() time.Time
}

func newJWKS(v *config.Validator, log *slog.Logger) *jwks {
	ks := &keySet{url: v.JWKSURL, log: log, interval: jwksRefetchInterval, client: &http.Client{Timeout: fetchTimeout}}
	for _, a := range v.Algorithms {
		ks.algs = append(ks.algs, jose.SignatureAlgorithm(a))
	}
	j := &jwks{cfg: v, keys: ks, now: time.Now}
	j.verifier = oidc.NewVerifier(v.Issuer, ks, &oidc.Config{
		SkipClientIDCheck:    true, // the audience list is checked below
		SupportedSigningAlgs: v.Algorithms,
		Now:                  func() time.Time { return j.now() },
	})
	// Warm the key cache now, so no request pays for the first fetch.
	go ks.refresh(context.Background())
	return j
}

func (j *jwks) validate(ctx context.Context, c *Credential) (Principal, error) {
	if c.Bearer == "" {
		return Principal{}, errNotPresented
	}
	now := j.now()
	if p, ok := j.cache.get(c.Bearer, now); ok {
		return p, nil
	}
	tok, err := j.verifier.Verify(ctx, c.Bearer)
	if err != nil {
		return Principal{}, fmt.Errorf("jwks: %w", err)
	}
	if !anyOf(tok.Audience, j.cfg.Audience) {
		return Principal{}, fmt.Errorf("jwks: token audience %q is none of %q", tok.Audience, []string(j.cfg.Audience))
	}
	var claims map[string]json.RawMessage
	if err := tok.Claims(&claims); err != nil {
		return Principal{}, fmt.Errorf("jwks: %w", err)
	}
	p, err := claimsPrincipal(claims, j.cfg.PrincipalClaim, j.cfg.TenantClaim, j.cfg.ScopesClaim)
	if err != nil {
		return Principal{}, fmt.Errorf("jwks: %w", err)
	}
	j.cache.put(c.Bearer, p, tok.Expiry, now)
	return p, nil
}

// keySet is go-oidc's KeySet over a cached JWKS: a cached kid verifies
// without the network, so an unreachable issuer never denies it; an
// unknown kid refetches, at most once per interval, and is denied if the
// fresh set does not hold it either.
type keySet struct {
	url      string
	algs     []jose.SignatureAlgorithm
	client   *http.Client
	log      *slog.Logger
	interval time.Duration

	mu       sync.Mutex
	keys     []jose.JSONWebKey
	last     time.Time     // the last fetch attempt
	fetching chan struct{} // closed when the fetch in flight ends
}

var errNoKey = errors.New("no key in the issuer's JWKS matches the token's kid")

// VerifySignature implements oidc.KeySet.
func (k *keySet) VerifySignature(ctx context.Context, raw string) ([]byte, error) {
	jws, err := jose.ParseSignedCompact(raw, k.algs)
	if err != nil {
		return nil, err
	}
	if len(jws.Signatures) != 1 {
		return nil, errors.New("want exactly one signature")
	}
	kid := jws.Signatures[0].Header.KeyID
	if payload, ok := k.verify(jws, kid); ok {
		return payload, nil
	}
	if !k.refetch(ctx) {
		return nil, errNoKey
	}
	if payload, ok := k.verify(jws, kid); ok {
		return payload, nil
	}
	return nil, errNoKey
}

func (k *keySet) verify(jws *jose.JSONWebSignature, kid string) ([]byte, bool) {
	k.mu.Lock()
	keys := k.keys
	k.mu.Unlock()
	for _, key := range keys {
		if kid != "" && key.KeyID != kid {
			continue
		}
		if payload, err := jws.Verify(key.Key); err == nil {
			return payload, true
		}
	}
	return nil, false
}

// refetch fetches the set again unless one was fetched within the
// interval; a caller arriving during a fetch waits for it. It reports
// whether a fetch completed for this caller to look at.
func (k *keySet) refetch(ctx context.Context) bool {
	k.mu.Lock()
	if ch := k.fetching; ch != nil {
		k.mu.Unlock()
		select {
		case <-ch:
			return true
		case <-ctx.Done():
			return false
		}
	}
	if !k.last.IsZero() && time.Since(k.last) < k.interval {
		k.mu.Unlock()
		return false
	}
	k.mu.Unlock()
	return k.refresh(ctx)
}

// refresh fetches the set now (or joins the fetch in flight); a failure
// keeps the keys already held.
func (k *keySet) refresh(ctx context.Context) bool {
	k.mu.Lock()
	if ch := k.fetching; ch != nil {
		k.mu.Unlock()
		<-ch
		return true
	}
	ch := make(chan struct{})
	k.fetching = ch
	k.last = time.Now()
	k.mu.Unlock()

	keys, err := k.fetch(context.WithoutCancel(ctx))
	k.mu.Lock()
	if err == nil {
		k.keys = keys
	}
	k.fetching = nil
	k.mu.Unlock()
	close(ch)
	if err != nil {
		k.log.Warn("fetching the jwks validator's key set failed; keys already cached keep verifying, unknown kids are denied",
			"jwks_url", k.url, "error", err)
		return false
	}
	return true
}

// fetchOK sends req and returns the body of a 200, bounded by
// maxFetchBody; any other answer is an error naming it.
func fetchOK(client *http.Client, req *http.Request) ([]byte, error) {
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxFetchBody))
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s answered %s", req.URL.Redacted(), resp.Status)
	}
	return body, nil
}

func (k *keySet) fetch(ctx context.Context) ([]jose.JSONWebKey, error) {
	ctx, cancel := context.WithTimeout(ctx, fetchTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, k.url, nil)
	if err != nil {
		return nil, err
	}
	body, err := fetchOK(k.client, req)
	if err != nil {
		return nil, err
	}
	var set jose.JSONWebKeySet
	if err := json.Unmarshal(body, &set); err != nil {
		return nil, fmt.Errorf("%s is not a JWKS: %w", k.url, err)
	}
	return set.Keys, nil
}
