package auth

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/coreos/go-oidc/v3/oidc"
	jose "github.com/go-jose/go-jose/v4"

	"github.com/nexus-broker/nexus-broker/internal/config"
)

const (
	// The scheduled refresh of a JWKS follows the issuer's Cache-Control
	// max-age, else jwksDefaultRefresh, clamped to
	// [jwksMinRefresh, jwksMaxRefresh]: a key the issuer removes stops
	// verifying within one interval. A failed refresh is retried after
	// jwksMinRefresh.
	jwksDefaultRefresh = 5 * time.Minute
	jwksMinRefresh     = time.Minute
	jwksMaxRefresh     = 24 * time.Hour
	// jwksMissSpacing is the least time between a fetch and one an unknown
	// kid triggers: tokens with random kids cannot force more than one
	// fetch a second.
	jwksMissSpacing = time.Second
	// maxMissedKids bounds the kids remembered as missed.
	maxMissedKids = 4096
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

func newJWKS(v *config.Validator, log *slog.Logger, clk clock) *jwks {
	ks := newKeySet(v.JWKSURL, log, clk)
	for _, a := range v.Algorithms {
		ks.algs = append(ks.algs, jose.SignatureAlgorithm(a))
	}
	j := &jwks{cfg: v, keys: ks, now: clk.now}
	j.verifier = oidc.NewVerifier(v.Issuer, ks, &oidc.Config{
		SkipClientIDCheck:    true, // the audience list is checked below
		SupportedSigningAlgs: v.Algorithms,
		Now:                  func() time.Time { return j.now() },
	})
	// Warm the key cache now, so no request pays for the first fetch, and
	// keep it following the issuer.
	go ks.follow()
	return j
}

func (j *jwks) validate(ctx context.Context, c *Credential) (Principal, error) {
	if c.Bearer == "" {
		return Principal{}, errNotPresented
	}
	now := j.now()
	// A verified token is remembered with the key set it was verified
	// against: a set that changes forgets it, so a removed key's tokens
	// stop with the key.
	gen := j.keys.generation()
	if p, ok := j.cache.get(c.Bearer, now, gen); ok {
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
	j.cache.put(c.Bearer, p, tok.Expiry, now, gen)
	return p, nil
}

func (j *jwks) close() { j.keys.stop() }

// keySet is go-oidc's KeySet over a cached JWKS that follows the issuer: it
// is refetched on the schedule the issuer's Cache-Control gives, and at
// once for an unknown kid unless that kid already missed within the
// interval or any fetch ran within jwksMissSpacing. A cached kid verifies
// without the network, so an unreachable issuer never denies it; a failed
// fetch keeps the set held.
type keySet struct {
	keySource
	clock
	done chan struct{}
	once sync.Once
	heldSet
}

// keySource is where the set is fetched from, and how.
type keySource struct {
	url    string
	algs   []jose.SignatureAlgorithm
	client *http.Client
	log    *slog.Logger
}

// heldSet is the set as last fetched and the fetches' schedule; mu guards
// it.
type heldSet struct {
	mu       sync.Mutex
	keys     []jose.JSONWebKey
	body     []byte               // the set as last fetched, to tell a change
	gen      uint64               // counts changes of the set
	interval time.Duration        // the schedule the last good fetch gave
	last     time.Time            // when the last fetch started
	lastOK   bool                 // whether it succeeded
	missed   map[string]time.Time // kids a fetch did not find, and when
	fetching chan struct{}        // closed when the fetch in flight ends
}

func newKeySet(url string, log *slog.Logger, clk clock) *keySet {
	return &keySet{keySource: keySource{url: url, log: log, client: &http.Client{Timeout: fetchTimeout}},
		clock: clk, done: make(chan struct{}), heldSet: heldSet{interval: jwksDefaultRefresh}}
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
	if !k.fetchForMiss(ctx, kid) {
		return nil, errNoKey
	}
	if payload, ok := k.verify(jws, kid); ok {
		return payload, nil
	}
	k.miss(kid)
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

func (k *keySet) generation() uint64 {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.gen
}

// fetchForMiss fetches the set for a kid it does not hold, or joins the
// fetch in flight; it fetches nothing for a kid that missed within the
// interval, nor within jwksMissSpacing of the last fetch. It reports
// whether a fetch completed for the caller to look at.
func (k *keySet) fetchForMiss(ctx context.Context, kid string) bool {
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
	now := k.now()
	at, missed := k.missed[kid]
	skip := (missed && now.Sub(at) < k.interval) || (!k.last.IsZero() && now.Sub(k.last) < jwksMissSpacing)
	k.mu.Unlock()
	return !skip && k.refresh(ctx)
}

func (k *keySet) currentInterval() time.Duration {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.interval
}

// miss remembers that a fetch did not find kid, within maxMissedKids.
func (k *keySet) miss(kid string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	now := k.now()
	if len(k.missed) >= maxMissedKids {
		for id, at := range k.missed {
			if now.Sub(at) >= k.interval {
				delete(k.missed, id)
			}
		}
		if len(k.missed) >= maxMissedKids {
			clear(k.missed)
		}
	}
	if k.missed == nil {
		k.missed = map[string]time.Time{}
	}
	k.missed[kid] = now
}

// follow fetches the set now and again on its schedule until stop.
func (k *keySet) follow() {
	for {
		wait := jwksMinRefresh
		if k.refresh(context.Background()) {
			wait = k.currentInterval()
		}
		select {
		case <-k.after(wait):
		case <-k.done:
			return
		}
	}
}

func (k *keySet) stop() { k.once.Do(func() { close(k.done) }) }

// refresh fetches the set now (or joins the fetch in flight); a failure
// keeps the keys already held. It reports whether a fetch succeeded.
func (k *keySet) refresh(ctx context.Context) bool {
	k.mu.Lock()
	if ch := k.fetching; ch != nil {
		k.mu.Unlock()
		<-ch
		k.mu.Lock()
		defer k.mu.Unlock()
		return k.lastOK
	}
	ch := make(chan struct{})
	k.fetching = ch
	k.last = k.now()
	k.mu.Unlock()

	keys, body, interval, err := k.fetch(context.WithoutCancel(ctx))
	k.mu.Lock()
	changed := err == nil && !bytes.Equal(body, k.body)
	if changed {
		k.keys, k.body = keys, body
		k.gen++
	}
	if err == nil {
		k.interval = interval
	}
	k.lastOK = err == nil
	k.fetching = nil
	k.mu.Unlock()
	close(ch)
	if changed {
		kids := make([]string, len(keys))
		for i, key := range keys {
			kids[i] = key.KeyID
		}
		k.log.Info("jwks key set changed", "jwks_url", k.url, "kids", kids, "next_refresh", interval)
	}
	if err != nil {
		k.log.Warn("fetching the jwks validator's key set failed; keys already cached keep verifying, unknown kids are denied",
			"jwks_url", k.url, "error", err)
		return false
	}
	return true
}

// refreshInterval is the schedule a JWKS answer asks for: its
// Cache-Control max-age, else jwksDefaultRefresh, clamped to
// [jwksMinRefresh, jwksMaxRefresh].
func refreshInterval(h http.Header) time.Duration {
	d := jwksDefaultRefresh
	for _, dir := range strings.Split(strings.Join(h.Values("Cache-Control"), ","), ",") {
		name, val, _ := strings.Cut(strings.TrimSpace(dir), "=")
		if !strings.EqualFold(name, "max-age") {
			continue
		}
		if secs, err := strconv.ParseInt(strings.Trim(val, `"`), 10, 64); err == nil && secs >= 0 {
			d = time.Duration(min(secs, int64(jwksMaxRefresh/time.Second))) * time.Second
		}
		break
	}
	return min(max(d, jwksMinRefresh), jwksMaxRefresh)
}

// fetchOK sends req and returns the body of a 200, bounded by
// maxFetchBody, and its header; any other answer is an error naming it.
func fetchOK(client *http.Client, req *http.Request) ([]byte, http.Header, error) {
	resp, err := client.Do(req)
	if err != nil {
		return nil, nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxFetchBody))
	if err != nil {
		return nil, nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, nil, fmt.Errorf("%s answered %s", req.URL.Redacted(), resp.Status)
	}
	return body, resp.Header, nil
}

// fetch gets the set, its bytes and the refresh interval its answer asks
// for.
func (k *keySet) fetch(ctx context.Context) ([]jose.JSONWebKey, []byte, time.Duration, error) {
	ctx, cancel := context.WithTimeout(ctx, fetchTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, k.url, nil)
	if err != nil {
		return nil, nil, 0, err
	}
	body, h, err := fetchOK(k.client, req)
	if err != nil {
		return nil, nil, 0, err
	}
	var set jose.JSONWebKeySet
	if err := json.Unmarshal(body, &set); err != nil {
		return nil, nil, 0, fmt.Errorf("%s is not a JWKS: %w", k.url, err)
	}
	return set.Keys, body, refreshInterval(h), nil
}
