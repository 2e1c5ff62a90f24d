// Package authtest runs the identity providers auth tests verify against,
// for real, on loopback: an OIDC issuer serving a JWKS with rotatable keys,
// and an RFC 7662 introspection endpoint.
package authtest

import (
	"crypto/rand"
	"crypto/rsa"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"time"

	jose "github.com/go-jose/go-jose/v4"
)

// Issuer serves a JWKS at URL()+"/jwks" and signs tokens with its current
// key.
type Issuer struct {
	srv *httptest.Server

	mu      sync.Mutex
	keys    []jose.JSONWebKey // published
	current jose.JSONWebKey   // private, signs
	n       int
	fetches int
}

// NewIssuer starts an issuer with one RS256 key.
func NewIssuer() *Issuer {
	is := &Issuer{}
	is.Rotate()
	is.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		is.mu.Lock()
		set := jose.JSONWebKeySet{Keys: is.keys}
		is.fetches++
		is.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(set)
	}))
	return is
}

// URL is the issuer's base URL; the JWKS is at URL()+"/jwks".
func (is *Issuer) URL() string { return is.srv.URL }

// JWKSURL is where the key set is served.
func (is *Issuer) JWKSURL() string { return is.srv.URL + "/jwks" }

// Fetches counts key-set requests served.
func (is *Issuer) Fetches() int {
	is.mu.Lock()
	defer is.mu.Unlock()
	return is.fetches
}

// Rotate makes a new key current and publishes only it.
func (is *Issuer) Rotate() {
	priv, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		panic(err)
	}
	is.mu.Lock()
	defer is.mu.Unlock()
	is.n++
	kid := fmt.Sprintf("k%d", is.n)
	is.current = jose.JSONWebKey{Key: priv, KeyID: kid, Algorithm: string(jose.RS256), Use: "sig"}
	is.keys = []jose.JSONWebKey{{Key: &priv.PublicKey, KeyID: kid, Algorithm: string(jose.RS256), Use: "sig"}}
}

// Stop stops serving: the issuer becomes unreachable.
func (is *Issuer) Stop() { is.srv.Close() }

// Claims returns the standard claims of a token valid for an hour.
func Claims(iss, aud, sub string) map[string]any {
	now := time.Now()
	return map[string]any{"iss": iss, "aud": aud, "sub": sub, "iat": now.Unix(), "exp": now.Add(time.Hour).Unix()}
}

// Sign signs claims with the current key as RS256.
func (is *Issuer) Sign(claims map[string]any) string {
	is.mu.Lock()
	key := is.current
	is.mu.Unlock()
	return SignWith(jose.SigningKey{Algorithm: jose.RS256, Key: key}, claims)
}

// SignWith signs claims with any key, for tokens the broker must refuse.
func SignWith(key jose.SigningKey, claims map[string]any) string {
	s, err := jose.NewSigner(key, (&jose.SignerOptions{}).WithType("JWT"))
	if err != nil {
		panic(err)
	}
	payload, err := json.Marshal(claims)
	if err != nil {
		panic(err)
	}
	jws, err := s.Sign(payload)
	if err != nil {
		panic(err)
	}
	tok, err := jws.CompactSerialize()
	if err != nil {
		panic(err)
	}
	return tok
}

// Introspector is an RFC 7662 endpoint at URL(): tokens it knows answer
// with their claims and active:true, any other active:false. It requires
// the client id and secret it was made with.
type Introspector struct {
	srv        *httptest.Server
	id, secret string
	mu         sync.Mutex
	active     map[string]map[string]any
	calls      int
}

// NewIntrospector starts an endpoint accepting client id and secret.
func NewIntrospector(id, secret string) *Introspector {
	in := &Introspector{id: id, secret: secret, active: map[string]map[string]any{}}
	in.srv = httptest.NewServer(http.HandlerFunc(in.serve))
	return in
}

func (in *Introspector) serve(w http.ResponseWriter, r *http.Request) {
	u, p, ok := r.BasicAuth()
	if !ok || u != in.id || p != in.secret {
		http.Error(w, `{"error":"invalid_client"}`, http.StatusUnauthorized)
		return
	}
	in.mu.Lock()
	in.calls++
	claims, ok := in.active[r.PostFormValue("token")]
	in.mu.Unlock()
	out := map[string]any{"active": false}
	if ok {
		out = map[string]any{"active": true}
		for k, v := range claims {
			out[k] = v
		}
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(out)
}

// URL is the endpoint.
func (in *Introspector) URL() string { return in.srv.URL }

// Activate makes token active with claims.
func (in *Introspector) Activate(token string, claims map[string]any) {
	in.mu.Lock()
	in.active[token] = claims
	in.mu.Unlock()
}

// Revoke makes token inactive.
func (in *Introspector) Revoke(token string) {
	in.mu.Lock()
	delete(in.active, token)
	in.mu.Unlock()
}

// Calls counts introspection requests answered.
func (in *Introspector) Calls() int {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.calls
}

// Stop makes the endpoint unreachable.
func (in *Introspector) Stop() { in.srv.Close() }
