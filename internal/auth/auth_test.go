package auth

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	jose "github.com/go-jose/go-jose/v4"

	"github.com/nexus-broker/nexus-broker/internal/auth/authtest"
	"github.com/nexus-broker/nexus-broker/internal/config"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

func newAuth(t testing.TB, yaml string) *Authenticator {
	t.Helper()
	return newAuthOn(t, yaml, clock{now: time.Now, after: time.After})
}

func newAuthOn(t testing.TB, yaml string, clk clock) *Authenticator {
	t.Helper()
	c, err := config.Parse([]byte(yaml))
	if err != nil {
		t.Fatal(err)
	}
	a, err := newOn(c.Auth, quiet, clk)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Close)
	return a
}

func bearer(tok string) *Credential {
	return &Credential{Bearer: tok, Authorization: true, Header: http.Header{}}
}

// wantAccept verifies c and wants principal id.
func wantAccept(t *testing.T, a *Authenticator, c *Credential, id string) Principal {
	t.Helper()
	p, ref := a.Verify(context.Background(), c)
	if ref != nil {
		t.Fatalf("refused %d %q (%s), want principal %q", ref.Status, ref.Text, ref.Reason, id)
	}
	if p.ID != id {
		t.Fatalf("principal %q, want %q", p.ID, id)
	}
	return p
}

func wantRefusal(t *testing.T, a *Authenticator, c *Credential, status int, text string) *Refusal {
	t.Helper()
	p, ref := a.Verify(context.Background(), c)
	if ref == nil {
		t.Fatalf("accepted as %+v, want %d %q", p, status, text)
	}
	if ref.Status != status || ref.Text != text {
		t.Fatalf("refused %d %q (%s), want %d %q", ref.Status, ref.Text, ref.Reason, status, text)
	}
	return ref
}

func TestDisabled(t *testing.T) {
	var a *Authenticator
	p, ref := a.Authenticate(httptest.NewRequest("GET", "/leases", nil))
	if ref != nil || !p.Anonymous() || a.Enabled() || !a.IsAdmin(p) {
		t.Errorf("no auth: block: %+v %+v; want anonymous, operator", p, ref)
	}
}

func TestStatic(t *testing.T) {
	a := newAuth(t, `auth:
  validators:
    - type: static
      tokens:
        - {token: tok-a, principal: alice, tenant: acme, scopes: "x nexus.broker.admin"}
        - {token: tok-b, principal: bob, scopes: [y]}
`)
	p := wantAccept(t, a, bearer("tok-a"), "alice")
	if p.Tenant != "acme" || !a.IsAdmin(p) {
		t.Errorf("alice = %+v, admin %v", p, a.IsAdmin(p))
	}
	if p := wantAccept(t, a, bearer("tok-b"), "bob"); a.IsAdmin(p) {
		t.Error("bob is not an operator")
	}
	wantRefusal(t, a, bearer("tok-c"), 401, TextRejected)
	wantRefusal(t, a, &Credential{Header: http.Header{}}, 401, TextRequired)
	// A non-bearer Authorization header is a credential, and a bad one.
	wantRefusal(t, a, &Credential{Authorization: true, Header: http.Header{}}, 401, TextRejected)
}

func TestAdminScopeEmptyMeansNobody(t *testing.T) {
	a := newAuth(t, "auth:\n  admin_scope: \"\"\n  validators:\n    - type: static\n      tokens: [{token: t, principal: p, scopes: \"nexus.broker.admin\"}]\n")
	if p := wantAccept(t, a, bearer("t"), "p"); a.IsAdmin(p) {
		t.Error(`admin_scope "" made an operator`)
	}
}

func jwksYAML(is *authtest.Issuer, extra string) string {
	return fmt.Sprintf(`auth:
  validators:
    - type: jwks
      issuer: %q
      jwks_url: %q
      audience: [nexus-broker, other-aud]
      principal_claim: sub
      tenant_claim: org_id
      scopes_claim: scope
%s`, is.URL()+"/", is.JWKSURL(), extra)
}

