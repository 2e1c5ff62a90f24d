package atomicfile

import (
	"os"
	"path/filepath"
	"testing"
)

func TestWriteReplacesWholeAndLeavesNoTemp(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "key")
	for _, content := range []string{"first", "second, longer"} {
		if err := Write(path, []byte(content), nil); err != nil {
			t.Fatal(err)
		}
		if got, _ := os.ReadFile(path); string(got) != content {
			t.Fatalf("read %q, want %q", got, content)
		}
	}
	st, _ := os.Stat(path)
	if st.Mode().Perm() != 0o600 {
		t.Fatalf("mode %v, want 0600", st.Mode().Perm())
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 {
		t.Fatalf("directory holds %d entries, want only the file", len(ents))
	}
	if err := Write(path, []byte("x"), func(f *os.File) error { return f.Chmod(0o640) }); err != nil {
		t.Fatal(err)
	}
	if st, _ := os.Stat(path); st.Mode().Perm() != 0o640 {
		t.Fatalf("prepare's mode not applied: %v", st.Mode().Perm())
	}
}

func TestWriteFailureKeepsTheOldFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "key")
	if err := Write(path, []byte("old"), nil); err != nil {
		t.Fatal(err)
	}
	if err := Write(path, []byte("new"), func(*os.File) error { return os.ErrPermission }); err == nil {
		t.Fatal("a failing prepare did not fail the write")
	}
	if got, _ := os.ReadFile(path); string(got) != "old" {
		t.Fatalf("old contents lost: %q", got)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Fatalf("a temp file was left behind: %d entries", len(ents))
	}
}

func TestReplaceReturnsTheNewFileForAppendingAndRemoveTempsCleansUp(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "journal")
	f, err := Replace(path, []byte("a\n"), false, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write([]byte("b\n")); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if got, _ := os.ReadFile(path); string(got) != "a\nb\n" {
		t.Fatalf("appended after Replace: %q", got)
	}
	stale := filepath.Join(dir, ".journal-123")
	if err := os.WriteFile(stale, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	RemoveTemps(path)
	if _, err := os.Stat(stale); !os.IsNotExist(err) {
		t.Fatalf("a leftover temp file survived RemoveTemps: %v", err)
	}
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("RemoveTemps removed the file itself: %v", err)
	}
}
