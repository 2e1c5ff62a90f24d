package config

import (
	"fmt"
	"net/netip"
	"reflect"
	"strings"
	"testing"

	"github.com/nexus-broker/nexus-broker/internal/config/core"
)

// specAuthExample is the worked example of "The four validators".
const specAuthExample = `# broker.yaml
listen_addr: ":8080"
advertise_addr: "wss://broker-1.example.com"

auth:
  admin_scope: "nexus.broker.admin"    # scope that unlocks the operator view of GET /leases
  validators:
    # Tried first: no network round trip.
    - type: static
      tokens:
        - token: "replace-me"
          principal: "ci-runner"
          tenant: "acme"
          scopes: "nexus.broker.admin"   # whitespace-separated, or a YAML list

    # Everyone else presents an OIDC access token.
    - type: jwks
      issuer: "https://id.example.com/"                        # exact ` + "`iss`" + ` value
      jwks_url: "https://id.example.com/.well-known/jwks.json"  # explicit; no discovery
      audience: "nexus-broker"                                  # or a list
      algorithms: ["RS256"]
      principal_claim: sub                                      # required
      tenant_claim: org_id
      scopes_claim: scope
`

// specProxyExample is the listing of "proxy_headers needs a CIDR allowlist".
const specProxyExample = `auth:
  validators:
    - type: proxy_headers
      trusted_proxy_cidrs: ["10.4.0.0/16"]   # required; an empty list fails the boot
      principal_header: X-Forwarded-User     # required; no default is right for everyone
      tenant_header: X-Auth-Request-Org
      scopes_header: X-Forwarded-Groups
    - type: jwks                             # direct callers still need a real token
      issuer: "https://id.example.com/"
      jwks_url: "https://id.example.com/.well-known/jwks.json"
      audience: "nexus-broker"
      principal_claim: sub
`

func TestAuthSpecExamples(t *testing.T) {
	c, err := Parse([]byte(specAuthExample))
	if err != nil {
		t.Fatal(err)
	}
	a := c.Auth
	if a == nil || *a.AdminScope != "nexus.broker.admin" || len(a.Validators) != 2 {
		t.Fatalf("auth = %+v", a)
	}
	st := a.Validators[0]
	want := StaticToken{Token: "replace-me", Principal: "ci-runner", Tenant: "acme", Scopes: Words{"nexus.broker.admin"}}
	if st.Type != ValidatorStatic || !reflect.DeepEqual(st.Tokens, []StaticToken{want}) {
		t.Errorf("static = %+v", st)
	}
	j := a.Validators[1]
	if j.Type != ValidatorJWKS || j.Issuer != "https://id.example.com/" || !reflect.DeepEqual(j.Audience, Strings{"nexus-broker"}) ||
		!reflect.DeepEqual(j.Algorithms, Strings{"RS256"}) || j.PrincipalClaim != "sub" || j.TenantClaim != "org_id" || j.ScopesClaim != "scope" {
		t.Errorf("jwks = %+v", j)
	}

	c, err = Parse([]byte(specProxyExample))
	if err != nil {
		t.Fatal(err)
	}
	p := c.Auth.Validators[0]
	if !reflect.DeepEqual(p.Prefixes, []netip.Prefix{netip.MustParsePrefix("10.4.0.0/16")}) || p.PrincipalHeader != "X-Forwarded-User" {
		t.Errorf("proxy_headers = %+v", p)
	}
	if *c.Auth.AdminScope != DefaultAdminScope {
		t.Errorf("admin_scope defaults to %q", *c.Auth.AdminScope)
	}
	if c.Auth.Validators[1].Algorithms[0] != "RS256" {
		t.Errorf("algorithms default %v, want RS256", c.Auth.Validators[1].Algorithms)
	}
}

