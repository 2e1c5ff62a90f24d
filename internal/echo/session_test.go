package echo

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

var discard = slog.New(slog.NewTextHandler(io.Discard, nil))

func TestValidSessionID(t *testing.T) {
	for id, ok := range map[string]bool{
		"0123456789abcdef": true, "uuid-like-1234": true, "..a": true,
		"": false, ".": false, "..": false, "a/b": false, `a\b`: false, "/abs": false, "nul\x00": false,
	} {
		if err := validSessionID(id); (err == nil) != ok {
			t.Errorf("validSessionID(%q) = %v, want ok=%t", id, err, ok)
		}
	}
}

func TestRecallTruncatesATornLine(t *testing.T) {
	home := t.TempDir()
	s, err := newSession(home)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.record("one", "echo #1: one"); err != nil {
		t.Fatal(err)
	}
	s.file.WriteString(`{"turn":2,"input":"tw`) // a crash mid-append
	s.close()

	r, err := recallSession(home, s.id, discard)
	if err != nil {
		t.Fatal(err)
	}
	if r.turns != 1 || r.lastInput != "one" {
		t.Fatalf("recalled %d turns, last input %q", r.turns, r.lastInput)
	}
	if err := r.record("two", "echo #2: two (earlier: one)"); err != nil {
		t.Fatal(err)
	}
	r.close()
	data, err := os.ReadFile(filepath.Join(sessionsRoot(home), s.id, transcriptName))
	if err != nil {
		t.Fatal(err)
	}
	turns, valid, err := parseTranscript(data)
	if err != nil || valid != len(data) || len(turns) != 2 {
		t.Fatalf("transcript after recall %q: %d turns, %v", data, len(turns), err)
	}
}

func TestRecallErrors(t *testing.T) {
	home := t.TempDir()
	if _, err := recallSession(home, "nosuch", discard); !errors.Is(err, errUnknownSession) || !strings.Contains(err.Error(), `"nosuch"`) {
		t.Errorf("unknown session: %v", err)
	}
	s, err := newSession(home)
	if err != nil {
		t.Fatal(err)
	}
	s.file.WriteString("{\"turn\":5,\"input\":\"x\",\"answer\":\"y\"}\n")
	s.close()
	if _, err := recallSession(home, s.id, discard); err == nil || !strings.Contains(err.Error(), "turn 5, want 1") {
		t.Errorf("misnumbered transcript: %v", err)
	}
}

func TestWords(t *testing.T) {
	for text, want := range map[string][]string{
		"echo #1: hello world": {"echo ", "#1: ", "hello ", "world"},
		"a  b ":                {"a  ", "b "},
		" lead":                {" ", "lead"},
		"":                     nil,
	} {
		if got := words(text); !reflect.DeepEqual(got.chunks, want) || got.text != text {
			t.Errorf("words(%q) = %q, want %q", text, got.chunks, want)
		}
	}
}

func FuzzParseTranscript(f *testing.F) {
	f.Add([]byte("{\"turn\":1,\"input\":\"a\",\"answer\":\"echo #1: a\"}\n"))
	f.Add([]byte("{\"turn\":1,\"input\":\"a\",\"answer\":\"b\"}\n{\"turn\":2,\"in"))
	f.Add([]byte("\n"))
	f.Add([]byte("{\"turn\":2}\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		turns, valid, err := parseTranscript(data)
		if err != nil {
			return
		}
		if valid < 0 || valid > len(data) || (valid > 0 && data[valid-1] != '\n') || bytes.IndexByte(data[valid:], '\n') >= 0 {
			t.Fatalf("valid prefix %d of %q is not the whole lines", valid, data)
		}
		// What parsed must survive being written back.
		var again []byte
		for _, tr := range turns {
			line, err := json.Marshal(tr)
			if err != nil {
				t.Fatal(err)
			}
			again = append(append(again, line...), '\n')
		}
		turns2, valid2, err := parseTranscript(again)
		if err != nil || valid2 != len(again) || !reflect.DeepEqual(turns, turns2) {
			t.Fatalf("round trip of %q: %v", data, err)
		}
	})
}