func TestJWKS(t *testing.T) {
	is := authtest.NewIssuer()
	defer is.Stop()
	a := newAuth(t, jwksYAML(is, ""))
	iss := is.URL() + "/"
	claims := func(mod func(map[string]any)) string {
		c := authtest.Claims(iss, "nexus-broker", "alice")
		c["org_id"] = "acme"
		c["scope"] = "read nexus.broker.admin"
		if mod != nil {
			mod(c)
		}
		return is.Sign(c)
	}

	p := wantAccept(t, a, bearer(claims(nil)), "alice")
	if p.Tenant != "acme" || !slices.Equal(p.Scopes, []string{"read", "nexus.broker.admin"}) {
		t.Errorf("principal %+v", p)
	}
	// Any one audience of the list; scopes as an array.
	wantAccept(t, a, bearer(claims(func(c map[string]any) { c["aud"] = []string{"x", "other-aud"}; c["scope"] = []string{"s"} })), "alice")

	for name, mod := range map[string]func(map[string]any){
		"wrong issuer":           func(c map[string]any) { c["iss"] = is.URL() },
		"wrong audience":         func(c map[string]any) { c["aud"] = "someone-else" },
		"expired":                func(c map[string]any) { c["exp"] = time.Now().Add(-time.Minute).Unix() },
		"no exp":                 func(c map[string]any) { delete(c, "exp") },
		"missing principal":      func(c map[string]any) { delete(c, "sub") },
		"empty principal":        func(c map[string]any) { c["sub"] = "" },
		"non-scalar principal":   func(c map[string]any) { c["sub"] = map[string]string{"id": "alice"} },
		"list principal":         func(c map[string]any) { c["sub"] = []string{"alice"} },
		"not yet valid (nbf+1h)": func(c map[string]any) { c["nbf"] = time.Now().Add(time.Hour).Unix() },
	} {
		t.Run(name, func(t *testing.T) { wantRefusal(t, a, bearer(claims(mod)), 401, TextRejected) })
	}

	t.Run("wrong algorithm", func(t *testing.T) {
		ec, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		tok := authtest.SignWith(jose.SigningKey{Algorithm: jose.ES256, Key: jose.JSONWebKey{Key: ec, KeyID: "k1"}}, authtest.Claims(iss, "nexus-broker", "alice"))
		wantRefusal(t, a, bearer(tok), 401, TextRejected)
		hs := authtest.SignWith(jose.SigningKey{Algorithm: jose.HS256, Key: []byte("0123456789abcdef0123456789abcdef")}, authtest.Claims(iss, "nexus-broker", "alice"))
		wantRefusal(t, a, bearer(hs), 401, TextRejected)
		wantRefusal(t, a, bearer("not.a.jwt"), 401, TextRejected)
	})

	t.Run("forged signature", func(t *testing.T) {
		other := authtest.NewIssuer()
		other.Stop()
		wantRefusal(t, a, bearer(other.Sign(authtest.Claims(iss, "nexus-broker", "alice"))), 401, TextRejected)
	})
}

// fakeClock is the validators' clock in a test: now moves only when the
// test advances it, and each wait a key set asks for is reported on asked
// and ends when the test fires it.
type fakeClock struct {
	mu    sync.Mutex
	t     time.Time
	asked chan time.Duration
	fire  chan time.Time
}

func newFakeClock() *fakeClock {
	return &fakeClock{t: time.Now(), asked: make(chan time.Duration, 16), fire: make(chan time.Time)}
}

func (c *fakeClock) clock() clock { return clock{now: c.now, after: c.after} }