func TestAuthOK(t *testing.T) {
	t.Setenv("NEXUS_TEST_TOKEN", "from-env")
	t.Setenv("NEXUS_TEST_SECRET", "s3cret")
	c, err := Parse([]byte(`auth:
  admin_scope: ""
  validators:
    - type: static
      tokens:
        - {token_env: NEXUS_TEST_TOKEN, principal: alice, scopes: [a, b]}
        - {token: lit, principal: bob, scopes: "c  d"}
    - type: introspect
      endpoint: http://127.0.0.1:9/introspect
      client_id: broker
      client_secret_env: NEXUS_TEST_SECRET
    - type: jwks
      issuer: iss
      jwks_url: http://127.0.0.1:9/jwks
      audience: [a, b]
      algorithms: [ES256, EdDSA]
      principal_claim: email
    - type: proxy_headers
      trusted_proxy_cidrs: [203.0.113.7, "2001:db8::7/128", "::ffff:198.51.100.0/120"]
      principal_header: X-User
`))
	if err != nil {
		t.Fatal(err)
	}
	a := c.Auth
	if *a.AdminScope != "" {
		t.Errorf(`admin_scope "" became %q`, *a.AdminScope)
	}
	if tk := a.Validators[0].Tokens; tk[0].TokenEnv != "NEXUS_TEST_TOKEN" || tk[0].Token != "" || !reflect.DeepEqual(tk[0].Scopes, Words{"a", "b"}) ||
		tk[1].Token != "lit" || !reflect.DeepEqual(tk[1].Scopes, Words{"c", "d"}) {
		t.Errorf("tokens = %+v", tk)
	}
	if in := a.Validators[1]; in.ClientSecretEnv != "NEXUS_TEST_SECRET" || in.PrincipalClaim != "sub" || in.ScopesClaim != "scope" || in.CacheTTL.D() != DefaultIntrospectCacheTTL || in.Audience != nil {
		t.Errorf("introspect = %+v", in)
	}
	if j := a.Validators[2]; !reflect.DeepEqual(j.Audience, Strings{"a", "b"}) {
		t.Errorf("audience = %v", j.Audience)
	}
	want := []netip.Prefix{netip.MustParsePrefix("203.0.113.7/32"), netip.MustParsePrefix("2001:db8::7/128"), netip.MustParsePrefix("198.51.100.0/24")}
	if p := a.Validators[3].Prefixes; !reflect.DeepEqual(p, want) {
		t.Errorf("prefixes = %v, want %v", p, want)
	}
	if c2, _ := Parse([]byte("listen_addr: \":1\"\n")); c2.Auth != nil {
		t.Error("no auth: block parsed as a block")
	}
}

const jwksBase = "auth:\n  validators:\n    - type: jwks\n      issuer: i\n      jwks_url: http://h/j\n      audience: a\n      principal_claim: sub\n"

