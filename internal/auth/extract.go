package auth

import (
	"context"
	"net"
	"net/http"
	"net/netip"
	"strings"
)

// Credential is what a request presents, read without judging it.
type Credential struct {
	// Bearer is the token of an "Authorization: Bearer" header.
	Bearer string
	// Authorization is set when any Authorization header was sent, bearer
	// or not: a credential that is present but unusable is rejected, not
	// absent.
	Authorization bool
	// Ticket is a non-empty ?ticket= (read only where tickets are taken).
	Ticket string
	// Peer is the TCP peer; X-Forwarded-For is never read.
	Peer netip.Addr
	// ViaProxySocket is set for a request on auth.proxy_listen: only
	// proxy_headers judge it.
	ViaProxySocket bool
	Header         http.Header
}

type proxyConnKey struct{}

// OnProxySocket marks ctx as a connection's on auth.proxy_listen (an
// http.Server's ConnContext).
func OnProxySocket(ctx context.Context) context.Context {
	return context.WithValue(ctx, proxyConnKey{}, true)
}

// Extract reads r's credential. withTicket says the route takes ?ticket=
// (WS /lease/{id} only).
func Extract(r *http.Request, withTicket bool) Credential {
	c := Credential{Header: r.Header, ViaProxySocket: r.Context().Value(proxyConnKey{}) != nil}
	if h := r.Header.Values("Authorization"); len(h) > 0 {
		c.Authorization = true
		// Exactly one header, "Bearer <token>"; anything else is rejected.
		if len(h) == 1 {
			scheme, tok, ok := strings.Cut(strings.TrimSpace(h[0]), " ")
			if ok && strings.EqualFold(scheme, "Bearer") {
				c.Bearer = strings.TrimSpace(tok)
			}
		}
	}
	if withTicket {
		c.Ticket = r.URL.Query().Get("ticket")
	}
	if host, _, err := net.SplitHostPort(r.RemoteAddr); err == nil {
		if a, err := netip.ParseAddr(host); err == nil {
			c.Peer = a.Unmap()
		}
	}
	return c
}
