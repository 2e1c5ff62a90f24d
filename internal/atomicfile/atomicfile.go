// Package atomicfile replaces files so that a reader, or the next boot after
// a crash or power loss, sees the old contents or the new ones, never a torn
// or empty file. spawnd's key and identity files, its journal compaction and
// the reattach file the gateway reads all depend on that.
package atomicfile

import (
	"fmt"
	"os"
	"path/filepath"
)

// Write replaces path with data through a temp file in the same directory:
// written, fsynced, renamed over path, and the directory fsynced so the
// rename itself is durable. The temp file is created 0600; prepare, when
// set, runs on it first (to set another mode or a group).
func Write(path string, data []byte, prepare func(*os.File) error) error {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+"-*")
	if err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	if prepare != nil {
		err = prepare(f)
	}
	if err == nil {
		_, err = f.Write(data)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), path)
	}
	if err != nil {
		_ = os.Remove(f.Name())
		return fmt.Errorf("writing %s: %w", path, err)
	}
	if err := SyncDir(dir); err != nil {
		return fmt.Errorf("writing %s: the rename may not survive a power loss: %w", path, err)
	}
	return nil
}

// SyncDir makes the creations, renames and removals in dir durable.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
