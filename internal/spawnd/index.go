package spawnd

import (
	"log/slog"
	"path/filepath"

	"github.com/nexus-broker/nexus-broker/internal/bindindex"
	"github.com/nexus-broker/nexus-broker/internal/safedir"
	"github.com/nexus-broker/nexus-broker/pkg/sessionid"
)

// The session → binary index, <state_dir>/session-binaries.jsonl, remembers
// which entry ran a session after its lease is gone (the journal keeps only
// live leases, and a resume follows a release), so the gateway can hold a
// resume to the binary that created the session (Binding), and which
// principal created it, so a gateway with auth: serves a resume only to
// that principal. Every append is fsynced before the verb answers (an
// owner must outlive a crash), and the file is best-effort otherwise, as
// bindindex describes: an unknown session is no opinion about its binary,
// and no owner (which that gateway refuses). Without a state_dir it lives
// in memory, for owners alone.

const (
	indexFile = "session-binaries.jsonl"
	// maxBindings caps the index; the binding written longest ago goes first.
	maxBindings = 1_000_000
	// indexCompactEvery spaces the rewrites of a file of up to a million
	// lines; a session's binding is rewritten only when it changes.
	indexCompactEvery = 1 << 16
)

// binding is one line of the index. Principal is "" in lines written
// before owners were recorded, and for sessions created without auth:.
type binding struct {
	SessionID string `json:"session_id"`
	Entry     string `json:"entry"`
	Principal string `json:"principal,omitempty"`
}

// openSessionIndex opens the index, holding at most limit bindings. It never
// prevents a boot: a file not nexus-spawnd's own is set aside and a fresh one
// started; one that cannot be rewritten turns the index off (nil). An empty
// session id is never bound (Key refuses it).
func openSessionIndex(stateDir string, limit int, log *slog.Logger) *bindindex.Index[binding] {
	path := ""
	if stateDir != "" {
		path = filepath.Join(stateDir, indexFile)
	}
	idx := bindindex.Open(bindindex.Spec[binding]{
		Path:         path,
		Limit:        limit,
		Durable:      true,
		CompactEvery: indexCompactEvery,
		Key: func(b binding) (string, bool) {
			return b.SessionID, sessionid.Validate(b.SessionID) == nil && b.Entry != ""
		},
		// A repeat (a resume) costs no write, nor an fsync.
		Accept: func(old binding, had bool, b binding) bool { return !had || old != b },
		What:   "session → binary index",
		Failed: "failed to open the session binary index; resume will not know which binary " +
			"served a session whose lease has already been released",
		Off:  "fix or remove the file and restart nexus-spawnd to turn the check back on",
		Skip: "skipping a session → binary index line that is not a whole binding (torn by a crash mid-write, edited, or written before session ids were checked)",
		Lost: "this binding is kept in memory only",
		Read: safedir.ReadOwned,
		SetAside: "the session → binary index is not nexus-spawnd's own, so it was set aside and a fresh one started; " +
			"resumes of sessions it recorded are not checked against their binary",
	}, log)
	if idx != nil && path != "" {
		n, skipped := idx.Opened()
		logOpened(log, path, "session binary index", n, skipped, "bindings", n)
	}
	return idx
}
