package a2a

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
	"testing"
)

// sendBody is a send as the official client writes it.
const sendBody = `{"jsonrpc":"2.0","method":"SendStreamingMessage","params":{"message":{"messageId":"m1","contextId":"c1","role":"ROLE_USER","parts":[{"text":"hello there"}]}},"id":"r1"}`

func TestDecodeRPCReadsASendInOnePass(t *testing.T) {
	req, sent, err := DecodeRPC([]byte(sendBody))
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
		req, sent, err := DecodeRPC([]byte(body))
		if err != nil || sent != nil || req.Method == "" {
			t.Errorf("%s: decodeRPC = %+v, %+v, %v; want the envelope alone", body, req, sent, err)
		}
	}
	if _, _, err := DecodeRPC([]byte(`{"method":"SendMessage",`)); err == nil {
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
		req, sent, err := DecodeRPC(body)
		var two RPCRequest
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
		var sr SendRequest
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
