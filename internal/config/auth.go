package config

import (
	"fmt"
	"maps"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"time"
	"unicode"

	"gopkg.in/yaml.v3"

	"github.com/nexus-broker/nexus-broker/internal/config/core"
)

// Auth is the optional auth: block. A nil *Auth on Config means
// authentication is disabled.
type Auth struct {
	// AdminScope unlocks the whole-registry GET /leases and GET /metrics.
	// Unset means DefaultAdminScope; "" means nobody is an operator.
	AdminScope *string     `yaml:"admin_scope"`
	Validators []Validator `yaml:"validators"`
	// ProxyListen is a unix socket (mode 0660, group ProxyListenGroup) on
	// which proxy_headers are honoured: the authenticating proxy on this
	// host connects to it, since a TCP peer on this host proves nothing.
	ProxyListen string `yaml:"proxy_listen"`
	// ProxyListenGroup is the socket's group (a name or a gid); unset, the
	// gateway's own group.
	ProxyListenGroup string `yaml:"proxy_listen_group"`
}

// DefaultIntrospectCacheTTL is an introspect validator's cache_ttl when the
// key is absent: a revoked token keeps working at most this long.
const DefaultIntrospectCacheTTL = 30 * time.Second

// DefaultAdminScope is auth.admin_scope when the key is absent.
const DefaultAdminScope = "nexus.broker.admin"

// Validator types, in the order the spec introduces them.
const (
	ValidatorStatic       = "static"
	ValidatorJWKS         = "jwks"
	ValidatorIntrospect   = "introspect"
	ValidatorProxyHeaders = "proxy_headers"
)

// Validator is one entry of auth.validators. It is one struct for every
// type so the list decodes in order; the loader refuses any key the entry's
// type does not take (validatorKeys).
type Validator struct {
	Type string `yaml:"type"`

	// PrincipalPrefix is put before every principal id this validator
	// yields, so ids from different validators cannot collide (a JWT
	// sub=alice owning static alice's leases). Optional, every type.
	PrincipalPrefix string `yaml:"principal_prefix"`

	// static
	Tokens []StaticToken `yaml:"tokens"`

	// jwks
	Issuer  string `yaml:"issuer"`
	JWKSURL string `yaml:"jwks_url"`
	// Audience is any one of: required for jwks, optional for introspect
	// (checked against the answer's aud when set).
	Audience   Strings `yaml:"audience"`
	Algorithms Strings `yaml:"algorithms"`

	// jwks and introspect: which claim carries what.
	PrincipalClaim string `yaml:"principal_claim"`
	TenantClaim    string `yaml:"tenant_claim"`
	ScopesClaim    string `yaml:"scopes_claim"`

	// introspect
	Endpoint        string `yaml:"endpoint"`
	ClientID        string `yaml:"client_id"`
	ClientSecret    string `yaml:"client_secret"`
	ClientSecretEnv string `yaml:"client_secret_env"`
	// CacheTTL is how long an active answer is reused (never past the
	// token's exp); 0 asks every time. Unset means
	// DefaultIntrospectCacheTTL, filled in by Load.
	CacheTTL *core.Duration `yaml:"cache_ttl"`

	// proxy_headers
	TrustedProxyCIDRs Strings `yaml:"trusted_proxy_cidrs"`
	PrincipalHeader   string  `yaml:"principal_header"`
	TenantHeader      string  `yaml:"tenant_header"`
	ScopesHeader      string  `yaml:"scopes_header"`

	// Prefixes is TrustedProxyCIDRs parsed, filled in by Load.
	Prefixes []netip.Prefix `yaml:"-"`
}

// StaticToken is one row of a static validator's table. A token_env is
// read by the gateway (ResolveSecret), not by Load: spawnd reads this file
// too and holds none of the gateway's secrets.
type StaticToken struct {
	Token     string `yaml:"token"`
	TokenEnv  string `yaml:"token_env"`
	Principal string `yaml:"principal"`
	Tenant    string `yaml:"tenant"`
	Scopes    Words  `yaml:"scopes"`
}

// Words is a whitespace-separated string or a YAML list of strings.
type Words []string

