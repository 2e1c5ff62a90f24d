package echo

import (
	"bytes"
	"encoding/json"
)

// payloadType returns the "type" member of an io payload as encoding/json
// would decode it into brokerframe.IO.Type (keys match case-insensitively, the
// last match wins, a non-object has none).
//
// It exists for the verbatim-echo path: relay benchmarks push every frame
// through here, and a full json.Unmarshal just to learn that a payload is not
// for the agent costs a third of the instance's per-frame allocations. The
// scan relies on the payload being valid JSON (brokerframe.Decode checked the
// whole frame) and hands anything unusual — an escape or non-ASCII in a key or
// in the type, a type that is not a string — to json.Unmarshal.
func payloadType(p []byte) []byte {
	if t, ok := scanType(p); ok {
		return t
	}
	var head struct {
		Type string `json:"type"`
	}
	_ = json.Unmarshal(p, &head) // on error Type stays empty: nothing to act on
	return []byte(head.Type)
}

var typeKey = []byte("type")

// scanType is the fast path of payloadType; ok is false when it cannot tell.
func scanType(p []byte) (typ []byte, ok bool) {
	i := skipSpace(p, 0)
	if i >= len(p) || p[i] != '{' {
		return nil, true
	}
	i++
	for {
		i = skipSpace(p, i)
		if i < len(p) && p[i] == ',' {
			i = skipSpace(p, i+1)
		}
		if i >= len(p) {
			return nil, false
		}
		if p[i] == '}' {
			return typ, true
		}
		key, next, plain := scanString(p, i)
		if !plain {
			return nil, false
		}
		i = skipSpace(p, next)
		if i >= len(p) || p[i] != ':' {
			return nil, false
		}
		i = skipSpace(p, i+1)
		if !bytes.EqualFold(key, typeKey) {
			if i = skipValue(p, i); i < 0 {
				return nil, false
			}
			continue
		}
		if typ, i, plain = scanString(p, i); !plain {
			return nil, false
		}
	}
}

func skipSpace(p []byte, i int) int {
	for i < len(p) && (p[i] == ' ' || p[i] == '\t' || p[i] == '\n' || p[i] == '\r') {
		i++
	}
	return i
}

// scanString reads the string starting at p[i]. plain is false if there is
// none, or if its bytes may not be its value: it holds an escape, or
// non-ASCII that encoding/json might rewrite (invalid UTF-8 becomes U+FFFD).
func scanString(p []byte, i int) (s []byte, next int, plain bool) {
	if i >= len(p) || p[i] != '"' {
		return nil, i, false
	}
	plain = true
	for j := i + 1; j < len(p); j++ {
		switch p[j] {
		case '\\':
			plain = false
			j++
		case '"':
			return p[i+1 : j], j + 1, plain
		default:
			if p[j] >= 0x80 {
				plain = false
			}
		}
	}
	return nil, len(p), false
}

// skipValue returns the index just after the value starting at p[i], or -1
// if p ends inside it.
func skipValue(p []byte, i int) int {
	depth := 0
	for ; i < len(p); i++ {
		switch p[i] {
		case '"':
			_, next, _ := scanString(p, i)
			if depth == 0 {
				return next
			}
			i = next - 1
		case '{', '[':
			depth++
		case '}', ']':
			if depth == 0 {
				return i // a literal ended by its enclosing object
			}
			if depth--; depth == 0 {
				return i + 1
			}
		case ',', ' ', '\t', '\n', '\r':
			if depth == 0 {
				return i // a literal ended
			}
		}
	}
	if depth == 0 {
		return i
	}
	return -1
}
