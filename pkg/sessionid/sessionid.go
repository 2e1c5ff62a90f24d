// Package sessionid is the one rule both halves apply to an engine session
// id, from a claim or an instance's report. It reaches an instance's argv
// (-recall <id>), the journal and the index, so it is held to a narrow
// alphabet and a length a stock nexus (32 hex characters) never nears.
//
// Both nexus-broker and nexus-spawnd link it, so it may import none of
// the gateway's layers nor anything else gateway-side
// (internal/gateway/layers_test.go and cmd/nexus-spawnd's deps test check
// it).
package sessionid

import "fmt"

// MaxLen is the longest session id either side accepts, in bytes.
const MaxLen = 128

// Rule is the rule in words, for errors a user reads.
var Rule = fmt.Sprintf("1 to %d bytes of letters, digits, '.', '_' or '-', not starting with '-' or '.'", MaxLen)

// Validate returns nil for an id that keeps the rule, else an error naming
// it, quoting the id only when short so it cannot flood a log line.
func Validate(id string) error {
	if valid(id) {
		return nil
	}
	if len(id) > MaxLen {
		return fmt.Errorf("session id of %d bytes is not %s", len(id), Rule)
	}
	return fmt.Errorf("session id %q is not %s", id, Rule)
}

func valid(id string) bool {
	if id == "" || len(id) > MaxLen || id[0] == '-' || id[0] == '.' {
		return false
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '.' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}