func (c *fakeClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

func (c *fakeClock) after(d time.Duration) <-chan time.Time {
	c.asked <- d
	return c.fire
}

// nextWait is the next wait a key set asks for: its scheduled refresh
// has run.
func (c *fakeClock) nextWait(t *testing.T) time.Duration {
	t.Helper()
	select {
	case d := <-c.asked:
		return d
	case <-time.After(10 * time.Second):
		t.Fatal("the key set never scheduled its next refresh")
		return 0
	}
}

// tick ends the key set's wait and waits for the refresh it runs, and
// returns the wait that refresh schedules.
func (c *fakeClock) tick(t *testing.T, d time.Duration) time.Duration {
	t.Helper()
	c.advance(d)
	select {
	case c.fire <- c.now():
	case <-time.After(10 * time.Second):
		t.Fatal("the key set is not waiting for its refresh")
	}
	return c.nextWait(t)
}

// warmJWKS starts an issuer (with cacheControl on its answers) and a jwks
// chain over it on a fake clock whose first fetch has run; iss is the
// issuer value tokens must carry.
func warmJWKS(t *testing.T, cacheControl string) (*authtest.Issuer, *Authenticator, *fakeClock, string) {
	is := authtest.NewIssuer()
	t.Cleanup(is.Stop)
	is.SetCacheControl(cacheControl)
	clk := newFakeClock()
	a := newAuthOn(t, jwksYAML(is, ""), clk.clock())
	clk.nextWait(t)
	return is, a, clk, is.URL() + "/"
}

// TestJWKSFollowsTheIssuer: the set is refetched on the schedule the
// issuer's Cache-Control asks for, so a removed key stops verifying at the
// next refresh, its tokens already verified included; a failed refresh
// keeps the set held and is retried after a minute.
func TestJWKSFollowsTheIssuer(t *testing.T) {
	is, a, clk, iss := warmJWKS(t, "public, max-age=120")
	old := is.Sign(authtest.Claims(iss, "nexus-broker", "alice"))
	wantAccept(t, a, bearer(old), "alice")
	is.Rotate()
	wantAccept(t, a, bearer(old), "alice") // until the issuer's interval ends
	if got := clk.tick(t, 2*time.Minute); got != 2*time.Minute {
		t.Errorf("next refresh in %s, want the issuer's max-age 2m", got)
	}
	if n := is.Fetches(); n != 2 {
		t.Fatalf("%d fetches, want the boot's and the scheduled one", n)
	}
	wantRefusal(t, a, bearer(old), 401, TextRejected)
	current := is.Sign(authtest.Claims(iss, "nexus-broker", "bob"))
	wantAccept(t, a, bearer(current), "bob")

	// The issuer fails: the set held keeps verifying, and the retry comes
	// a minute later, whatever max-age said.
	is.SetFailing(true)
	is.Rotate()
	if got := clk.tick(t, 2*time.Minute); got != time.Minute {
		t.Errorf("after a failed refresh the next one is in %s, want 1m", got)
	}
	if n := is.Fetches(); n != 3 {
		t.Fatalf("%d fetches, want 3", n)
	}
	a.chain[0].validator.(*jwks).cache = tokenCache{}
	wantAccept(t, a, bearer(current), "bob")
	is.SetFailing(false)
	is.SetCacheControl("")
	if got := clk.tick(t, time.Minute); got != jwksDefaultRefresh {
		t.Errorf("with no Cache-Control the next refresh is in %s, want %s", got, jwksDefaultRefresh)
	}
	wantRefusal(t, a, bearer(current), 401, TextRejected)
	wantAccept(t, a, bearer(is.Sign(authtest.Claims(iss, "nexus-broker", "carol"))), "carol")
}

// TestJWKSRefreshInterval: max-age, else five minutes, within [1m, 24h].
func TestJWKSRefreshInterval(t *testing.T) {
	for cc, want := range map[string]time.Duration{
		"":                                5 * time.Minute,
		"no-cache":                        5 * time.Minute,
		"max-age=600":                     10 * time.Minute,
		"public, MAX-AGE=3600, immutable": time.Hour,
		`max-age="900"`:                   15 * time.Minute,
		"max-age=0":                       time.Minute,
		"max-age=10":                      time.Minute,
		"max-age=999999999999999999":      24 * time.Hour,
		"max-age=-5":                      5 * time.Minute,
		"max-age=soon":                    5 * time.Minute,
	} {
		h := http.Header{}
		if cc != "" {
			h.Set("Cache-Control", cc)
		}
		if got := refreshInterval(h); got != want {
			t.Errorf("Cache-Control %q: every %s, want %s", cc, got, want)
		}
	}
}

// TestJWKSUnknownKid: a rotated key verifies on its first token once a
// second has passed since the last fetch; a kid that missed is not
// fetched for again within the interval; random kids cost at most one
// fetch a second; concurrent misses share one fetch.
func TestJWKSUnknownKid(t *testing.T) {
	is, a, clk, iss := warmJWKS(t, "")
	is.Rotate()
	rotated := is.Sign(authtest.Claims(iss, "nexus-broker", "bob"))
	clk.advance(500 * time.Millisecond)
	wantRefusal(t, a, bearer(rotated), 401, TextRejected) // within a second of the boot's fetch
	if n := is.Fetches(); n != 1 {
		t.Fatalf("%d fetches within a second of the last, want 1 (the boot's)", n)
	}
	clk.advance(time.Second)
	wantAccept(t, a, bearer(rotated), "bob")
	if n := is.Fetches(); n != 2 {
		t.Fatalf("%d fetches, want the rotated kid's at once", n)
	}

	foreign, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	forged := func(kid string) string {
		return authtest.SignWith(jose.SigningKey{Algorithm: jose.RS256, Key: jose.JSONWebKey{Key: foreign, KeyID: kid}}, authtest.Claims(iss, "nexus-broker", "mallory"))
	}
	clk.advance(2 * time.Second)
	for i := range 30 {
		wantRefusal(t, a, bearer(forged(fmt.Sprint("random-", i))), 401, TextRejected)
	}
	if n := is.Fetches(); n != 3 {
		t.Fatalf("%d fetches after 30 random kids at one instant, want one more (3)", n)
	}
	clk.advance(2 * time.Second)
	wantRefusal(t, a, bearer(forged("random-0")), 401, TextRejected)
	if n := is.Fetches(); n != 3 {
		t.Fatalf("%d fetches: a kid that missed within the interval fetched again", n)
	}
	wantRefusal(t, a, bearer(forged("random-new")), 401, TextRejected)
	if n := is.Fetches(); n != 4 {
		t.Fatalf("%d fetches, want one for a new kid a second after the last fetch", n)
	}
	clk.advance(jwksDefaultRefresh)
	wantRefusal(t, a, bearer(forged("random-0")), 401, TextRejected)
	if n := is.Fetches(); n != 5 {
		t.Fatalf("%d fetches, want one for a kid whose miss is an interval old", n)
	}

	// Twenty callers with the next key at once: one fetch, all verified.
	is.Rotate()
	clk.advance(2 * time.Second)
	var wg sync.WaitGroup
	refused := make(chan *Refusal, 20)
	for i := range 20 {
		tok := is.Sign(authtest.Claims(iss, "nexus-broker", fmt.Sprint("u", i)))
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, ref := a.Verify(context.Background(), bearer(tok)); ref != nil {
				refused <- ref
			}
		}()
	}
	wg.Wait()
	close(refused)
	for ref := range refused {
		t.Errorf("a concurrent caller with the rotated key was refused: %s", ref.Reason)
	}
	if n := is.Fetches(); n != 6 {
		t.Errorf("%d fetches after 20 concurrent misses, want one more (6)", n)
	}
}

