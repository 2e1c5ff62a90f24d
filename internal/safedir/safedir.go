// Package safedir is how nexus-broker trusts a directory before using it: a
// real directory (not a symlink), owned by the expected uid, writable by
// nobody else. In /tmp anyone could have created it first, planting
// symlinks or files for a privileged process to follow, so one that fails
// is refused, never adopted. Files inside are opened without following a
// symlink; files holding secrets or that spawnd acts on must be its own,
// mode 0600.
//
// Both nexus-broker and nexus-spawnd link it, so it may import none of
// the gateway's layers nor anything else gateway-side
// (internal/gateway/layers_test.go and cmd/nexus-spawnd's deps test check
// it).
package safedir

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// ErrNotOwned is wrapped by the error of a file or directory owned by
// another uid, or open to others.
var ErrNotOwned = errors.New("not owned by this user alone")

// Ensure creates path with mode perm when missing (its parent must exist),
// then checks that it is a directory, not a symlink, owned by this euid and
// not writable by group or others: one already there is never trusted.
func Ensure(path string, perm os.FileMode) error {
	if err := unix.Mkdir(path, uint32(perm.Perm())); err != nil && !errors.Is(err, unix.EEXIST) {
		return &fs.PathError{Op: "mkdir", Path: path, Err: err}
	}
	st, err := lstatDir(path)
	if err != nil {
		return err
	}
	uid := os.Geteuid()
	if mode := st.Mode & 0o7777; int(st.Uid) != uid || mode&0o022 != 0 {
		return fmt.Errorf("%s is owned by uid %d with mode %04o; want owner uid %d and no write access for group or others: "+
			"refusing to use it (%w: someone else may have created it first); remove it, or fix its owner and mode", path, st.Uid, mode, uid, ErrNotOwned)
	}
	return nil
}

// Private creates path (and parents) with mode perm, or takes the one there
// if it is this euid's and no symlink, setting its mode to perm. It returns
// the mode found when that let in more than perm, else 0.
// ParentOwned refuses a directory (symlinks followed) that another uid
// owns: its owner can rename what this process creates in it and put its
// own in its place, whatever the mode of what was created.
func ParentOwned(path string) error {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return &fs.PathError{Op: "stat", Path: path, Err: err}
	}
	if uid := os.Geteuid(); int(st.Uid) != uid {
		return fmt.Errorf("%s is owned by uid %d with mode %04o; want owner uid %d: refusing to use it (%w: its owner can replace what is created in it); "+
			"unset it, or use one this user owns", path, st.Uid, st.Mode&0o7777, uid, ErrNotOwned)
	}
	return nil
}

func Private(path string, perm os.FileMode) (loose os.FileMode, err error) {
	if err := os.MkdirAll(path, perm); err != nil {
		return 0, err
	}
	st, err := lstatDir(path)
	if err != nil {
		return 0, err
	}
	mode := os.FileMode(st.Mode & 0o7777)
	if int(st.Uid) != os.Geteuid() {
		return 0, fmt.Errorf("%s is owned by uid %d with mode %04o, not by this process's uid %d: refusing to use it (%w); "+
			"remove it if you did not create it, or chown it", path, st.Uid, uint32(mode), os.Geteuid(), ErrNotOwned)
	}
	// Set even when tighter: MkdirAll honours the umask, and a group's
	// grant is part of the access control.
	if mode != perm {
		if err := os.Chmod(path, perm); err != nil {
			return 0, err
		}
	}
	if mode&^perm != 0 {
		return mode, nil
	}
	return 0, nil
}

// PrivateKey is Private, 0700, for the directory a config key names; a
// refusal names the key and owner, a tightened mode is logged.
func PrivateKey(path, key, owner, holds string, log *slog.Logger) error {
	loose, err := Private(path, 0o700)
	if err != nil {
		return fmt.Errorf("broker config: %s: %w; create it (mode 0700, owned by %s) or point %s elsewhere", key, err, owner, key)
	}
	if loose != 0 {
		log.Warn(key+" was open to other users; tightened to 0700 (it holds "+holds+")",
			key, path, "was", fmt.Sprintf("%04o", uint32(loose)))
	}
	return nil
}

func lstatDir(path string) (*unix.Stat_t, error) {
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		return nil, &fs.PathError{Op: "lstat", Path: path, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return nil, fmt.Errorf("%s is not a directory (a symlink or a file): refusing to use it; remove it", path)
	}
	return &st, nil
}

// OpenFile opens path, close-on-exec, only if it is a regular file and not
// a symlink (which fails, naming itself). A missing file's error satisfies
// errors.Is(err, fs.ErrNotExist).
func OpenFile(path string, flag int, perm os.FileMode) (*os.File, error) {
	// O_NONBLOCK: opening a planted FIFO must not hang; it is refused below.
	f, err := os.OpenFile(path, flag|unix.O_NOFOLLOW|unix.O_NONBLOCK, perm)
	if errors.Is(err, unix.ELOOP) {
		return nil, fmt.Errorf("%s is a symlink: refusing to follow it; remove it", path)
	}
	if err != nil {
		return nil, err
	}
	if st, err := f.Stat(); err != nil || !st.Mode().IsRegular() {
		f.Close()
		return nil, fmt.Errorf("%s is not a regular file: refusing to use it; remove it", path)
	}
	return f, nil
}

// Owned checks that f is uid's and open to nobody else (0600 or tighter),
// naming path, owner and mode otherwise.
func Owned(f *os.File, uid int) error {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return &fs.PathError{Op: "stat", Path: f.Name(), Err: err}
	}
	if mode := st.Mode & 0o7777; int(st.Uid) != uid || mode&0o077 != 0 {
		return fmt.Errorf("%s is owned by uid %d with mode %04o; want owner uid %d and mode 0600: refusing to use it (%w: someone else may have written it); "+
			"remove it if you did not create it, or chown and chmod 600 it", f.Name(), st.Uid, mode, uid, ErrNotOwned)
	}
	return nil
}

// ReadOwned reads path, which must pass OpenFile and Owned by this euid.
func ReadOwned(path string) ([]byte, error) {
	f, err := OpenFile(path, os.O_RDONLY, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if err := Owned(f, os.Geteuid()); err != nil {
		return nil, err
	}
	return io.ReadAll(f)
}

// HeldError is LockPid's error for a lock another process holds. Holder is
// the pid it wrote there, "" before it wrote one.
type HeldError struct{ Path, Holder string }

func (e *HeldError) Error() string {
	if e.Holder == "" {
		return "a process that has not written its pid yet holds " + e.Path
	}
	return "pid " + e.Holder + " holds " + e.Path
}

// LockPid takes path's exclusive flock without waiting, while the returned
// file stays open, and writes our pid in it for the next one's *HeldError.
// check, when set, vets the file before it is locked.
func LockPid(path string, perm os.FileMode, check func(*os.File) error) (*os.File, error) {
	f, err := OpenFile(path, os.O_RDWR|os.O_CREATE, perm)
	if err != nil {
		return nil, err
	}
	if check != nil {
		err = check(f)
	}
	if err == nil {
		// Non-blocking, so it cannot be interrupted (EINTR).
		err = unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if errors.Is(err, unix.EWOULDBLOCK) {
			err = &HeldError{Path: path, Holder: ReadPid(f)}
		}
	}
	if err == nil {
		err = f.Truncate(0)
	}
	if err == nil {
		_, err = f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	if err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// ReadPid is the pid a LockPid holder wrote in f, "" if none.
func ReadPid(f *os.File) string {
	data, _ := io.ReadAll(io.NewSectionReader(f, 0, 32))
	return strings.TrimSpace(string(data))
}
