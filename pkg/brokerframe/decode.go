package brokerframe

import (
	"encoding/json"
	"strings"
)

// decodeFast decodes the envelope's ordinary shape without reflection: an
// object of the known keys with plain ASCII strings and integers. Anything
// else (escapes, non-ASCII ids, null, floats, a key that differs from a
// field's only in case) reports ok=false and is left to encoding/json, which
// stays the authority: whenever this returns ok, encoding/json decodes the
// same input to the same frame (FuzzDecodeFastAgrees checks that). With
// shared the payload aliases data and a lease_id equal to leaseID is
// leaseID (see DecodeShared).
func decodeFast(data []byte, shared bool, leaseID string) (f Frame, ok bool) {
	d := scanner{data: data}
	if !d.expect('{') {
		return f, false
	}
	if d.peek() == '}' {
		d.i++
		return f, d.end()
	}
	for {
		key, ok := d.plainString()
		if !ok || !d.expect(':') {
			return f, false
		}
		switch string(key) { // compared without allocating
		case "version":
			n, ok := d.uint(18)
			if !ok {
				return f, false
			}
			f.Version = int(n)
		case "seq":
			n, ok := d.uint(19)
			if !ok {
				return f, false
			}
			f.Seq = n
		case "lease_id", "signal", "secret", "session_id":
			s, ok := d.plainString()
			if !ok {
				return f, false
			}
			switch string(key) {
			case "lease_id":
				if shared && string(s) == leaseID {
					f.LeaseID = leaseID
				} else {
					f.LeaseID = string(s)
				}
			case "signal":
				f.Signal = signalOf(s)
			case "secret":
				f.Secret = string(s)
			default:
				f.SessionID = string(s)
			}
		default:
			if string(key) != "payload" && isFieldFold(key) {
				return f, false // encoding/json matches field names case-insensitively
			}
			raw, ok := d.value()
			if !ok {
				return f, false
			}
			switch {
			case string(key) != "payload":
			case shared:
				f.Payload = raw
			default:
				f.Payload = append(json.RawMessage(nil), raw...)
			}
		}
		switch d.next() {
		case ',':
		case '}':
			return f, d.end()
		default:
			return f, false
		}
	}
}

var fieldNames = [...]string{"version", "lease_id", "signal", "secret", "session_id", "seq", "payload"}

func isFieldFold(key []byte) bool {
	for _, k := range fieldNames {
		if strings.EqualFold(string(key), k) {
			return true
		}
	}
	return false
}

// signalOf returns the known signals without allocating a string.
func signalOf(b []byte) Signal {
	switch string(b) {
	case string(SignalIO):
		return SignalIO
	case string(SignalRegister):
		return SignalRegister
	case string(SignalReady):
		return SignalReady
	case string(SignalSessionIDReport):
		return SignalSessionIDReport
	case string(SignalShutdown):
		return SignalShutdown
	case string(SignalStreamGap):
		return SignalStreamGap
	}
	return Signal(b)
}

// scanner walks one JSON document.
type scanner struct {
	data []byte
	i    int
}

func (d *scanner) skipWS() {
	for d.i < len(d.data) {
		switch d.data[d.i] {
		case ' ', '\t', '\n', '\r':
			d.i++
		default:
			return
		}
	}
}

func (d *scanner) peek() byte {
	d.skipWS()
	if d.i < len(d.data) {
		return d.data[d.i]
	}
	return 0
}

func (d *scanner) next() byte {
	c := d.peek()
	if d.i < len(d.data) {
		d.i++
	}
	return c
}

func (d *scanner) expect(c byte) bool { return d.next() == c }

// end reports whether only white space is left.
func (d *scanner) end() bool {
	d.skipWS()
	return d.i == len(d.data)
}

// plainString reads a string of printable ASCII without escapes; the bytes
// alias the input.
func (d *scanner) plainString() ([]byte, bool) {
	if !d.expect('"') {
		return nil, false
	}
	start := d.i
	for ; d.i < len(d.data); d.i++ {
		switch c := d.data[d.i]; {
		case c == '"':
			s := d.data[start:d.i]
			d.i++
			return s, true
		case c == '\\' || c < 0x20 || c >= 0x80:
			return nil, false
		}
	}
	return nil, false
}

// uint reads an unsigned integer of at most maxDigits digits (so it cannot
// overflow), with no sign, fraction or exponent and no leading zero.
func (d *scanner) uint(maxDigits int) (uint64, bool) {
	d.skipWS()
	start := d.i
	var n uint64
	for d.i < len(d.data) && d.data[d.i] >= '0' && d.data[d.i] <= '9' {
		n = n*10 + uint64(d.data[d.i]-'0')
		d.i++
	}
	digits := d.i - start
	if digits == 0 || digits > maxDigits || (digits > 1 && d.data[start] == '0') {
		return 0, false
	}
	if d.i < len(d.data) {
		switch d.data[d.i] {
		case '.', 'e', 'E':
			return 0, false
		}
	}
	return n, true
}

// value returns the extent of one JSON value (not null), validated.
func (d *scanner) value() ([]byte, bool) {
	d.skipWS()
	start := d.i
	depth := 0
	for d.i < len(d.data) {
		c := d.data[d.i]
		switch {
		case c == '"':
			d.i++
			for d.i < len(d.data) && d.data[d.i] != '"' {
				if d.data[d.i] == '\\' {
					d.i++
				}
				d.i++
			}
			if d.i >= len(d.data) {
				return nil, false
			}
			d.i++
		case c == '{' || c == '[':
			depth++
			d.i++
		case c == '}' || c == ']':
			if depth == 0 {
				goto done
			}
			depth--
			d.i++
		case c == ',' && depth == 0:
			goto done
		default:
			d.i++
		}
	}
done:
	raw := d.data[start:d.i]
	for len(raw) > 0 && (raw[len(raw)-1] == ' ' || raw[len(raw)-1] == '\t' || raw[len(raw)-1] == '\n' || raw[len(raw)-1] == '\r') {
		raw = raw[:len(raw)-1]
	}
	if len(raw) == 0 || raw[0] == 'n' || !json.Valid(raw) {
		return nil, false
	}
	return raw, true
}