// TestJWKSOutage: with the issuer stopped a cached kid keeps verifying and
// a new one is denied (401, never an allow and never a 503).
func TestJWKSOutage(t *testing.T) {
	is, a, clk, iss := warmJWKS(t, "")
	is.Stop()
	wantAccept(t, a, bearer(is.Sign(authtest.Claims(iss, "nexus-broker", "dave"))), "dave")
	is.Rotate()
	clk.advance(2 * time.Second)
	wantRefusal(t, a, bearer(is.Sign(authtest.Claims(iss, "nexus-broker", "eve"))), 401, TextRejected)
}

// TestJWKSWarmPathDoesNotFetch: once warm, verifying fetches nothing.
func TestJWKSWarmPathDoesNotFetch(t *testing.T) {
	is, a, _, iss := warmJWKS(t, "")
	before := is.Fetches()
	for i := range 20 {
		wantAccept(t, a, bearer(is.Sign(authtest.Claims(iss, "nexus-broker", fmt.Sprint("u", i)))), fmt.Sprint("u", i))
	}
	if n := is.Fetches() - before; n != 0 {
		t.Errorf("%d fetches on a warm key set", n)
	}
}

func introspectYAML(in *authtest.Introspector) string {
	return fmt.Sprintf(`auth:
  validators:
    - type: introspect
      endpoint: %q
      client_id: broker
      client_secret: s3cret
      tenant_claim: org
`, in.URL())
}

