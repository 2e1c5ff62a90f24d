package gateway

import (
	"encoding/json"
	"testing"

	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// FuzzRegister feeds the instance register path arbitrary first messages
// and mid-stream frames: registerOf either refuses a message with a close
// reason or returns a register frame that survives re-encoding unchanged,
// and statusState reports a state only for a JSON payload of type status
// carrying it.
func FuzzRegister(f *testing.F) {
	for _, seed := range []string{
		`{"version":1,"lease_id":"L","signal":"register","secret":"s"}`,
		`{"version":2,"lease_id":"L","signal":"register"}`,
		`{"version":1,"lease_id":"L","signal":"ready"}`,
		`{"version":1,"lease_id":"L","signal":"io","payload":{"type":"status","state":"thinking","turn_id":"t"}}`,
		`{"version":1,"signal":"io","payload":{"type":"stream.delta","content":"\"status\""}}`,
		`{"type":"status","state":"idle"}`,
		`{"type":"status","type":"echo","state":"x"}`,
		`not json`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		fr, refuse, err := registerOf(data)
		switch {
		case err != nil && refuse == "":
			t.Fatalf("an undecodable message (%v) was not refused", err)
		case refuse == "" && fr.Signal != brokerframe.SignalRegister:
			t.Fatalf("a %q frame was taken as register", fr.Signal)
		case refuse == "":
			again, err := brokerframe.Encode(fr)
			if err != nil {
				break // Encode stamps the version; a skewed one is refused later, by admitInstance
			}
			back, refuse, err := registerOf(again)
			if refuse != "" || err != nil || back.LeaseID != fr.LeaseID || back.Secret != fr.Secret {
				t.Fatalf("a register frame re-encoded reads back as %+v (%q, %v), was %+v", back, refuse, err, fr)
			}
		}
		for _, payload := range []json.RawMessage{fr.Payload, data} {
			state, ok := statusState(payload)
			if !ok {
				if state != "" {
					t.Fatalf("no status, yet state %q", state)
				}
				continue
			}
			var p struct{ Type, State string }
			if json.Unmarshal(payload, &p) != nil || p.Type != brokerframe.IOStatus || p.State != state {
				t.Fatalf("statusState(%q) = %q, but the payload reads as %+v", payload, state, p)
			}
		}
	})
}
