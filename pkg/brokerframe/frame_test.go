package brokerframe

import (
	"bytes"
	"encoding/json"
	"errors"
	"reflect"
	"testing"
)

func TestEncodeIsUpstreamByteCompatible(t *testing.T) {
	cases := []struct {
		f    Frame
		want string
	}{
		{Frame{LeaseID: "L", Signal: SignalRegister, Secret: "s"}, `{"version":1,"lease_id":"L","signal":"register","secret":"s"}`},
		{Frame{LeaseID: "L", Signal: SignalReady}, `{"version":1,"lease_id":"L","signal":"ready"}`},
		{Frame{LeaseID: "L", Signal: SignalSessionIDReport, SessionID: "S"}, `{"version":1,"lease_id":"L","signal":"session-id-report","session_id":"S"}`},
		{Frame{Version: 7, LeaseID: "L", Signal: SignalIO, Seq: 42, Payload: json.RawMessage(`{"type":"stream.delta","content":"…"}`)},
			`{"version":1,"lease_id":"L","signal":"io","seq":42,"payload":{"type":"stream.delta","content":"…"}}`},
		{Frame{LeaseID: "L", Signal: SignalStreamGap, Payload: json.RawMessage(`{"reason":"restarted","requested_from_seq":9}`)},
			`{"version":1,"lease_id":"L","signal":"stream-gap","payload":{"reason":"restarted","requested_from_seq":9}}`},
	}
	for _, c := range cases {
		got, err := Encode(c.f)
		if err != nil || string(got) != c.want {
			t.Errorf("Encode(%+v) = %s, %v\nwant %s", c.f, got, err, c.want)
		}
	}
}

func TestDecode(t *testing.T) {
	f, err := Decode([]byte(`{"version":3,"lease_id":"L","signal":"register"}`))
	if err != nil || f.Version != 3 || f.Signal != SignalRegister {
		t.Fatalf("a version-skewed frame must decode so the broker can name the skew: %+v %v", f, err)
	}
	for _, bad := range []string{`{"signal":"bogus"}`, `{"type":"input"}`, `[]`, `{`, ``} {
		if _, err := Decode([]byte(bad)); err == nil {
			t.Errorf("Decode(%q) succeeded", bad)
		}
	}
	if _, err := Decode([]byte(`{"signal":"bogus"}`)); !errors.Is(err, ErrInvalidSignal) {
		t.Errorf("unknown signal error = %v, want ErrInvalidSignal", err)
	}
}

func TestStreamGapShape(t *testing.T) {
	got, _ := json.Marshal(StreamGap{Reason: GapEvicted, RequestedFromSeq: 41, MissingFromSeq: 42, MissingThroughSeq: 118})
	if string(got) != `{"reason":"evicted","requested_from_seq":41,"missing_from_seq":42,"missing_through_seq":118}` {
		t.Fatal(string(got))
	}
	got, _ = json.Marshal(StreamGap{Reason: GapRestarted, RequestedFromSeq: 7})
	if string(got) != `{"reason":"restarted","requested_from_seq":7}` {
		t.Fatal(string(got))
	}
}

// FuzzDecode: Decode never panics, accepts only known signals, and what it
// accepts re-encodes to a frame that decodes to the same thing.
func FuzzDecode(f *testing.F) {
	for _, s := range []string{
		`{"version":1,"lease_id":"L","signal":"register","secret":"s"}`,
		`{"version":1,"lease_id":"L","signal":"io","seq":3,"payload":{"type":"input","content":"hi"}}`,
		`{"version":1,"lease_id":"L","signal":"stream-gap","payload":{"reason":"evicted"}}`,
		`{"type":"input","content":"bare"}`, `{"signal":null}`, `{"payload":1e999}`, "\x00",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		fr, err := Decode(data)
		if err != nil {
			return
		}
		if !fr.Signal.Valid() {
			t.Fatalf("accepted unknown signal %q", fr.Signal)
		}
		enc, err := Encode(fr)
		if err != nil {
			t.Fatalf("re-encoding an accepted frame: %v", err)
		}
		// Same meaning, field order and omitempty rules as encoding/json.
		std, _ := json.Marshal(struct {
			Frame
			Version int `json:"version"`
		}{fr, Version})
		var a1, b1 any
		if json.Unmarshal(enc, &a1) != nil || json.Unmarshal(std, &b1) != nil || !reflect.DeepEqual(a1, b1) {
			t.Fatalf("hand encoding differs from encoding/json:\n%s\n%s", enc, std)
		}
		back, err := Decode(enc)
		if err != nil || back.LeaseID != fr.LeaseID || back.Signal != fr.Signal || back.Seq != fr.Seq ||
			back.Secret != fr.Secret || back.SessionID != fr.SessionID || back.Version != Version {
			t.Fatalf("round trip changed the frame: %+v → %+v (%v)", fr, back, err)
		}
		if len(fr.Payload) > 0 && !json.Valid(back.Payload) {
			t.Fatalf("payload no longer valid JSON: %q", back.Payload)
		}
		// Encoding may re-escape (& becomes \u0026) but never changes meaning.
		var a, b any
		if json.Unmarshal(fr.Payload, &a) == nil {
			if err := json.Unmarshal(back.Payload, &b); err != nil || !reflect.DeepEqual(a, b) {
				t.Fatalf("payload changed meaning: %s → %s", fr.Payload, back.Payload)
			}
		}
	})
}

