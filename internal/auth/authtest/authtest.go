// Package authtest runs the identity providers auth tests verify against,
// for real, on loopback: an OIDC issuer serving a JWKS with rotatable keys,
// and an RFC 7662 introspection endpoint.
//
// Only tests import it; it imports nothing of the project.
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
	wake    chan struct{} // closed and replaced at each fetch served
	cache   string        // the Cache-Control of the answer
	fail    bool          // answer 500
	slow    time.Duration // answer this late
}

// NewIssuer starts an issuer with one RS256 key.
func NewIssuer() *Issuer {
	is := &Issuer{wake: make(chan struct{})}
	is.Rotate()
	is.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		is.mu.Lock()
		set := jose.JSONWebKeySet{Keys: is.keys}
		cache, fail, slow := is.cache, is.fail, is.slow
		is.mu.Unlock()
		if slow > 0 {
			// An issuer this slow to answer, not a wait for anything.
			select {
			case <-time.After(slow):
			case <-r.Context().Done():
			}
		}
		if cache != "" {
			w.Header().Set("Cache-Control", cache)
		}
		if fail {
			http.Error(w, "down for maintenance", http.StatusInternalServerError)
		} else {
			w.Header().Set("Content-Type", "application/json")
			_ = json.NewEncoder(w).Encode(set)
		}
		is.mu.Lock()
		is.fetches++
		close(is.wake)
		is.wake = make(chan struct{})
		is.mu.Unlock()
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

// AwaitFetches waits until n key-set requests have been answered, at most
// d; it reports whether they were.
func (is *Issuer) AwaitFetches(n int, d time.Duration) bool {
	deadline := time.After(d)
	for {
		is.mu.Lock()
		got, wake := is.fetches, is.wake
		is.mu.Unlock()
		if got >= n {
			return true
		}
		select {
		case <-wake:
		case <-deadline:
			return false
		}
	}
}

// SetCacheControl sets the Cache-Control header of the key set's answer
// ("" sends none).
func (is *Issuer) SetCacheControl(v string) {
	is.mu.Lock()
	is.cache = v
	is.mu.Unlock()
}

// SetFailing makes the key set answer 500 (true) or the set again.
func (is *Issuer) SetFailing(fail bool) {
	is.mu.Lock()
	is.fail = fail
	is.mu.Unlock()
}

// SetSlow makes the key set answer d after it is asked.
func (is *Issuer) SetSlow(d time.Duration) {
	is.mu.Lock()
	is.slow = d
	is.mu.Unlock()
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
