package gateway

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
	"testing"

	"github.com/nexus-broker/nexus-broker/internal/a2a"
	"github.com/nexus-broker/nexus-broker/internal/config"
)

// sendBody is a send as the official client writes it.
const sendBody = `{"jsonrpc":"2.0","method":"SendStreamingMessage","params":{"message":{"messageId":"m1","contextId":"c1","role":"ROLE_USER","parts":[{"text":"hello there"}]}},"id":"r1"}`

func TestDecodeRPCReadsASendInOnePass(t *testing.T) {
	req, sent, err := decodeRPC([]byte(sendBody))
	if err != nil || sent == nil {
		t.Fatalf("decodeRPC = %+v, %v, %v; want the send's params", req, sent, err)
	}
	if req.JSONRPC != "2.0" || req.Method != "SendStreamingMessage" || string(req.ID) != `"r1"` {
		t.Fatalf("envelope %+v", req)
	}
	if m := sent.Message; m == nil || m.MessageID != "m1" || m.ContextID != "c1" || len(m.Parts) != 1 || *m.Parts[0].Text != "hello there" {
		t.Fatalf("params %+v", sent)
	}
}

func TestDecodeRPCLeavesOtherRequestsToTheirMethod(t *testing.T) {
	for _, body := range []string{
		`{"jsonrpc":"2.0","method":"GetTask","params":{"id":"t1"},"id":1}`,
		`{"jsonrpc":"2.0","method":"SendMessage","params":null,"id":1}`,
		`{"jsonrpc":"2.0","method":"SendMessage","params":[1],"id":1}`,
		`{"jsonrpc":"2.0","method":"SendMessage","params":{"message":{"role":5}},"id":1}`,
		`{"jsonrpc":"2.0","method":"SendMessage","id":1}`,
	} {
		req, sent, err := decodeRPC([]byte(body))
		if err != nil || sent != nil || req.Method == "" {
			t.Errorf("%s: decodeRPC = %+v, %+v, %v; want the envelope alone", body, req, sent, err)
		}
	}
	if _, _, err := decodeRPC([]byte(`{"method":"SendMessage",`)); err == nil {
		t.Error("a body that is not JSON decoded")
	}
}

// paramsNamedOnce reports whether body is an object naming params (as
// encoding/json matches names, ignoring case) at most once: the one case
// where decodeRPC and the two passes may differ.
func paramsNamedOnce(body []byte) bool {
	dec := json.NewDecoder(bytes.NewReader(body))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return true
	}
	n := 0
	for dec.More() {
		key, err := dec.Token()
		if err != nil {
			return true
		}
		if s, ok := key.(string); ok && strings.EqualFold(s, "params") {
			n++
		}
		var skip json.RawMessage
		if dec.Decode(&skip) != nil {
			return true
		}
	}
	return n <= 1
}

// FuzzDecodeRPCAgrees: the one-pass decode of a send answers what the
// envelope and then the params, decoded apart, answer.
func FuzzDecodeRPCAgrees(f *testing.F) {
	f.Add([]byte(sendBody))
	f.Add([]byte(`{"jsonrpc":"2.0","method":"SendMessage","params":{"message":{"messageId":"m","role":"ROLE_USER","parts":[{"text":"x"}]},"configuration":{"returnImmediately":true}},"id":7}`))
	f.Add([]byte(`{"jsonrpc":"2.0","method":"GetTask","params":{"id":"t1"},"id":1}`))
	f.Add([]byte(`{"jsonrpc":"2.0","method":"SendMessage","params":null}`))
	f.Add([]byte(`{"Method":"SendMessage","PARAMS":{"message":{}},"params":{"tenant":"x"}}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		req, sent, err := decodeRPC(body)
		var two rpcRequest
		twoErr := json.Unmarshal(body, &two)
		if (err == nil) != (twoErr == nil) {
			t.Fatalf("decodeRPC error %v, the envelope's %v", err, twoErr)
		}
		if err != nil {
			return
		}
		if req.JSONRPC != two.JSONRPC || req.Method != two.Method || !bytes.Equal(req.ID, two.ID) {
			t.Fatalf("envelope %+v, the two passes' %+v", req, two)
		}
		send := req.Method == "SendMessage" || req.Method == "SendStreamingMessage"
		var sr a2a.SendRequest
		decodes := len(two.Params) > 0 && string(two.Params) != "null" && json.Unmarshal(two.Params, &sr) == nil
		switch {
		case sent != nil && !send:
			t.Fatalf("params decoded in one pass for method %q", req.Method)
		case !paramsNamedOnce(body):
		case sent != nil && !reflect.DeepEqual(*sent, sr):
			t.Fatalf("params %+v, the two passes' %+v", *sent, sr)
		case sent == nil && send && decodes:
			t.Fatalf("a send whose params decode (%+v) took the two passes", sr)
		}
	})
}

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
