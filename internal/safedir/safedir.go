// Package safedir is how nexus-broker trusts a directory before it creates
// or opens anything in it: the directory must be a real directory (not a
// symlink), owned by the expected uid, and writable by nobody else. In a
// world-writable parent such as /tmp anyone could have created it first,
// planting symlinks or files for a privileged process to follow, so a
// directory that fails the check is refused, never adopted or repaired.
// Files inside are opened relative to the verified directory's descriptor
// without following symlinks.
package safedir

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// Dir is a verified directory, held open so that files are opened inside
// the very directory that was checked, whatever happens to its path.
type Dir struct {
	path string
	fd   int
}

// Open opens path without following a symlink in its last component and
// verifies the directory it got: owned by uid, not writable by group or
// others.
func Open(path string, uid int) (*Dir, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		if errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR) {
			return nil, fmt.Errorf("%s is not a directory (a symlink or a file): refusing to use it; remove it", path)
		}
		return nil, &fs.PathError{Op: "open", Path: path, Err: err}
	}
	d := &Dir{path: path, fd: fd}
	if err := d.verify(uid); err != nil {
		d.Close()
		return nil, err
	}
	return d, nil
}

// Ensure creates path with mode perm when it is missing (its parent must
// exist), then opens and verifies it as owned by this process's euid. A
// directory that was there already must pass the same check: it is never
// reused on trust.
func Ensure(path string, perm os.FileMode) (*Dir, error) {
	if err := unix.Mkdir(path, uint32(perm.Perm())); err != nil && !errors.Is(err, unix.EEXIST) {
		return nil, &fs.PathError{Op: "mkdir", Path: path, Err: err}
	}
	return Open(path, os.Geteuid())
}

// Check verifies path as Open does and closes it again.
func Check(path string, uid int) error {
	d, err := Open(path, uid)
	if err != nil {
		return err
	}
	return d.Close()
}

func (d *Dir) verify(uid int) error {
	var st unix.Stat_t
	if err := unix.Fstat(d.fd, &st); err != nil {
		return &fs.PathError{Op: "stat", Path: d.path, Err: err}
	}
	mode := st.Mode & 0o7777
	if int(st.Uid) != uid || mode&0o022 != 0 {
		return fmt.Errorf("%s is owned by uid %d with mode %04o; want owner uid %d and no write access for group or others: "+
			"refusing to use it (someone else may have created it first); remove it, or fix its owner and mode", d.path, st.Uid, mode, uid)
	}
	return nil
}

// Path is the directory's path as given to Open.
func (d *Dir) Path() string { return d.path }

// Close releases the directory's descriptor.
func (d *Dir) Close() error { return unix.Close(d.fd) }

// OpenFile opens name, a plain file name, inside d without following a
// symlink: a planted symlink fails with an error naming it rather than
// being followed to its target. The file is close-on-exec.
func (d *Dir) OpenFile(name string, flag int, perm os.FileMode) (*os.File, error) {
	path := filepath.Join(d.path, name)
	if name != filepath.Base(name) || name == "." || name == ".." {
		return nil, fmt.Errorf("safedir: %q is not a plain file name", name)
	}
	fd, err := unix.Openat(d.fd, name, flag|unix.O_NOFOLLOW|unix.O_CLOEXEC, uint32(perm.Perm()))
	if err != nil {
		if errors.Is(err, unix.ELOOP) {
			return nil, fmt.Errorf("%s is a symlink: refusing to follow it; remove it", path)
		}
		return nil, &fs.PathError{Op: "open", Path: path, Err: err}
	}
	f := os.NewFile(uintptr(fd), path)
	// A FIFO or device planted under the name is no file of ours either.
	if st, err := f.Stat(); err != nil || !st.Mode().IsRegular() {
		f.Close()
		return nil, fmt.Errorf("%s is not a regular file: refusing to use it; remove it", path)
	}
	return f, nil
}

// Owned checks that f is owned by uid and readable or writable by nobody
// else (mode 0600 or tighter), for files that hold secrets or that a
// privileged process acts on. The error names the path, owner and mode.
func Owned(f *os.File, uid int) error {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return &fs.PathError{Op: "stat", Path: f.Name(), Err: err}
	}
	mode := st.Mode & 0o7777
	if int(st.Uid) != uid || mode&0o077 != 0 {
		return fmt.Errorf("%s is owned by uid %d with mode %04o; want owner uid %d and mode 0600: refusing to use it "+
			"(someone else may have written it); remove it if you did not create it, or chown and chmod 600 it", f.Name(), st.Uid, mode, uid)
	}
	return nil
}