// ValidatorNames names the validators in chain order as upstream does: by
// type, a repeated type numbered from its second (jwks, jwks#2).
func (a *Auth) ValidatorNames() []string {
	names := make([]string, len(a.Validators))
	seen := map[string]int{}
	for i, v := range a.Validators {
		seen[v.Type]++
		names[i] = v.Type
		if n := seen[v.Type]; n > 1 {
			names[i] = fmt.Sprintf("%s#%d", v.Type, n)
		}
	}
	return names
}

// AmbiguousPrefixes are the pairs of validators (by ValidatorNames, in
// chain order) whose principal ids can be equal: one's principal_prefix
// starts the other's (equal prefixes, both absent, or "" beside "oidc:",
// where a static "oidc:alice" is the jwks sub alice). Nil when every
// prefix is distinct and none starts another.
func (a *Auth) AmbiguousPrefixes() [][2]string {
	names := a.ValidatorNames()
	var pairs [][2]string
	for i, v := range a.Validators {
		for j := i + 1; j < len(a.Validators); j++ {
			w := a.Validators[j].PrincipalPrefix
			if strings.HasPrefix(v.PrincipalPrefix, w) || strings.HasPrefix(w, v.PrincipalPrefix) {
				pairs = append(pairs, [2]string{names[i], names[j]})
			}
		}
	}
	return pairs
}

// Strings is one string or a YAML list of strings.
type Strings []string

// UnmarshalYAML splits a scalar on whitespace, or takes a list as written.
func (w *Words) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind == yaml.ScalarNode {
		*w = strings.Fields(n.Value)
		return nil
	}
	var l []string
	err := n.Decode(&l)
	*w = l
	return err
}

// UnmarshalYAML takes a scalar as a one-element list.
func (s *Strings) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind == yaml.ScalarNode {
		*s = []string{n.Value}
		return nil
	}
	var l []string
	err := n.Decode(&l)
	*s = l
	return err
}

// validatorKeys are the keys each validator type takes besides type.
var validatorKeys = map[string][]string{
	ValidatorStatic:       {"principal_prefix", "tokens"},
	ValidatorJWKS:         {"principal_prefix", "issuer", "jwks_url", "audience", "algorithms", "principal_claim", "tenant_claim", "scopes_claim"},
	ValidatorIntrospect:   {"principal_prefix", "endpoint", "client_id", "client_secret", "client_secret_env", "audience", "cache_ttl", "principal_claim", "tenant_claim", "scopes_claim"},
	ValidatorProxyHeaders: {"principal_prefix", "trusted_proxy_cidrs", "principal_header", "tenant_header", "scopes_header"},
}

// NarrowKeys narrows a validator's schema to the keys its type takes, so a
// jwks key on a static entry is an unknown key, named as such.
func (*Validator) NarrowKeys(node *yaml.Node, fields map[string]reflect.StructField, path string) (map[string]reflect.StructField, error) {
	typ := ""
	for i := 0; i+1 < len(node.Content); i += 2 {
		if node.Content[i].Value == "type" {
			typ = node.Content[i+1].Value
		}
	}
	keys, ok := validatorKeys[typ]
	if !ok {
		if typ == "" {
			return nil, fmt.Errorf("%s: required; write one of %s", core.Join(path, "type"), strings.Join(slices.Sorted(maps.Keys(validatorKeys)), ", "))
		}
		return nil, fmt.Errorf("%s: %q is not a validator type; write one of %s", core.Join(path, "type"), typ, strings.Join(slices.Sorted(maps.Keys(validatorKeys)), ", "))
	}
	out := map[string]reflect.StructField{"type": fields["type"]}
	for _, k := range keys {
		out[k] = fields[k]
	}
	return out, nil
}

// Supported JWS algorithms for jwks. none and the HMAC family are refused:
// an HMAC key published in a JWKS is a shared secret anyone can sign with.
var jwsAlgorithms = []string{"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"}