var authErrorCases = []struct{ name, yaml, key, want string }{
	{"empty block", "auth:\n", "auth", "has no value"},
	{"no validators", "auth:\n  validators: []\n", "auth.validators", "at least one"},
	{"unknown auth key", "auth:\n  admin: x\n  validators: []\n", "auth.admin", "unknown key; the keys allowed here are admin_scope, proxy_listen, proxy_listen_group, validators"},
	{"validator without type", "auth:\n  validators:\n    - tokens: []\n", "auth.validators[0].type", "required; write one of introspect, jwks, proxy_headers, static"},
	{"unknown type", "auth:\n  validators:\n    - type: ldap\n", "auth.validators[0].type", `"ldap" is not a validator type`},
	{"jwks key on static", "auth:\n  validators:\n    - type: static\n      issuer: x\n", "auth.validators[0].issuer", "unknown key; the keys allowed here are principal_prefix, tokens, type"},
	{"unknown token key", "auth:\n  validators:\n    - type: static\n      tokens:\n        - {token: t, principal: p, role: admin}\n", "auth.validators[0].tokens[0].role", "unknown key"},
	{"static no tokens", "auth:\n  validators:\n    - type: static\n", "auth.validators[0].tokens", "required"},
	{"token both", "auth:\n  validators:\n    - type: static\n      tokens:\n        - {token: t, token_env: T, principal: p}\n", "auth.validators[0].tokens[0].token", "set together with token_env, and neither wins"},
	{"token none", "auth:\n  validators:\n    - type: static\n      tokens:\n        - {principal: p}\n", "auth.validators[0].tokens[0].token", "required"},
	{"token env not a name", "auth:\n  validators:\n    - type: static\n      tokens:\n        - {token_env: \"A=B\", principal: p}\n", "auth.validators[0].tokens[0].token_env", "is not an environment variable name"},
	{"token no principal", "auth:\n  validators:\n    - type: static\n      tokens:\n        - {token: t}\n", "auth.validators[0].tokens[0].principal", "required"},
	{"scopes a mapping", "auth:\n  validators:\n    - type: static\n      tokens:\n        - {token: t, principal: a, scopes: {a: b}}\n", "auth.validators[0].tokens[0].scopes", "want a string, got a mapping"},
	{"jwks no principal_claim", strings.Replace(jwksBase, "      principal_claim: sub\n", "", 1), "auth.validators[0].principal_claim", "there is no default"},
	{"jwks no issuer", strings.Replace(jwksBase, "issuer: i", "issuer: \"\"", 1), "auth.validators[0].issuer", "required"},
	{"jwks bad url", strings.Replace(jwksBase, "http://h/j", "ftp://h/j", 1), "auth.validators[0].jwks_url", "not an http:// or https:// URL"},
	{"jwks no audience", strings.Replace(jwksBase, "      audience: a\n", "", 1), "auth.validators[0].audience", "required"},
	{"jwks none", jwksBase + "      algorithms: [none]\n", "auth.validators[0].algorithms[0]", `"none" is refused`},
	{"jwks hmac", jwksBase + "      algorithms: [RS256, HS256]\n", "auth.validators[0].algorithms[1]", `"HS256" is refused: an HMAC key is a shared secret`},
	{"jwks unknown alg", jwksBase + "      algorithms: RS999\n", "auth.validators[0].algorithms[0]", "not a supported algorithm"},
	{"jwks discovery key", jwksBase + "      discovery_url: x\n", "auth.validators[0].discovery_url", "unknown key"},
	{"introspect secret both", "auth:\n  validators:\n    - type: introspect\n      endpoint: http://h/i\n      client_id: c\n      client_secret: s\n      client_secret_env: S\n", "auth.validators[0].client_secret", "set together with client_secret_env"},
	{"introspect no secret", "auth:\n  validators:\n    - type: introspect\n      endpoint: http://h/i\n      client_id: c\n", "auth.validators[0].client_secret", "required"},
	{"introspect no client_id", "auth:\n  validators:\n    - type: introspect\n      endpoint: http://h/i\n      client_secret: s\n", "auth.validators[0].client_id", "required"},
	{"introspect negative cache_ttl", "auth:\n  validators:\n    - type: introspect\n      endpoint: http://h/i\n      client_id: c\n      client_secret: s\n      cache_ttl: -1s\n", "auth.validators[0].cache_ttl", "-1s is negative"},
	{"introspect empty audience", "auth:\n  validators:\n    - type: introspect\n      endpoint: http://h/i\n      client_id: c\n      client_secret: s\n      audience: []\n", "auth.validators[0].audience", "required, and at least one"},
	{"proxy no cidrs", "auth:\n  validators:\n    - type: proxy_headers\n      principal_header: X-User\n", "auth.validators[0].trusted_proxy_cidrs", "required"},
	{"proxy empty cidrs", "auth:\n  validators:\n    - type: proxy_headers\n      trusted_proxy_cidrs: []\n      principal_header: X-User\n", "auth.validators[0].trusted_proxy_cidrs", "required"},
	{"proxy everything v4", "auth:\n  validators:\n    - type: proxy_headers\n      trusted_proxy_cidrs: [10.0.0.7/32, 0.0.0.0/0]\n      principal_header: X-User\n", "auth.validators[0].trusted_proxy_cidrs[1]", "trusts every address"},
	{"proxy everything v6", "auth:\n  validators:\n    - type: proxy_headers\n      trusted_proxy_cidrs: [\"::/0\"]\n      principal_header: X-User\n", "auth.validators[0].trusted_proxy_cidrs[0]", "trusts every address"},
	{"proxy bad cidr", "auth:\n  validators:\n    - type: proxy_headers\n      trusted_proxy_cidrs: [10.0.0.300/8]\n      principal_header: X-User\n", "auth.validators[0].trusted_proxy_cidrs[0]", "is not a CIDR"},
	{"proxy no header", "auth:\n  validators:\n    - type: proxy_headers\n      trusted_proxy_cidrs: [10.0.0.7/32]\n", "auth.validators[0].principal_header", "required"},
	{"proxy bad header", "auth:\n  validators:\n    - type: proxy_headers\n      trusted_proxy_cidrs: [10.0.0.7/32]\n      principal_header: \"X User\"\n", "auth.validators[0].principal_header", "not an HTTP header name"},
	{"prefix control char", strings.Replace(jwksBase, "principal_claim: sub\n", "principal_claim: sub\n      principal_prefix: \"a\\tb\"\n", 1), "auth.validators[0].principal_prefix", "holds a control character"},
	{"proxy loopback", "auth:\n  validators:\n    - type: proxy_headers\n      trusted_proxy_cidrs: [10.0.0.7/32, 127.0.0.2/32]\n      principal_header: X-User\n", "auth.validators[0].trusted_proxy_cidrs[1]", `"127.0.0.2/32" holds 127.0.0.2, an address of this host`},
	{"proxy v6 loopback", "auth:\n  validators:\n    - type: proxy_headers\n      trusted_proxy_cidrs: [\"::1\"]\n      principal_header: X-User\n", "auth.validators[0].trusted_proxy_cidrs[0]", `"::1" holds ::1, an address of this host`},
	{"proxy mapped loopback", "auth:\n  validators:\n    - type: proxy_headers\n      trusted_proxy_cidrs: [\"::ffff:127.0.0.9/128\"]\n      principal_header: X-User\n", "auth.validators[0].trusted_proxy_cidrs[0]", `holds 127.0.0.9, an address of this host`},
	{"proxy wide v4 holds loopback", "auth:\n  validators:\n    - type: proxy_headers\n      trusted_proxy_cidrs: [64.0.0.0/2]\n      principal_header: X-User\n", "auth.validators[0].trusted_proxy_cidrs[0]", `holds 127.0.0.1, an address of this host`},
	{"proxy wide mapped holds loopback", "auth:\n  validators:\n    - type: proxy_headers\n      trusted_proxy_cidrs: [\"::ffff:0:0/96\"]\n      principal_header: X-User\n", "auth.validators[0].trusted_proxy_cidrs[0]", `holds 127.0.0.1, an address of this host`},
	{"proxy listen relative", "auth:\n  proxy_listen: proxy.sock\n  validators:\n    - type: proxy_headers\n      principal_header: X-User\n", "auth.proxy_listen", "is not an absolute path"},
	{"proxy listen no validator", "auth:\n  proxy_listen: /run/p.sock\n  validators:\n    - type: static\n      tokens: [{token: t, principal: p}]\n", "auth.proxy_listen", "no proxy_headers validator"},
	{"proxy listen group alone", "auth:\n  proxy_listen_group: www-data\n  validators:\n    - type: static\n      tokens: [{token: t, principal: p}]\n", "auth.proxy_listen_group", "set without auth.proxy_listen"},
	{"proxy forwarded-for key", "auth:\n  validators:\n    - type: proxy_headers\n      trusted_proxy_cidrs: [10.0.0.7/32]\n      principal_header: X-User\n      trust_forwarded_for: true\n", "auth.validators[0].trust_forwarded_for", "unknown key"},
}

