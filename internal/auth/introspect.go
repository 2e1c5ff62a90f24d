package auth

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/config"
)

// introspect asks an RFC 7662 endpoint about each token it has not seen
// active recently.
type introspect struct {
	cfg    *config.Validator
	secret string
	client *http.Client
	log    *slog.Logger
	cache  tokenCache
	now    func() time.Time
}

func newIntrospect(i int, v *config.Validator, log *slog.Logger, clk clock) (*introspect, error) {
	secret, err := config.ResolveSecret(config.ValidatorPath(i), "client_secret", v.ClientSecret, v.ClientSecretEnv)
	if err != nil {
		return nil, err
	}
	return &introspect{cfg: v, secret: secret, client: &http.Client{Timeout: fetchTimeout}, log: log, now: clk.now}, nil
}

func (v *introspect) validate(ctx context.Context, c *Credential) (Principal, error) {
	if c.Bearer == "" {
		return Principal{}, errNotPresented
	}
	now := v.now()
	if p, ok := v.cache.get(c.Bearer, now, 0); ok {
		return p, nil
	}
	claims, err := v.ask(ctx, c.Bearer)
	if err != nil {
		v.log.Warn("the introspect validator could not reach its endpoint; answering 503 until it can",
			"endpoint", v.cfg.Endpoint, "error", err)
		return Principal{}, fmt.Errorf("introspect: %w: %v", errUnavailable, err)
	}
	var active bool
	if json.Unmarshal(claims["active"], &active) != nil || !active {
		return Principal{}, fmt.Errorf("introspect: token is not active")
	}
	if err := checkAudience(claims["aud"], v.cfg.Audience); err != nil {
		return Principal{}, fmt.Errorf("introspect: %w", err)
	}
	until := now.Add(v.cfg.CacheTTL.D())
	if e, ok := scalar(claims["exp"]); ok {
		if secs, err := json.Number(e).Int64(); err == nil {
			expAt := time.Unix(secs, 0)
			if !now.Before(expAt) {
				return Principal{}, fmt.Errorf("introspect: token expired")
			}
			if expAt.Before(until) {
				until = expAt
			}
		}
	}
	p, err := claimsPrincipal(claims, v.cfg.PrincipalClaim, v.cfg.TenantClaim, v.cfg.ScopesClaim)
	if err != nil {
		return Principal{}, fmt.Errorf("introspect: %w", err)
	}
	if until.After(now) {
		v.cache.put(c.Bearer, p, until, now, 0)
	}
	return p, nil
}

// checkAudience wants aud (a string or an array of strings, RFC 7662's
// shapes) to hold one of want; with want empty any aud, or none, passes.
func checkAudience(aud json.RawMessage, want []string) error {
	if len(want) == 0 {
		return nil
	}
	if aud = bytes.TrimSpace(aud); len(aud) == 0 || string(aud) == "null" {
		return fmt.Errorf("the answer has no aud, and audience is configured")
	}
	var got []string
	var one string
	if json.Unmarshal(aud, &one) == nil {
		got = []string{one}
	} else if json.Unmarshal(aud, &got) != nil {
		return fmt.Errorf("the answer's aud is neither a string nor an array of strings")
	}
	if !anyOf(got, want) {
		return fmt.Errorf("token audience %q is none of %q", got, want)
	}
	return nil
}

// anyOf reports whether got holds one of want.
func anyOf(got, want []string) bool {
	return slices.ContainsFunc(got, func(a string) bool { return slices.Contains(want, a) })
}

// ask posts the token to the endpoint. Any answer that is not a 200 with a
// JSON object is "could not find out".
func (v *introspect) ask(ctx context.Context, token string) (map[string]json.RawMessage, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), fetchTimeout)
	defer cancel()
	form := url.Values{"token": {token}, "token_type_hint": {"access_token"}}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, v.cfg.Endpoint, strings.NewReader(form.Encode()))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Accept", "application/json")
	req.SetBasicAuth(url.QueryEscape(v.cfg.ClientID), url.QueryEscape(v.secret))
	body, _, err := fetchOK(v.client, req)
	if err != nil {
		return nil, err
	}
	var claims map[string]json.RawMessage
	if err := json.Unmarshal(body, &claims); err != nil {
		return nil, fmt.Errorf("%s answered something that is not a JSON object: %w", v.cfg.Endpoint, err)
	}
	return claims, nil
}