// validate checks the auth: block, resolves every <key>_env secret and
// parses the CIDRs. Nothing it says ever contains a secret value.
func (a *Auth) validate() error {
	if a.AdminScope == nil {
		s := DefaultAdminScope
		a.AdminScope = &s
	}
	if len(a.Validators) == 0 {
		return fmt.Errorf("broker config: auth.validators: required, and at least one; an auth: block with no validator accepts nobody (remove the block to run unauthenticated)")
	}
	if err := a.validateProxyListen(); err != nil {
		return err
	}
	for i := range a.Validators {
		v := &a.Validators[i]
		path := ValidatorPath(i)
		if strings.ContainsFunc(v.PrincipalPrefix, unicode.IsControl) {
			return fmt.Errorf("broker config: %s.principal_prefix: %q holds a control character; a principal id is logged and compared as text, so use printable characters (such as \"oidc:\")", path, v.PrincipalPrefix)
		}
		var err error
		switch v.Type {
		case ValidatorStatic:
			err = v.validateStatic(path)
		case ValidatorJWKS:
			err = v.validateJWKS(path)
		case ValidatorIntrospect:
			err = v.validateIntrospect(path)
		case ValidatorProxyHeaders:
			err = v.validateProxy(path, a.ProxyListen != "")
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func required(path, key, value, hint string) error {
	if strings.TrimSpace(value) == "" {
		return fmt.Errorf("broker config: %s.%s: required; %s", path, key, hint)
	}
	return nil
}

// checkSecret enforces <key> / <key>_env: exactly one may be written.
func checkSecret(path, key, literal, envName string) error {
	switch {
	case literal != "" && envName != "":
		return fmt.Errorf("broker config: %s.%s: set together with %s_env, and neither wins; keep one", path, key, key)
	case envName != "":
		return core.CheckEnvName(path+"."+key+"_env", envName)
	case literal == "":
		return fmt.Errorf("broker config: %s.%s: required; write %s (the value) or %s_env (the name of an environment variable holding it)", path, key, key, key)
	}
	return nil
}

// ResolveSecret is the value of a checked <key> / <key>_env pair written at
// path: the literal, or the named variable, which must be set and
// non-empty. The error names the key, never a value.
func ResolveSecret(path, key, literal, envName string) (string, error) {
	if envName == "" {
		return literal, nil
	}
	v := os.Getenv(envName)
	if v == "" {
		return "", fmt.Errorf("broker config: %s.%s_env: the environment variable %s is not set or empty; export it to nexus-broker, or write %s", path, key, envName, key)
	}
	return v, nil
}

// TokenPath is the key path of static token j of validator i, for errors.
func TokenPath(i, j int) string { return fmt.Sprintf("auth.validators[%d].tokens[%d]", i, j) }

// ValidatorPath is the key path of validator i, for errors.
func ValidatorPath(i int) string { return fmt.Sprintf("auth.validators[%d]", i) }

func (v *Validator) validateStatic(path string) error {
	if len(v.Tokens) == 0 {
		return fmt.Errorf("broker config: %s.tokens: required, and at least one; list token, principal and optional tenant and scopes", path)
	}
	for i := range v.Tokens {
		t := &v.Tokens[i]
		tp := fmt.Sprintf("%s.tokens[%d]", path, i)
		if err := checkSecret(tp, "token", t.Token, t.TokenEnv); err != nil {
			return err
		}
		if err := required(tp, "principal", t.Principal, "name the principal this token authenticates as (it owns the leases claimed with it)"); err != nil {
			return err
		}
	}
	return nil
}

func (v *Validator) validateJWKS(path string) error {
	if err := required(path, "issuer", v.Issuer, "give the exact iss value your issuer puts in its tokens"); err != nil {
		return err
	}
	if err := checkURL(path+".jwks_url", v.JWKSURL); err != nil {
		return err
	}
	if err := checkList(path+".audience", v.Audience, "give the audience your tokens carry (a string or a list: any one of them is accepted)"); err != nil {
		return err
	}
	if len(v.Algorithms) == 0 {
		v.Algorithms = Strings{"RS256"}
	}
	for i, alg := range v.Algorithms {
		key := fmt.Sprintf("%s.algorithms[%d]", path, i)
		switch {
		case strings.EqualFold(alg, "none"):
			return fmt.Errorf("broker config: %s: \"none\" is refused: an unsigned token proves nothing; use one of %s", key, strings.Join(jwsAlgorithms, ", "))
		case strings.HasPrefix(strings.ToUpper(alg), "HS"):
			return fmt.Errorf("broker config: %s: %q is refused: an HMAC key is a shared secret, so anyone able to verify could also sign; use one of %s", key, alg, strings.Join(jwsAlgorithms, ", "))
		case !slices.Contains(jwsAlgorithms, alg):
			return fmt.Errorf("broker config: %s: %q is not a supported algorithm; use one of %s", key, alg, strings.Join(jwsAlgorithms, ", "))
		}
	}
	return required(path, "principal_claim", v.PrincipalClaim,
		"name the claim that identifies the caller (for example sub); there is no default, because lease ownership is equality on it")
}

func (v *Validator) validateIntrospect(path string) error {
	if err := checkURL(path+".endpoint", v.Endpoint); err != nil {
		return err
	}
	if err := required(path, "client_id", v.ClientID, "give the client id the broker authenticates to the introspection endpoint with"); err != nil {
		return err
	}
	if err := checkSecret(path, "client_secret", v.ClientSecret, v.ClientSecretEnv); err != nil {
		return err
	}
	if v.Audience != nil {
		if err := checkList(path+".audience", v.Audience, "give the audience the endpoint reports in aud for tokens meant for this broker (a string or a list: any one of them is accepted), or remove the key to accept any"); err != nil {
			return err
		}
	}
	switch {
	case v.CacheTTL == nil:
		d := core.Duration(DefaultIntrospectCacheTTL)
		v.CacheTTL = &d
	case *v.CacheTTL < 0:
		return fmt.Errorf("broker config: %s.cache_ttl: %s is negative; give how long an active answer is reused (0 asks the endpoint every time), or remove the key for the default %s", path, v.CacheTTL.D(), DefaultIntrospectCacheTTL)
	}
	// RFC 7662 names the subject and the scopes of a token.
	if v.PrincipalClaim == "" {
		v.PrincipalClaim = "sub"
	}
	if v.ScopesClaim == "" {
		v.ScopesClaim = "scope"
	}
	return nil
}

func (v *Validator) validateProxy(path string, proxyListen bool) error {
	if v.TrustedProxyCIDRs == nil && proxyListen {
		v.Prefixes = nil
	} else if err := checkList(path+".trusted_proxy_cidrs", v.TrustedProxyCIDRs,
		"list your authenticating proxy's own address, such as 10.4.0.7/32 (the list is the whole security model of this validator), or give auth.proxy_listen, a unix socket a proxy on this host connects to"); err != nil {
		return err
	}
	v.Prefixes = nil
	local := hostAddrs()
	for i, s := range v.TrustedProxyCIDRs {
		key := fmt.Sprintf("%s.trusted_proxy_cidrs[%d]", path, i)
		p, err := netip.ParsePrefix(strings.TrimSpace(s))
		if err != nil {
			a, aerr := netip.ParseAddr(strings.TrimSpace(s))
			if aerr != nil {
				return fmt.Errorf("broker config: %s: %q is not a CIDR (such as 10.4.0.7/32) or an address", key, s)
			}
			p = netip.PrefixFrom(a, a.BitLen())
		}
		if p.Bits() == 0 {
			return fmt.Errorf("broker config: %s: %q trusts every address on the network to name itself as any user; list the proxy's own address (a /32 or /128) instead", key, s)
		}
		p = unmapPrefix(p.Masked())
		if a, ok := holdsHostAddr(p, local); ok {
			return fmt.Errorf("broker config: %s: %q holds %s, an address of this host: any process here (an instance included) could connect from it and name itself as any user; run the proxy on this host against auth.proxy_listen (a unix socket) instead, or list only addresses of other hosts", key, s, a)
		}
		v.Prefixes = append(v.Prefixes, p)
	}
	if err := required(path, "principal_header", v.PrincipalHeader, "name the header your proxy puts the authenticated user in, such as X-Forwarded-User"); err != nil {
		return err
	}
	for _, h := range []struct{ key, v string }{{"principal_header", v.PrincipalHeader}, {"tenant_header", v.TenantHeader}, {"scopes_header", v.ScopesHeader}} {
		if h.v != "" && !validHeaderName(h.v) {
			return fmt.Errorf("broker config: %s.%s: %q is not an HTTP header name", path, h.key, h.v)
		}
	}
	return nil
}

// validateProxyListen checks auth.proxy_listen and its group.
func (a *Auth) validateProxyListen() error {
	if a.ProxyListen == "" {
		if a.ProxyListenGroup != "" {
			return fmt.Errorf("broker config: auth.proxy_listen_group: set without auth.proxy_listen; give the socket's path, or remove the key")
		}
		return nil
	}
	if !filepath.IsAbs(a.ProxyListen) {
		return fmt.Errorf("broker config: auth.proxy_listen: %q is not an absolute path; give the unix socket's full path, such as /run/nexus-broker/proxy.sock", a.ProxyListen)
	}
	if !slices.ContainsFunc(a.Validators, func(v Validator) bool { return v.Type == ValidatorProxyHeaders }) {
		return fmt.Errorf("broker config: auth.proxy_listen: set with no proxy_headers validator, so nothing would be read from the proxy; add one, or remove the key")
	}
	return nil
}

// unmapPrefix writes an IPv4-mapped IPv6 prefix as the IPv4 one it is, so
// it matches the unmapped peers it is compared with.
func unmapPrefix(p netip.Prefix) netip.Prefix {
	if p.Addr().Is4In6() && p.Bits() >= 96 {
		return netip.PrefixFrom(p.Addr().Unmap(), p.Bits()-96)
	}
	return p
}

// loopbackNets are this host's whatever its interfaces: 127.0.0.0/8 and
// ::1, the IPv4 range mapped too.
var loopbackNets = []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("::1/128"), netip.MustParsePrefix("::ffff:127.0.0.0/104")}

// hostAddrs are the addresses of this host's interfaces, unmapped.
func hostAddrs() []netip.Addr {
	addrs, _ := net.InterfaceAddrs()
	var out []netip.Addr
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(n.IP); ok {
				out = append(out, ip.Unmap())
			}
		}
	}
	return out
}