func TestIntrospect(t *testing.T) {
	in := authtest.NewIntrospector("broker", "s3cret")
	a := newAuth(t, introspectYAML(in))
	in.Activate("good", map[string]any{"sub": "alice", "org": "acme", "scope": "a b", "exp": time.Now().Add(time.Hour).Unix()})
	in.Activate("expired", map[string]any{"sub": "bob", "exp": time.Now().Add(-time.Minute).Unix()})
	in.Activate("nosub", map[string]any{"scope": "a"})
	in.Activate("numeric", map[string]any{"sub": 12345})

	p := wantAccept(t, a, bearer("good"), "alice")
	if p.Tenant != "acme" || !slices.Equal(p.Scopes, []string{"a", "b"}) {
		t.Errorf("principal %+v", p)
	}
	wantAccept(t, a, bearer("numeric"), "12345") // a number is a scalar
	wantRefusal(t, a, bearer("inactive"), 401, TextRejected)
	wantRefusal(t, a, bearer("expired"), 401, TextRejected)
	wantRefusal(t, a, bearer("nosub"), 401, TextRejected)

	// A positive answer is reused; a negative one is asked again.
	calls := in.Calls()
	wantAccept(t, a, bearer("good"), "alice")
	wantRefusal(t, a, bearer("inactive"), 401, TextRejected)
	if n := in.Calls() - calls; n != 1 {
		t.Errorf("%d introspection calls, want 1 (the inactive token)", n)
	}

	// Stopped: a token it has not vouched for is 503, never 401 nor allow;
	// the cached positive answer still stands.
	in.Stop()
	ref := wantRefusal(t, a, bearer("unknown"), 503, TextUnavailable)
	rec := httptest.NewRecorder()
	ref.Write(rec)
	if rec.Header().Get("Retry-After") != "5" || rec.Body.String() != `{"error":"credential validation unavailable"}`+"\n" {
		t.Errorf("503 answered %v %q", rec.Header(), rec.Body.String())
	}
	wantAccept(t, a, bearer("good"), "alice")
}

// TestIntrospectCacheBoundedByExp: a positive answer is not reused past the
// token's exp.
func TestIntrospectCacheBoundedByExp(t *testing.T) {
	in := authtest.NewIntrospector("broker", "s3cret")
	defer in.Stop()
	a := newAuth(t, introspectYAML(in))
	v := a.chain[0].validator.(*introspect)
	now := time.Now()
	v.now = func() time.Time { return now }
	in.Activate("t", map[string]any{"sub": "alice", "exp": now.Add(2 * time.Second).Unix()})
	wantAccept(t, a, bearer("t"), "alice")
	now = now.Add(3 * time.Second)
	wantRefusal(t, a, bearer("t"), 401, TextRejected) // asked again: expired
}

// TestIntrospectAudience: with audience set, an active answer must carry an
// aud (a string or an array) holding one of them; none is a rejection.
func TestIntrospectAudience(t *testing.T) {
	in := authtest.NewIntrospector("broker", "s3cret")
	defer in.Stop()
	a := newAuth(t, introspectYAML(in)+"      audience: [nexus-broker, nexus]\n")
	for tok, aud := range map[string]any{"one": "nexus", "list": []string{"billing", "nexus-broker"}} {
		in.Activate(tok, map[string]any{"sub": "alice", "aud": aud})
		wantAccept(t, a, bearer(tok), "alice")
	}
	for tok, aud := range map[string]any{"other": "billing", "others": []string{"billing"}, "null": nil, "number": 7} {
		in.Activate(tok, map[string]any{"sub": "alice", "aud": aud})
		wantRefusal(t, a, bearer(tok), 401, TextRejected)
	}
	in.Activate("none", map[string]any{"sub": "alice"})
	if ref := wantRefusal(t, a, bearer("none"), 401, TextRejected); !strings.Contains(ref.Reason, "no aud") {
		t.Errorf("reason %q does not say the answer had no aud", ref.Reason)
	}
	// Without audience, any aud or none passes.
	b := newAuth(t, introspectYAML(in))
	wantAccept(t, b, bearer("none"), "alice")
	wantAccept(t, b, bearer("other"), "alice")
}