// TestAuthErrorsNeverCarrySecrets: a refused block names keys, never the
// value of a token or client secret.
func TestAuthErrorsNeverCarrySecrets(t *testing.T) {
	t.Setenv("NEXUS_TEST_SECRET", "env-secret-value")
	for _, y := range []string{
		"auth:\n  validators:\n    - type: static\n      tokens:\n        - {token: lit-secret-value, token_env: NEXUS_TEST_SECRET, principal: a}\n",
		"auth:\n  validators:\n    - type: introspect\n      endpoint: http://h/i\n      client_secret: lit-secret-value\n      client_secret_env: NEXUS_TEST_SECRET\n      client_id: c\n",
	} {
		_, err := Parse([]byte(y))
		if err == nil || strings.Contains(err.Error(), "secret-value") {
			t.Errorf("error %v: want a refusal that carries no secret", err)
		}
	}
}

// TestAuthIsBootOnly: a reload that changes the auth: block reports it and
// keeps the block booted with.
func TestAuthIsBootOnly(t *testing.T) {
	boot, err := Parse([]byte(specAuthExample))
	if err != nil {
		t.Fatal(err)
	}
	next, err := Parse([]byte(strings.Replace(specAuthExample, "replace-me", "other", 1)))
	if err != nil {
		t.Fatal(err)
	}
	_, bootOnly := core.ReloadDiff(boot, next)
	if !reflect.DeepEqual(bootOnly, []string{"auth"}) {
		t.Errorf("boot-only changes %v, want [auth]", bootOnly)
	}
	if got := core.Reloaded(boot, next); got.Auth.Validators[0].Tokens[0].Token != "replace-me" {
		t.Error("a reload replaced the auth: block")
	}
}

func TestListenLoopback(t *testing.T) {
	for addr, want := range map[string]bool{
		":8080": false, "0.0.0.0:8080": false, "[::]:8080": false, "10.0.0.5:8080": false, "broker.example.com:80": false,
		"127.0.0.1:8080": true, "127.0.0.2:1": true, "[::1]:8080": true, "localhost:8080": true,
	} {
		c := &Config{Config: core.Config{ListenAddr: addr}}
		if got := c.ListenLoopback(); got != want {
			t.Errorf("%s: loopback %v, want %v", addr, got, want)
		}
	}
}

