package a2a

import (
	"encoding/json"
	"testing"

	"github.com/nexus-broker/nexus-broker/internal/config"
)

// TestCardSecurityNamesEachValidator: one scheme per validator a client
// presents a credential to, named as upstream's chain names it (a second
// jwks is jwks#2), each its own requirement; proxy_headers is not one.
func TestCardSecurityNamesEachValidator(t *testing.T) {
	schemes, reqs := securityOf(&config.Auth{Validators: []config.Validator{
		{Type: config.ValidatorJWKS, Issuer: "https://a.example", Audience: config.Strings{"x", "y"}},
		{Type: config.ValidatorProxyHeaders},
		{Type: config.ValidatorJWKS},
		{Type: config.ValidatorIntrospect},
	}})
	got, _ := json.Marshal(map[string]any{"s": schemes, "r": reqs})
	want := `{"r":[{"schemes":{"jwks":[]}},{"schemes":{"jwks#2":[]}},{"schemes":{"introspect":[]}}],"s":{` +
		`"introspect":{"httpAuthSecurityScheme":{"description":"Opaque bearer token, verified by RFC 7662 introspection at the issuer.","scheme":"Bearer"}},` +
		`"jwks":{"httpAuthSecurityScheme":{"bearerFormat":"JWT","description":"OIDC JWT access token, verified against the issuer's published key set. Issuer: https://a.example. Audience: x, y.","scheme":"Bearer"}},` +
		`"jwks#2":{"httpAuthSecurityScheme":{"bearerFormat":"JWT","description":"OIDC JWT access token, verified against the issuer's published key set.","scheme":"Bearer"}}}}`
	if string(got) != want {
		t.Errorf("card security\n got %s\nwant %s", got, want)
	}
	if s, r := securityOf(&config.Auth{Validators: []config.Validator{{Type: config.ValidatorProxyHeaders}}}); s != nil || r != nil {
		t.Errorf("proxy_headers alone advertises %v %v", s, r)
	}
}
