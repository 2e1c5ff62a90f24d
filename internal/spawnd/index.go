package spawnd

import (
	"log/slog"
	"path/filepath"

	"github.com/nexus-broker/nexus-broker/internal/bindindex"
	"github.com/nexus-broker/nexus-broker/internal/safedir"
	"github.com/nexus-broker/nexus-broker/pkg/sessionid"
)

// The session → binary index, <state_dir>/session-binaries.jsonl, remembers
// which entry ran a session after its lease is gone, so the gateway can hold
// a resume to the binary that created the session (Binding). The lease
// journal cannot: it is compacted down to live leases, and a resume always
// follows a release.
//
// It is best-effort by design, unlike the journal: an unknown session means
// "no opinion, proceed", so losing the tail to a crash only degrades to how
// resumes behaved before the index existed. That is why it is never fsynced,
// why a bad line is skipped, and why an index that cannot be opened turns
// the feature off instead of failing the boot.

const (
	indexFile = "session-binaries.jsonl"
	// maxBindings caps the index; the binding written longest ago goes first.
	maxBindings = 4096
)

// binding is one line of the index.
type binding struct {
	SessionID string `json:"session_id"`
	Entry     string `json:"entry"`
}

// sessionIndex is the session → binary index on the shared capped index.
// A nil *sessionIndex is an index that is off.
type sessionIndex struct{ idx *bindindex.Index[binding] }

// openSessionIndex replays and compacts <stateDir>/session-binaries.jsonl,
// holding at most limit bindings. The index never prevents a boot: a file
// nexus-spawnd did not write alone (or cannot read) is set aside, kept for
// the operator, and a fresh one started; one that cannot be rewritten turns
// the index off with one WARN, and openSessionIndex returns nil.
func openSessionIndex(stateDir string, limit int, log *slog.Logger) *sessionIndex {
	idx := bindindex.Open(bindindex.Spec[binding]{
		Path:  filepath.Join(stateDir, indexFile),
		Limit: limit,
		Key: func(b binding) (string, bool) {
			return b.SessionID, sessionid.Validate(b.SessionID) == nil && b.Entry != ""
		},
		What: "session → binary index",
		Off: "resumes are not checked against the binary that created their session; " +
			"fix or remove the file and restart nexus-spawnd to turn the check back on",
		Skip: "skipping a session → binary index line that is not a whole binding (torn by a crash mid-write, edited, or written before session ids were checked)",
		Lost: "this binding is kept in memory only",
		Read: safedir.ReadOwned,
		SetAside: "the session → binary index is not nexus-spawnd's own, so it was set aside and a fresh one started; " +
			"resumes of sessions it recorded are not checked against their binary",
	}, log)
	if idx == nil {
		return nil
	}
	return &sessionIndex{idx}
}

// bind records that entry ran session.
func (x *sessionIndex) bind(session, entry string) {
	if x == nil || session == "" {
		return
	}
	x.idx.Put(binding{SessionID: session, Entry: entry})
}

// lookup is the entry bound to session, or "" for no opinion.
func (x *sessionIndex) lookup(session string) string {
	if x == nil {
		return ""
	}
	b, _ := x.idx.Get(session)
	return b.Entry
}

func (x *sessionIndex) close() {
	if x != nil {
		x.idx.Close()
	}
}
