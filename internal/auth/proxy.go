package auth

import (
	"context"
	"errors"
	"strings"

	"github.com/nexus-broker/nexus-broker/internal/config"
)

// proxyHeaders takes the identity an authenticating proxy puts in a header,
// from a TCP peer inside trusted_proxy_cidrs only.
type proxyHeaders struct {
	cfg *config.Validator
}

var errUntrustedPeer = errors.New("proxy_headers: identity header from a peer outside trusted_proxy_cidrs")

func (v *proxyHeaders) validate(_ context.Context, c *Credential) (Principal, error) {
	id := strings.TrimSpace(c.Header.Get(v.cfg.PrincipalHeader))
	if id == "" {
		return Principal{}, errNotPresented
	}
	if !v.trusted(c) {
		return Principal{}, errUntrustedPeer
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