// TestIntrospectCacheTTL: a revoked token keeps working for cache_ttl and
// no longer; 0 asks every time.
func TestIntrospectCacheTTL(t *testing.T) {
	in := authtest.NewIntrospector("broker", "s3cret")
	defer in.Stop()
	for _, c := range []struct {
		yaml  string
		stale time.Duration // still accepted this long after the revocation
		ttl   time.Duration
	}{{"      cache_ttl: 10s\n", 9 * time.Second, 10 * time.Second}, {"", 29 * time.Second, 30 * time.Second}, {"      cache_ttl: 0s\n", 0, 0}} {
		a := newAuth(t, introspectYAML(in)+c.yaml)
		v := a.chain[0].validator.(*introspect)
		now := time.Now()
		v.now = func() time.Time { return now }
		in.Activate("t", map[string]any{"sub": "alice", "exp": now.Add(time.Hour).Unix()})
		wantAccept(t, a, bearer("t"), "alice")
		in.Revoke("t")
		if c.stale > 0 {
			now = now.Add(c.stale)
			wantAccept(t, a, bearer("t"), "alice")
		}
		now = now.Add(c.ttl - c.stale)
		wantRefusal(t, a, bearer("t"), 401, TextRejected)
	}
}

func TestIntrospectWrongClientSecretIsUnavailable(t *testing.T) {
	in := authtest.NewIntrospector("broker", "other")
	defer in.Stop()
	a := newAuth(t, introspectYAML(in))
	in.Activate("good", map[string]any{"sub": "alice"})
	wantRefusal(t, a, bearer("good"), 503, TextUnavailable)
}

// TestChainOrder: the first validator that accepts wins, a later one is
// still tried after a rejection, and an unreachable introspect is a 503
// only when no other validator accepts.
func TestChainOrder(t *testing.T) {
	in := authtest.NewIntrospector("broker", "s3cret")
	in.Stop()
	a := newAuth(t, fmt.Sprintf(`auth:
  validators:
    - type: introspect
      endpoint: %q
      client_id: broker
      client_secret: s3cret
    - type: static
      tokens: [{token: ci, principal: ci-runner}]
`, in.URL()))
	wantAccept(t, a, bearer("ci"), "ci-runner")
	wantRefusal(t, a, bearer("nope"), 503, TextUnavailable)
}

// TestPrincipalPrefix: each validator's principal_prefix starts the ids it
// yields, so the same name from two validators is two principals.
func TestPrincipalPrefix(t *testing.T) {
	is := authtest.NewIssuer()
	defer is.Stop()
	a := newAuth(t, jwksYAML(is, `      principal_prefix: "oidc:"
    - type: static
      principal_prefix: "static:"
      tokens: [{token: tok-a, principal: alice}]
    - type: static
      tokens: [{token: tok-b, principal: bob}]
`))
	wantAccept(t, a, bearer(is.Sign(authtest.Claims(is.URL()+"/", "nexus-broker", "alice"))), "oidc:alice")
	wantAccept(t, a, bearer("tok-a"), "static:alice")
	wantAccept(t, a, bearer("tok-b"), "bob")
}

func proxyAuth(t *testing.T) *Authenticator {
	return newAuth(t, `auth:
  proxy_listen: /run/nexus-broker/proxy.sock
  validators:
    - type: proxy_headers
      trusted_proxy_cidrs: [203.0.113.0/24]
      principal_header: X-Forwarded-User
      tenant_header: X-Org
      scopes_header: X-Groups
    - type: static
      tokens: [{token: direct, principal: direct-caller}]
`)
}

