package bindindex

import (
	"bytes"
	"container/list"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
)

type rec struct {
	K string `json:"k"`
}

func testSpec(path string, logs *bytes.Buffer) (Spec[rec], *slog.Logger) {
	return Spec[rec]{
		Path:    path,
		Key:     func(r rec) (string, bool) { return r.K, r.K != "" },
		Durable: true,
		What:    "test file",
		Skip:    "skipping a torn line",
	}, slog.New(slog.NewTextHandler(logs, nil))
}

// TestAppendAfterATornTailStartsANewLine: when the rewrite at open fails, a
// durable file is appended to as it is, and the first append must not
// complete the torn line it ends with.
func TestAppendAfterATornTailStartsANewLine(t *testing.T) {
	path := filepath.Join(t.TempDir(), "f.jsonl")
	if err := os.WriteFile(path, []byte(`{"k":"tor`), 0o600); err != nil {
		t.Fatal(err)
	}
	var logs bytes.Buffer
	spec, log := testSpec(path, &logs)
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	x := &Index[rec]{spec: spec, log: log, f: f, torn: true, order: list.New(), byKey: map[string]*list.Element{}}
	x.Put(rec{"after"})
	x.Close()

	y, err := OpenRequired(spec, log)
	if err != nil {
		t.Fatal(err)
	}
	defer y.Close()
	if !bytes.Contains(logs.Bytes(), []byte("skipping a torn line")) {
		t.Errorf("the torn line was not skipped with a WARN; log:\n%s", logs.String())
	}
	if all := y.All(); len(all) != 1 || all[0].K != "after" {
		t.Errorf("replayed %+v, want the one record appended after the torn line", all)
	}
}

// TestOpenFailureIsTheSpecsWARN: a file that cannot be opened turns the
// index off with one WARN: Failed (upstream's words) with the state_dir and
// the error when the spec has one, else the generic line naming What.
func TestOpenFailureIsTheSpecsWARN(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "state")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "f.jsonl")
	if err := os.Mkdir(path, 0o700); err != nil { // a directory: unreadable as a file
		t.Fatal(err)
	}
	for failed, want := range map[string]string{
		"":                             `level=WARN msg="the test file cannot be used, so it is off" path=` + path + ` error=`,
		"failed to open the test file": `level=WARN msg="failed to open the test file" state_dir=` + dir + ` error=`,
	} {
		var logs bytes.Buffer
		spec, log := testSpec(path, &logs)
		spec.Durable, spec.Off, spec.Failed = false, "it is off", failed
		if x := Open(spec, log); x != nil {
			t.Fatalf("Open of a directory returned an index")
		}
		if !bytes.Contains(logs.Bytes(), []byte(want)) || bytes.Count(logs.Bytes(), []byte("\n")) != 1 {
			t.Errorf("Failed %q: logged\n%s\nwant one line with %s", failed, logs.String(), want)
		}
	}
}
