// Package atomicfile replaces files so that a reader, or the next boot after
// a crash or power loss, sees the old contents or the new, never a torn or
// empty file.
//
// Both nexus-broker and nexus-spawnd link it, so it may import none of
// the gateway's layers nor anything else gateway-side
// (internal/gateway/layers_test.go and cmd/nexus-spawnd's deps test check
// it).
package atomicfile

import (
	"fmt"
	"os"
	"path/filepath"
)

// Replace renames a temp file holding data over path and returns it open at
// its end, for appending. With durable, the file is fsynced before the
// rename and the directory after. The temp file is 0600; prepare, when set,
// runs on it first (another mode, a group).
func Replace(path string, data []byte, durable bool, prepare func(*os.File) error) (*os.File, error) {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, tempPrefix(path)+"*")
	if err != nil {
		return nil, fmt.Errorf("writing %s: %w", path, err)
	}
	if prepare != nil {
		err = prepare(f)
	}
	if err == nil {
		_, err = f.Write(data)
	}
	if err == nil && durable {
		err = f.Sync()
	}
	if err == nil {
		err = os.Rename(f.Name(), path)
	}
	if err != nil {
		_ = f.Close()
		_ = os.Remove(f.Name())
		return nil, fmt.Errorf("writing %s: %w", path, err)
	}
	if durable {
		if err := SyncDir(dir); err != nil {
			_ = f.Close()
			return nil, fmt.Errorf("writing %s: the rename may not survive a power loss: %w", path, err)
		}
	}
	return f, nil
}

// Write is Replace, durable, for a file nobody appends to.
func Write(path string, data []byte, prepare func(*os.File) error) error {
	f, err := Replace(path, data, true, prepare)
	if err != nil {
		return err
	}
	return f.Close()
}

// RemoveTemps removes the temp files that replacements of path interrupted
// by a crash left behind. Call it only while nothing is replacing path.
func RemoveTemps(path string) {
	names, _ := filepath.Glob(filepath.Join(filepath.Dir(path), tempPrefix(path)+"*"))
	for _, name := range names {
		_ = os.Remove(name)
	}
}

func tempPrefix(path string) string { return "." + filepath.Base(path) + "-" }

// SyncDir makes the creations, renames and removals in dir durable.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
