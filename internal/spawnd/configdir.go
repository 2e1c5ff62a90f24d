package spawnd

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Each temp-config directory holds configLockFile, flocked by its spawnd
// for life, so that a starting spawnd can tell a directory a spawnd killed
// with -9 left (removed when nothing but its lock and empty logs remain)
// from a live spawnd's (never touched). The lock is created already held
// (O_TMPFILE, flock, then linked into place), so no successor can take it
// before its spawnd does; a directory without one is never removed.
const configLockFile = "spawnd.lock"

// lockConfigDir creates dir's lock file, held, and returns it open.
func lockConfigDir(dir string) (*os.File, error) {
	fd, err := unix.Open(dir, unix.O_TMPFILE|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("creating the lock of %s: %w", dir, err)
	}
	f := os.NewFile(uintptr(fd), filepath.Join(dir, configLockFile))
	if err := unix.Flock(fd, unix.LOCK_EX); err != nil {
		f.Close()
		return nil, fmt.Errorf("locking %s: %w", f.Name(), err)
	}
	if err := unix.Linkat(unix.AT_FDCWD, "/proc/self/fd/"+strconv.Itoa(fd), unix.AT_FDCWD, f.Name(), unix.AT_SYMLINK_FOLLOW); err != nil {
		f.Close()
		return nil, fmt.Errorf("creating the lock of %s: %w", dir, err)
	}
	return f, nil
}

// sweepConfigDirs removes the temp-config directories under root that
// predecessors killed with -9 left empty (removeStaleDir).
func sweepConfigDirs(root string) {
	names, err := os.ReadDir(root)
	if err != nil {
		return
	}
	for _, de := range names {
		if strings.HasPrefix(de.Name(), configDirPrefix) {
			removeStaleDir(filepath.Join(root, de.Name()))
		}
	}
}

// removeStaleDir removes dir if it is a directory (not a symlink) of this
// euid, holds nothing but its lock and an empty logs directory, and its
// lock can be taken: no live spawnd holds it. It reports whether it did.
func removeStaleDir(dir string) bool {
	var st unix.Stat_t
	if unix.Lstat(dir, &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFDIR || int(st.Uid) != os.Geteuid() {
		return false
	}
	dfd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer unix.Close(dfd)
	lock, err := unix.Openat(dfd, configLockFile, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return false // none: a spawnd between creating the directory and its lock, or not ours
	}
	defer unix.Close(lock)
	if unix.Flock(lock, unix.LOCK_EX|unix.LOCK_NB) != nil {
		return false // a live spawnd's
	}
	names, err := os.ReadDir(dir)
	if err != nil {
		return false
	}
	for _, de := range names {
		switch n := de.Name(); {
		case n == configLockFile:
		case n == "logs" && unix.Unlinkat(dfd, "logs", unix.AT_REMOVEDIR) == nil:
		default:
			return false // a config an adopted instance may still read
		}
	}
	if err := errors.Join(unix.Unlinkat(dfd, configLockFile, 0), unix.Rmdir(dir)); err != nil {
		return false
	}
	return true
}