func TestProxyHeaders(t *testing.T) {
	a := proxyAuth(t)
	req := func(peer string, h map[string]string, tok string) *Credential {
		c := &Credential{Header: http.Header{}}
		if peer == "socket" {
			c.ViaProxySocket = true
		} else {
			c.Peer = netip.MustParseAddr(peer)
		}
		for k, v := range h {
			c.Header.Set(k, v)
		}
		if tok != "" {
			c.Bearer, c.Authorization = tok, true
		}
		return c
	}
	ident := map[string]string{"X-Forwarded-User": "alice", "X-Org": "acme", "X-Groups": "a, b", "X-Forwarded-For": "203.0.113.7"}
	for _, from := range []string{"203.0.113.7", "socket"} {
		p := wantAccept(t, a, req(from, ident, ""), "alice")
		if p.Tenant != "acme" || !slices.Equal(p.Scopes, []string{"a", "b"}) {
			t.Errorf("from %s: principal %+v", from, p)
		}
		// A header sent twice: which one the proxy set is unknowable.
		for _, h := range []string{"X-Forwarded-User", "X-Org", "X-Groups"} {
			twice := req(from, ident, "")
			twice.Header.Add(h, "other")
			if ref := wantRefusal(t, a, twice, 401, TextRejected); !strings.Contains(ref.Reason, h+" sent more than once") {
				t.Errorf("from %s, %s twice: reason %q", from, h, ref.Reason)
			}
		}
	}
	// The same headers from an untrusted peer: X-Forwarded-For is never
	// read; from this host, whatever the CIDRs, they are refused too.
	wantRefusal(t, a, req("198.51.100.1", ident, ""), 401, TextRejected)
	wantRefusal(t, a, req("127.0.0.2", ident, ""), 401, TextRejected)
	// A direct caller with a token still gets through the next validator,
	// but not on the proxy's socket, where the proxy's header is the only
	// credential.
	wantAccept(t, a, req("198.51.100.1", nil, "direct"), "direct-caller")
	wantRefusal(t, a, req("198.51.100.1", nil, ""), 401, TextRequired)
	wantRefusal(t, a, req("socket", nil, "direct"), 401, TextRequired)
	wantRefusal(t, a, req("socket", nil, ""), 401, TextRequired)
}

// TestProxyHeadersOverSockets sends the same request on a unix socket
// served as auth.proxy_listen is, and over TCP from 127.0.0.2: only the
// socket's is the proxy's.
func TestProxyHeadersOverSockets(t *testing.T) {
	a := proxyAuth(t)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p, ref := a.Authenticate(r)
		if ref != nil {
			ref.Write(w)
			return
		}
		_, _ = io.WriteString(w, p.ID)
	})
	tcp := httptest.NewServer(h)
	defer tcp.Close()
	ident := map[string]string{"X-Forwarded-User": "alice"}
	if status, body := getFrom(t, "127.0.0.2", tcp.URL, ident); status != 401 || body != `{"error":"credential rejected"}`+"\n" {
		t.Errorf("over TCP from 127.0.0.2: %d %q, want 401 credential rejected", status, body)
	}
	sock := filepath.Join(t.TempDir(), "p.sock")
	if len(sock) > 100 {
		sock = filepath.Join("/tmp", fmt.Sprintf("nexus-auth-%d.sock", os.Getpid()))
	}
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h, ConnContext: func(ctx context.Context, _ net.Conn) context.Context { return OnProxySocket(ctx) }}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	cl := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}}
	req, _ := http.NewRequest("GET", "http://proxy/leases", nil)
	req.Header.Set("X-Forwarded-User", "alice")
	resp, err := cl.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || string(body) != "alice" {
		t.Errorf("on the proxy's socket: %d %q, want alice", resp.StatusCode, body)
	}
}

func getFrom(t *testing.T, local, url string, h map[string]string) (int, string) {
	t.Helper()
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(local)}}
	cl := &http.Client{Transport: &http.Transport{DialContext: d.DialContext}}
	req, _ := http.NewRequest("GET", url, nil)
	for k, v := range h {
		req.Header.Set(k, v)
	}
	resp, err := cl.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func TestExtract(t *testing.T) {
	r := httptest.NewRequest("GET", "/lease/L?ticket=tk&from_seq=3", nil)
	r.RemoteAddr = "[::ffff:127.0.0.2]:4000"
	r.Header.Set("Authorization", "bearer  tok ")
	c := Extract(r, true)
	if c.Bearer != "tok" || !c.Authorization || c.Ticket != "tk" || c.Peer != netip.MustParseAddr("127.0.0.2") {
		t.Errorf("%+v", c)
	}
	if c := Extract(r, false); c.Ticket != "" {
		t.Error("a ticket read where none is taken")
	}
	r.Header.Set("Authorization", "Basic dXNlcjpwYXNz")
	if c := Extract(r, false); c.Bearer != "" || !c.Authorization {
		t.Errorf("basic: %+v", c)
	}
	r.Header.Add("Authorization", "Bearer x")
	if c := Extract(r, false); c.Bearer != "" {
		t.Errorf("two Authorization headers: %+v", c)
	}
}

