package echo

import (
	"encoding/json"
	"testing"
)

func TestPayloadType(t *testing.T) {
	for payload, want := range map[string]string{
		`{"type":"input","content":"hi"}`:                         "input",
		` { "content" : {"type":"nested"} , "type" : "cancel" } `: "cancel",
		`{"TYPE":"input"}`:                                        "input",
		`{"type":"a","Type":"hitl.response"}`:                     "hitl.response",
		`{"n":[1,{"x":"]"}],"s":"\"}","b":true,"type":"echo"}`:    "echo",
		`{"type":"in\u0070ut"}`:                                   "input",
		`{"t\u0079pe":"input"}`:                                   "input",
		`{"type":5}`:                                              "",
		`{"type":null}`:                                           "",
		`{}`:                                                      "",
		`"input"`:                                                 "",
		`[{"type":"input"}]`:                                      "",
		`null`:                                                    "",
	} {
		if got := string(payloadType([]byte(payload))); got != want {
			t.Errorf("payloadType(%s) = %q, want %q", payload, got, want)
		}
	}
}

// FuzzPayloadType checks the fast scan against encoding/json, which decides
// how a stock nexus reads the same payload.
func FuzzPayloadType(f *testing.F) {
	for _, seed := range []string{
		`{"type":"input","content":"hi"}`, `{"a":[1,"]",{"b":null}],"Type":"cancel"}`,
		`{"type":"x\"y"}`, `{"k":-1.5e3 ,"type":"hitl.response"}`, `[]`, `{"type":{"type":"input"}}`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, p []byte) {
		if !json.Valid(p) {
			return // brokerframe.Decode never hands over invalid JSON
		}
		var head struct {
			Type string `json:"type"`
		}
		_ = json.Unmarshal(p, &head)
		if got := string(payloadType(p)); got != head.Type {
			t.Fatalf("payloadType(%s) = %q, encoding/json says %q", p, got, head.Type)
		}
	})
}
