package auth

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/nexus-broker/nexus-broker/internal/config"
)

// proxyHeaders takes the identity an authenticating proxy puts in a header,
// on auth.proxy_listen, or from a TCP peer inside trusted_proxy_cidrs that
// is not an address of this host.
type proxyHeaders struct {
	cfg *config.Validator
}

var (
	errUntrustedPeer = errors.New("proxy_headers: identity header from a peer outside trusted_proxy_cidrs")
	errHostPeer      = errors.New("proxy_headers: identity header from an address of this host, which any local process can connect from; a proxy on this host connects to auth.proxy_listen")
)

func (v *proxyHeaders) validate(_ context.Context, c *Credential) (Principal, error) {
	id := strings.TrimSpace(c.Header.Get(v.cfg.PrincipalHeader))
	if id == "" {
		return Principal{}, errNotPresented
	}
	for _, h := range []string{v.cfg.PrincipalHeader, v.cfg.TenantHeader, v.cfg.ScopesHeader} {
		if h != "" && len(c.Header.Values(h)) > 1 {
			// Which one the proxy set is unknowable.
			return Principal{}, fmt.Errorf("proxy_headers: %s sent more than once", h)
		}
	}
	if !c.ViaProxySocket {
		if !v.trusted(c) {
			return Principal{}, errUntrustedPeer
		}
		if config.IsHostAddress(c.Peer) {
			return Principal{}, errHostPeer
		}
	}
	p := Principal{ID: id}
	if v.cfg.TenantHeader != "" {
		p.Tenant = strings.TrimSpace(c.Header.Get(v.cfg.TenantHeader))
	}
	if v.cfg.ScopesHeader != "" {
		// Proxies send groups comma- or space-separated.
		p.Scopes = strings.FieldsFunc(c.Header.Get(v.cfg.ScopesHeader), func(r rune) bool { return r == ',' || r == ' ' || r == '\t' })
	}
	return p, nil
}

func (v *proxyHeaders) trusted(c *Credential) bool {
	if !c.Peer.IsValid() {
		return false
	}
	for _, pfx := range v.cfg.Prefixes {
		if pfx.Contains(c.Peer) {
			return true
		}
	}
	return false
}