// TestAmbiguousPrefixes: two validators are ambiguous when one's
// principal_prefix starts the other's, absent counting as "".
func TestAmbiguousPrefixes(t *testing.T) {
	const static = "    - type: static\n      tokens: [{token: t%d, principal: p}]\n"
	for _, c := range []struct {
		prefixes []string
		want     [][2]string
	}{
		{[]string{""}, nil},
		{[]string{"", ""}, [][2]string{{"static", "static#2"}}},
		{[]string{"a:", "b:"}, nil},
		{[]string{"a:", "a:"}, [][2]string{{"static", "static#2"}}},
		{[]string{"", "oidc:"}, [][2]string{{"static", "static#2"}}},
		{[]string{"a", "ab", "c"}, [][2]string{{"static", "static#2"}}},
		{[]string{"x:", "", "y:"}, [][2]string{{"static", "static#2"}, {"static#2", "static#3"}}},
	} {
		y := "auth:\n  validators:\n"
		for i, p := range c.prefixes {
			y += fmt.Sprintf(static, i)
			if p != "" {
				y += fmt.Sprintf("      principal_prefix: %q\n", p)
			}
		}
		cfg, err := Parse([]byte(y))
		if err != nil {
			t.Fatal(err)
		}
		if got := cfg.Auth.AmbiguousPrefixes(); !reflect.DeepEqual(got, c.want) {
			t.Errorf("prefixes %q: ambiguous %v, want %v", c.prefixes, got, c.want)
		}
	}
}

// With tenancy: two validators whose principal ids can meet are a boot
// error, since one id would be one uid for two callers; distinct prefixes
// boot.
func TestTenancyNeedsDistinctPrincipalPrefixes(t *testing.T) {
	const base = "state_dir: /s\ntenancy: {uid_range: 200000-200009, homes_dir: /h, sandbox: none}\n"
	_, err := Parse([]byte(base + "auth:\n  validators:\n    - {type: static, tokens: [{token: a, principal: a}]}\n    - {type: static, tokens: [{token: b, principal: b}]}\n"))
	if err == nil || !strings.Contains(err.Error(), "broker config: tenancy: the validators static and static#2 lack distinct principal_prefix values") {
		t.Fatalf("Parse = %v, want the tenancy boot error naming both validators", err)
	}
	if _, err := Parse([]byte(base + "auth:\n  validators:\n    - {type: static, principal_prefix: \"s1:\", tokens: [{token: a, principal: a}]}\n    - {type: static, principal_prefix: \"s2:\", tokens: [{token: b, principal: b}]}\n")); err != nil {
		t.Fatalf("distinct prefixes: %v", err)
	}
}

// TestProxyCIDRsRefuseThisHostsInterfaces: a CIDR holding any address of
// this host's interfaces is refused naming the CIDR, in plain and mapped
// form; proxy_listen alone needs no CIDR.
func TestProxyCIDRsRefuseThisHostsInterfaces(t *testing.T) {
	local := hostAddrs()
	if len(local) == 0 {
		t.Fatal("this host reports no interface address")
	}
	for _, a := range local {
		forms := []string{netip.PrefixFrom(a, a.BitLen()).String()}
		if a.Is4() {
			forms = append(forms, netip.PrefixFrom(netip.AddrFrom16(a.As16()), 128).String())
		}
		for _, cidr := range forms {
			_, err := Parse([]byte(fmt.Sprintf("auth:\n  validators:\n    - type: proxy_headers\n      trusted_proxy_cidrs: [%q]\n      principal_header: X-User\n", cidr)))
			if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("auth.validators[0].trusted_proxy_cidrs[0]: %q holds", cidr)) {
				t.Errorf("%s (an address of this host): %v", cidr, err)
			}
		}
		if !IsHostAddress(a) {
			t.Errorf("IsHostAddress(%s) = false for an interface address", a)
		}
	}
	for _, a := range []string{"127.0.0.2", "::1", "::ffff:127.0.0.1"} {
		if !IsHostAddress(netip.MustParseAddr(a)) {
			t.Errorf("IsHostAddress(%s) = false", a)
		}
	}
	if IsHostAddress(netip.MustParseAddr("203.0.113.7")) {
		t.Error("IsHostAddress(203.0.113.7), a documentation address, = true")
	}
	c, err := Parse([]byte("auth:\n  proxy_listen: /run/nexus-broker/proxy.sock\n  proxy_listen_group: www-data\n  validators:\n    - type: proxy_headers\n      principal_header: X-User\n"))
	if err != nil {
		t.Fatal(err)
	}
	if c.Auth.ProxyListen != "/run/nexus-broker/proxy.sock" || c.Auth.ProxyListenGroup != "www-data" || c.Auth.Validators[0].Prefixes != nil {
		t.Errorf("auth = %+v", c.Auth)
	}
}