func FuzzExtract(f *testing.F) {
	a := newAuthF(f)
	f.Add("Bearer tok", "/lease/L?ticket=x&from_seq=1", "127.0.0.1:1", "alice")
	f.Add("", "/claim", "[::1]:2", "")
	f.Add("bearer", "/%zz", "garbage", "\x00")
	f.Fuzz(func(t *testing.T, authz, target, remote, user string) {
		r := httptest.NewRequest("GET", "/", nil)
		if u, err := r.URL.Parse(target); err == nil {
			r.URL = u
		}
		r.RemoteAddr = remote
		if authz != "" {
			r.Header["Authorization"] = []string{authz}
		}
		r.Header["X-Forwarded-User"] = []string{user}
		c := Extract(r, true)
		if c.Bearer != "" && !c.Authorization {
			t.Fatal("a bearer without an Authorization header")
		}
		if strings.ContainsAny(c.Bearer, " \t") && c.Bearer != strings.TrimSpace(c.Bearer) {
			t.Fatalf("untrimmed bearer %q", c.Bearer)
		}
		p, ref := a.Verify(context.Background(), &c)
		if (ref == nil) == p.Anonymous() {
			t.Fatalf("principal %+v with refusal %+v", p, ref)
		}
	})
}

func newAuthF(f *testing.F) *Authenticator {
	c, err := config.Parse([]byte(`auth:
  validators:
    - type: proxy_headers
      trusted_proxy_cidrs: [203.0.113.0/24]
      principal_header: X-Forwarded-User
    - type: static
      tokens: [{token: tok, principal: p}]
`))
	if err != nil {
		f.Fatal(err)
	}
	a, err := New(c.Auth, quiet)
	if err != nil {
		f.Fatal(err)
	}
	return a
}

// TestSecretsFromTheEnvironment: <key>_env is read when the chain is built
// (by the gateway, not by the loader spawnd shares); an unset variable or a
// token written twice fails naming the key and never the value.
func TestSecretsFromTheEnvironment(t *testing.T) {
	t.Setenv("NEXUS_TEST_TOKEN", "env-token")
	t.Setenv("NEXUS_TEST_SECRET", "s3cret")
	in := authtest.NewIntrospector("broker", "s3cret")
	defer in.Stop()
	in.Activate("opaque", map[string]any{"sub": "bob"})
	a := newAuth(t, fmt.Sprintf(`auth:
  validators:
    - type: static
      tokens: [{token_env: NEXUS_TEST_TOKEN, principal: alice}]
    - type: introspect
      endpoint: %q
      client_id: broker
      client_secret_env: NEXUS_TEST_SECRET
`, in.URL()))
	wantAccept(t, a, bearer("env-token"), "alice")
	wantAccept(t, a, bearer("opaque"), "bob")

	for yaml, want := range map[string]string{
		"auth:\n  validators:\n    - type: static\n      tokens: [{token_env: NEXUS_TEST_SURELY_UNSET, principal: p}]\n":                                   "broker config: auth.validators[0].tokens[0].token_env: the environment variable NEXUS_TEST_SURELY_UNSET is not set or empty",
		"auth:\n  validators:\n    - type: introspect\n      endpoint: http://h/i\n      client_id: c\n      client_secret_env: NEXUS_TEST_SURELY_UNSET\n": "broker config: auth.validators[0].client_secret_env: the environment variable NEXUS_TEST_SURELY_UNSET is not set",
		"auth:\n  validators:\n    - type: static\n      tokens: [{token: env-token, principal: a}, {token_env: NEXUS_TEST_TOKEN, principal: b}]\n":        "broker config: auth.validators[0].tokens[1]: the same token as auth.validators[0].tokens[0]",
	} {
		c, err := config.Parse([]byte(yaml))
		if err != nil {
			t.Fatal(err)
		}
		_, err = New(c.Auth, quiet)
		if err == nil || !strings.HasPrefix(err.Error(), want) || strings.Contains(err.Error(), "env-token") {
			t.Errorf("got %v, want %q and no token", err, want)
		}
	}
}
