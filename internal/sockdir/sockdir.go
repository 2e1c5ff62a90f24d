// Package sockdir gives tests a directory short enough for unix sockets.
// A socket path must fit sun_path (108 bytes), which t.TempDir's test-named
// paths under a long $TMPDIR do not; these tests keep their sockets in a
// short directory of their own under /tmp instead, and remove it.
//
// Only tests import it; it imports nothing of the project.
package sockdir

import (
	"os"
	"testing"
)

// maxBase is the longest temp root still used as is; beyond it the
// directory goes under /tmp.
const maxBase = 32

// New creates a fresh directory named prefix… with a path of at most about
// maxBase+20 bytes, removed when the test ends.
func New(t testing.TB, prefix string) string {
	t.Helper()
	base := os.TempDir()
	if len(base) > maxBase {
		base = "/tmp"
	}
	dir, err := os.MkdirTemp(base, prefix)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	return dir
}