func TestEncodeKeepsPayloadBytes(t *testing.T) {
	got, err := Encode(Frame{LeaseID: "L", Signal: SignalIO, Payload: json.RawMessage("{ \"content\": \"a & <b>\" }")})
	if err != nil || string(got) != `{"version":1,"lease_id":"L","signal":"io","payload":{"content":"a & <b>"}}` {
		t.Fatalf("%s %v", got, err)
	}
	if _, err := Encode(Frame{Signal: SignalIO, Payload: json.RawMessage(`{`)}); err == nil {
		t.Fatal("an invalid payload encoded")
	}
}

// FuzzDecodeFastAgrees: whenever the fast path accepts an input,
// encoding/json decodes it to the very same frame.
func FuzzDecodeFastAgrees(f *testing.F) {
	for _, s := range []string{
		`{"version":1,"lease_id":"L","signal":"io","seq":3,"payload":{"type":"input","content":"hi"}}`,
		`{"version":1,"lease_id":"L","signal":"register","secret":"s"}`,
		` { "signal" : "ready" , "x" : [1,{"a":"\""}] } `,
		`{"Signal":"io"}`, `{"seq":01}`, `{"seq":1.5}`, `{"payload":null}`, `{"lease_id":"a\u00e9"}`,
		`{"version":1,"version":2}`, `{}`, `{"payload":"x"}garbage`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		fast, ok := decodeFast(data, false, "")
		if !ok {
			return
		}
		if shared, _ := decodeFast(data, true, "L"); shared.LeaseID != fast.LeaseID || string(shared.Payload) != string(fast.Payload) {
			t.Fatalf("shared %+v\nfast   %+v\ninput %q", shared, fast, data)
		}
		var std Frame
		if err := json.Unmarshal(data, &std); err != nil {
			t.Fatalf("fast path accepted what encoding/json refuses (%v): %q", err, data)
		}
		if fast.Version != std.Version || fast.LeaseID != std.LeaseID || fast.Signal != std.Signal || fast.Secret != std.Secret ||
			fast.SessionID != std.SessionID || fast.Seq != std.Seq || string(fast.Payload) != string(std.Payload) {
			t.Fatalf("fast %+v\nstd  %+v\ninput %q", fast, std, data)
		}
	})
}

func BenchmarkDecode(b *testing.B) {
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Decode(benchFrame); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkDecodeShared is the relay's decode: no allocation.
func BenchmarkDecodeShared(b *testing.B) {
	b.ReportAllocs()
	for b.Loop() {
		if _, err := DecodeShared(benchFrame, "133194fa6928971ca911b73fddd27c10"); err != nil {
			b.Fatal(err)
		}
	}
}

var benchFrame = []byte(`{"version":1,"lease_id":"133194fa6928971ca911b73fddd27c10","signal":"io","seq":42,"payload":{"type":"stream.delta","turn_id":"t-1","content":"0123456789"}}`)

// The relay decodes every frame both ways with DecodeShared: the ordinary
// frame must cost it no allocation, its payload data's own bytes.
func TestDecodeSharedAllocatesNothing(t *testing.T) {
	const id = "133194fa6928971ca911b73fddd27c10"
	var f Frame
	if n := testing.AllocsPerRun(100, func() { f, _ = DecodeShared(benchFrame, id) }); n != 0 {
		t.Errorf("DecodeShared: %v allocations per frame, want 0", n)
	}
	if f.LeaseID != id || f.Signal != SignalIO || f.Seq != 42 || !bytes.Contains(benchFrame, f.Payload) ||
		&f.Payload[0] != &benchFrame[bytes.Index(benchFrame, []byte(`{"type"`))] {
		t.Errorf("DecodeShared = %+v, want the frame with its payload in place", f)
	}
}
