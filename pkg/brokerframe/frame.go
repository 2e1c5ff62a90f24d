// Package brokerframe is the wire envelope between a nexus-broker gateway,
// the instances it spawns (which dial back to /instance) and the clients that
// talk to those instances over /lease/{id}.
//
// It is byte-compatible with upstream nexus's pkg/brokerframe: same field
// names, same omitempty rules, same signal set, so a stock nexus build (whose
// nexus.io.broker plugin speaks that envelope) registers with our broker
// unchanged. It depends on the standard library only, so instances and clients
// can import it without pulling in the broker.
package brokerframe

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
)

// Version is the frame schema version. Encode always stamps it; Decode accepts
// any value so that the broker can tell a version-skewed register frame (which
// it refuses and logs by name) from a corrupt one.
const Version = 1

// Signal is what a frame carries: a lifecycle step or an IO payload.
type Signal string

// The complete signal set. An unknown signal makes a frame undecodable.
const (
	SignalRegister        Signal = "register"
	SignalReady           Signal = "ready"
	SignalSessionIDReport Signal = "session-id-report"
	SignalShutdown        Signal = "shutdown"
	SignalIO              Signal = "io"
	// SignalStreamGap is broker → client only: the frames a resuming client
	// asked for are no longer retained. It carries no seq.
	SignalStreamGap Signal = "stream-gap"
)

// Valid reports whether s is one of the known signals.
func (s Signal) Valid() bool {
	switch s {
	case SignalRegister, SignalReady, SignalSessionIDReport, SignalShutdown, SignalIO, SignalStreamGap:
		return true
	}
	return false
}

// Frame is one WebSocket text message.
type Frame struct {
	Version   int    `json:"version"`
	LeaseID   string `json:"lease_id"`
	Signal    Signal `json:"signal"`
	Secret    string `json:"secret,omitempty"`
	SessionID string `json:"session_id,omitempty"`
	// Seq numbers client-bound frames per lease, from 1. Zero (omitted) on
	// every other frame.
	Seq     uint64          `json:"seq,omitempty"`
	Payload json.RawMessage `json:"payload,omitempty"`
}

// ErrInvalidSignal is wrapped by Encode and Decode for a frame whose signal is
// not in the known set.
var ErrInvalidSignal = errors.New("brokerframe: invalid signal")

// Encode stamps Version and encodes f with the same field order and
// omitempty rules as encoding/json would. It is written by hand because it
// sits on the relay's hot path: it appends the payload as it is (compacted
// and validated, never re-escaped), so a payload reaches its peer with the
// bytes it was sent with.
func Encode(f Frame) ([]byte, error) {
	if !f.Signal.Valid() {
		return nil, fmt.Errorf("%w %q", ErrInvalidSignal, f.Signal)
	}
	buf := bytes.NewBuffer(make([]byte, 0, 96+len(f.LeaseID)+len(f.Secret)+len(f.SessionID)+len(f.Payload)))
	buf.WriteString(`{"version":1,"lease_id":`)
	appendString(buf, f.LeaseID)
	buf.WriteString(`,"signal":`)
	appendString(buf, string(f.Signal))
	if f.Secret != "" {
		buf.WriteString(`,"secret":`)
		appendString(buf, f.Secret)
	}
	if f.SessionID != "" {
		buf.WriteString(`,"session_id":`)
		appendString(buf, f.SessionID)
	}
	if f.Seq != 0 {
		buf.WriteString(`,"seq":`)
		buf.Write(strconv.AppendUint(buf.AvailableBuffer(), f.Seq, 10))
	}
	if len(f.Payload) > 0 {
		buf.WriteString(`,"payload":`)
		if err := json.Compact(buf, f.Payload); err != nil {
			return nil, fmt.Errorf("brokerframe: encode: payload is not JSON: %w", err)
		}
	}
	buf.WriteByte('}')
	return buf.Bytes(), nil
}

// appendString writes s as a JSON string. Ids are plain ASCII, so that is
// the fast path; anything else goes through encoding/json.
func appendString(buf *bytes.Buffer, s string) {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c >= 0x7f || c == '"' || c == '\\' || c == '<' || c == '>' || c == '&' {
			b, _ := json.Marshal(s) // a string always marshals
			buf.Write(b)
			return
		}
	}
	buf.WriteByte('"')
	buf.WriteString(s)
	buf.WriteByte('"')
}

// Decode unmarshals one frame and checks its signal. The version is not
// checked here; see Version.
func Decode(data []byte) (Frame, error) {
	return decode(data, false, "")
}

// DecodeShared is Decode for a caller that keeps data unchanged while it
// uses the frame, as a relay does: the payload is data's own bytes rather
// than a copy, and a lease_id equal to leaseID is leaseID itself, so the
// ordinary frame costs no allocation. Whatever the fast path leaves to
// encoding/json is decoded as Decode does it.
func DecodeShared(data []byte, leaseID string) (Frame, error) {
	return decode(data, true, leaseID)
}

func decode(data []byte, shared bool, leaseID string) (Frame, error) {
	if f, ok := decodeFast(data, shared, leaseID); ok && f.Signal.Valid() {
		return f, nil
	}
	var f Frame // its own variable: the fast path's frame stays off the heap
	if err := json.Unmarshal(data, &f); err != nil {
		return Frame{}, fmt.Errorf("brokerframe: decode: %w", err)
	}
	if !f.Signal.Valid() {
		return Frame{}, fmt.Errorf("%w %q", ErrInvalidSignal, f.Signal)
	}
	return f, nil
}

// Gap reasons carried by a stream-gap frame's payload.
const (
	GapEvicted   = "evicted"
	GapRestarted = "restarted"
)

// StreamGap is the payload of a stream-gap frame. The missing range is
// inclusive and omitted for GapRestarted, where no range can be named.
type StreamGap struct {
	Reason            string `json:"reason"`
	RequestedFromSeq  uint64 `json:"requested_from_seq"`
	MissingFromSeq    uint64 `json:"missing_from_seq,omitempty"`
	MissingThroughSeq uint64 `json:"missing_through_seq,omitempty"`
}
