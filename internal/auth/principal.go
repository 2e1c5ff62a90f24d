// Package auth verifies client credentials for the gateway: the ordered
// validator chain of the auth: block (static, jwks, introspect,
// proxy_headers), the principal it yields, and the single-use WebSocket
// tickets the broker mints itself. It decides who a caller is; what a
// principal may touch (lease ownership) is the gateway's.
//
// Of the project it may import internal/config, never the lease core,
// the layers above it or spawnd's client (internal/gateway/layers_test.go
// checks it).
package auth

import "slices"

// Principal is a verified caller. The zero Principal is the anonymous one:
// every caller while no auth: block exists.
type Principal struct {
	ID     string
	Tenant string
	Scopes []string
}

// Anonymous reports whether p carries no identity.
func (p Principal) Anonymous() bool { return p.ID == "" }

// HasScope reports whether p holds scope; the empty scope is held by
// nobody, which is how admin_scope: "" means no operator.
func (p Principal) HasScope(scope string) bool {
	return scope != "" && slices.Contains(p.Scopes, scope)
}
