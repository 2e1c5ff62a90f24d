package echo

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
)

// transcriptName is the file, inside a session's directory, that holds one
// JSON line per completed turn.
const transcriptName = "transcript.jsonl"

// errUnknownSession is wrapped when -recall names a session that has no
// directory under $HOME/.nexus/sessions.
var errUnknownSession = errors.New("unknown session")

// turnRecord is one transcript line.
type turnRecord struct {
	Turn   int    `json:"turn"`
	Input  string `json:"input"`
	Answer string `json:"answer"`
}

// session is one conversation's durable state. Only the agent goroutine uses
// it once the instance is running.
type session struct {
	id        string
	file      *os.File // the transcript, opened for append
	turns     int      // completed turns so far
	lastInput string   // input of the latest completed turn, for "(earlier: …)"
}

// sessionsRoot is where stock nexus keeps sessions too, so an operator finds
// an echo session where they would look for any other.
func sessionsRoot(home string) string {
	return filepath.Join(home, ".nexus", "sessions")
}

// newID returns n random bytes as hex: session ids and hitl request ids.
func newID(n int) string {
	b := make([]byte, n)
	rand.Read(b) // never fails: crypto/rand panics rather than return short
	return hex.EncodeToString(b)
}

// validSessionID refuses ids that would resolve outside the sessions root: the
// id arrives in argv from the broker, which got it from a client.
func validSessionID(id string) error {
	switch {
	case id == "":
		return errors.New("session id is empty")
	case id == "." || id == "..", strings.ContainsAny(id, "/\\\x00"):
		return fmt.Errorf("session id %q is not a plain name: it must have no path separators and not be \".\" or \"..\"", id)
	}
	return nil
}

// newSession creates a fresh session directory and an empty transcript, and
// syncs the directories: once its id is reported to the broker, a session must
// stay recallable even if the machine crashes before its first turn.
func newSession(home string) (*session, error) {
	root := sessionsRoot(home)
	if err := os.MkdirAll(root, 0o700); err != nil {
		return nil, fmt.Errorf("creating the sessions directory: %w", err)
	}
	id := newID(8)
	dir := filepath.Join(root, id)
	if err := os.Mkdir(dir, 0o700); err != nil {
		return nil, fmt.Errorf("creating session %s: %w", id, err)
	}
	f, err := os.OpenFile(filepath.Join(dir, transcriptName), os.O_WRONLY|os.O_CREATE|os.O_EXCL|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("creating the transcript of session %s: %w", id, err)
	}
	for _, d := range []string{dir, root} {
		if err := syncDir(d); err != nil {
			f.Close()
			return nil, err
		}
	}
	return &session{id: id, file: f}, nil
}

// recallSession opens an existing session and loads its transcript. A torn
// last line (a crash in the middle of an append) is cut off so the next
// append starts on a line boundary; any other damage is an error.
func recallSession(home, id string, log *slog.Logger) (*session, error) {
	if err := validSessionID(id); err != nil {
		return nil, err
	}
	dir := filepath.Join(sessionsRoot(home), id)
	fi, err := os.Stat(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%w %q: %s does not exist; recall only sessions this user's nexus-echo created, or omit -recall to start a new one", errUnknownSession, id, dir)
	}
	if err != nil {
		return nil, fmt.Errorf("recalling session %q: %w", id, err)
	}
	if !fi.IsDir() {
		return nil, fmt.Errorf("%w %q: %s is not a directory", errUnknownSession, id, dir)
	}
	path := filepath.Join(dir, transcriptName)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("opening the transcript of session %q: %w", id, err)
	}
	s, err := loadTranscript(f, id, log)
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return s, nil
}

func loadTranscript(f *os.File, id string, log *slog.Logger) (*session, error) {
	data, err := io.ReadAll(f)
	if err != nil {
		return nil, err
	}
	turns, valid, err := parseTranscript(data)
	if err != nil {
		return nil, err
	}
	if valid < len(data) {
		log.Warn("discarding a torn last transcript line", "session_id", id, "bytes", len(data)-valid)
		if err := f.Truncate(int64(valid)); err != nil {
			return nil, err
		}
		if err := f.Sync(); err != nil {
			return nil, err
		}
	}
	s := &session{id: id, file: f, turns: len(turns)}
	if len(turns) > 0 {
		s.lastInput = turns[len(turns)-1].Input
	}
	return s, nil
}

// parseTranscript decodes newline-terminated turn records numbered 1, 2, ….
// valid is the length of the prefix made of whole lines; bytes after it are an
// unterminated line, which only an interrupted append leaves behind.
func parseTranscript(data []byte) (turns []turnRecord, valid int, err error) {
	for {
		i := bytes.IndexByte(data[valid:], '\n')
		if i < 0 {
			return turns, valid, nil
		}
		line := data[valid : valid+i]
		var r turnRecord
		if err := json.Unmarshal(line, &r); err != nil {
			return nil, 0, fmt.Errorf("line %d: %w", len(turns)+1, err)
		}
		if r.Turn != len(turns)+1 {
			return nil, 0, fmt.Errorf("line %d: turn %d, want %d", len(turns)+1, r.Turn, len(turns)+1)
		}
		turns = append(turns, r)
		valid += i + 1
	}
}

// record appends a completed turn and fsyncs it before the turn is reported
// idle, so an answer a client has seen is never missing from a recall.
func (s *session) record(input, answer string) error {
	line, err := json.Marshal(turnRecord{Turn: s.turns + 1, Input: input, Answer: answer})
	if err != nil {
		return err
	}
	if _, err := s.file.Write(append(line, '\n')); err != nil {
		return fmt.Errorf("appending turn %d to the transcript of session %s: %w", s.turns+1, s.id, err)
	}
	if err := s.file.Sync(); err != nil {
		return fmt.Errorf("syncing the transcript of session %s: %w", s.id, err)
	}
	s.turns++
	s.lastInput = input
	return nil
}

func (s *session) close() error {
	return s.file.Close()
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("syncing %s: %w", dir, err)
	}
	return nil
}