// holdsHostAddr is an address of this host that p contains: loopback or
// one of local, in plain or IPv4-mapped form.
func holdsHostAddr(p netip.Prefix, local []netip.Addr) (netip.Addr, bool) {
	for _, l := range loopbackNets {
		switch {
		case !p.Overlaps(l):
		case l.Contains(p.Addr()):
			return p.Addr().Unmap(), true
		case l.IsSingleIP():
			return l.Addr(), true
		default:
			return l.Addr().Next().Unmap(), true
		}
	}
	for _, a := range local {
		if p.Contains(a) || (a.Is4() && p.Contains(netip.AddrFrom16(a.As16()))) {
			return a, true
		}
	}
	return netip.Addr{}, false
}

// IsHostAddress reports whether a is, now, an address of this host:
// loopback or on any local interface (IPv4-mapped unmapped first).
func IsHostAddress(a netip.Addr) bool {
	a = a.Unmap()
	if a.IsLoopback() {
		return true
	}
	return slices.Contains(hostAddrs(), a)
}

func validHeaderName(s string) bool {
	for _, r := range s {
		if r <= ' ' || r >= 0x7f || strings.ContainsRune(`"(),/:;<=>?@[\]{}`, r) {
			return false
		}
	}
	return s != "" && http.CanonicalHeaderKey(s) != ""
}

func checkURL(key, s string) error {
	if strings.TrimSpace(s) == "" {
		return fmt.Errorf("broker config: %s: required; give an http:// or https:// URL", key)
	}
	u, err := url.Parse(s)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("broker config: %s: %q is not an http:// or https:// URL", key, s)
	}
	return nil
}

func checkList(key string, l []string, hint string) error {
	if len(l) == 0 {
		return fmt.Errorf("broker config: %s: required, and at least one; %s", key, hint)
	}
	for i, s := range l {
		if strings.TrimSpace(s) == "" {
			return fmt.Errorf("broker config: %s[%d]: empty; %s", key, i, hint)
		}
	}
	return nil
}
