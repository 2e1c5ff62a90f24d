package spawnd

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nexus-broker/nexus-broker/internal/bindindex"
	"github.com/nexus-broker/nexus-broker/internal/bootlog"
	"github.com/nexus-broker/nexus-broker/internal/config/core"
	"github.com/nexus-broker/nexus-broker/internal/safedir"
)

// tenancy: (core.Tenancy) runs every instance of a principal under a uid of
// its own, allocated on its first claim from tenancy.uid_range and recorded
// for ever in <state_dir>/principal-uids.jsonl, with the gid of the same
// number, no supplementary group and HOME=<homes_dir>/<uid>. The principal
// is the gateway's word, so it is only ever a key: the uid, never the
// principal, names the home. With sandbox: strict the instance runs in
// bubblewrap (sandbox.go).

const (
	uidsFile = "principal-uids.jsonl"
	// rangeLockName, in /run, is host-wide: each spawnd holds a write lock
	// on the bytes of this file numbered by its uids, so two spawnds of one
	// host can never share a uid, whatever their state_dirs.
	rangeLockName = "nexus-spawnd.uid-ranges.lock"
	// LockDirEnv names another directory than /run for that file, so that
	// tests leave nothing in the host's /run; the spawnds of one host must
	// all see the same directory, or their ranges are not checked against
	// each other.
	LockDirEnv = "NEXUS_SPAWND_LOCK_DIR"
	// systemd's dynamic users (DynamicUser=) take uids from this range.
	systemdDynamicLo, systemdDynamicHi = 61184, 65519
)

// errNoUID refuses a new principal once the range is spent.
var errNoUID = errors.New("no uid left in tenancy.uid_range")

// uidRecord is one line of the uid file.
type uidRecord struct {
	Principal string `json:"principal"`
	UID       uint32 `json:"uid"`
}

type tenancy struct {
	lo, hi uint32
	homes  string
	// homesFD is homes_dir, opened once at boot without following a
	// symlink; every home is made relative to it.
	homesFD int
	// bwrap is bubblewrap's path with sandbox: strict, "" with none.
	bwrap string
	lock  *os.File
	uids  *bindindex.Index[uidRecord]

	mu   sync.Mutex // one allocation at a time
	next uint64     // the next uid to give; past hi, none is left
}

// openTenancy checks tenancy: against this machine and opens what it
// holds. Every failure is a boot error naming its key.
func openTenancy(cfg *core.Config, stateDir string, log *slog.Logger) (_ *tenancy, err error) {
	t := cfg.Tenancy
	lo, hi := t.Range()
	tn := &tenancy{lo: lo, hi: hi, homes: t.HomesDir, homesFD: -1}
	defer func() {
		if err != nil {
			tn.close()
		}
	}()
	if err := checkRangeIsFree(lo, hi, cfg.Spawnd); err != nil {
		return nil, fmt.Errorf("broker config: tenancy.uid_range: %d-%d %w; choose a range no account, group, subordinate id range or service of this host uses", lo, hi, err)
	}
	if tn.lock, err = lockRange(lo, hi); err != nil {
		return nil, fmt.Errorf("broker config: tenancy.uid_range: %w", err)
	}
	if tn.homesFD, err = openHomes(t.HomesDir); err != nil {
		return nil, fmt.Errorf("broker config: tenancy.homes_dir: %w", err)
	}
	path := filepath.Join(stateDir, uidsFile)
	tn.uids, err = openUIDs(path, log)
	if err != nil {
		return nil, bootlog.Wrap(bootlog.OpenState, err, "state_dir", stateDir)
	}
	tn.next = uint64(lo)
	for _, r := range tn.uids.All() {
		if r.UID < lo || r.UID > hi {
			return nil, fmt.Errorf("broker config: tenancy.uid_range: %s gives principals uid %d, outside %d-%d; a uid is never reassigned, so restore the range that holds it", path, r.UID, lo, hi)
		}
		tn.next = max(tn.next, uint64(r.UID)+1)
	}
	n, _ := tn.uids.Opened()
	log.Info("tenancy: one uid per principal", "uid_range", t.UIDRange, "homes_dir", t.HomesDir, "sandbox", t.Sandbox,
		"principals", n, "uids_left", uint64(hi)+1-tn.next)
	if t.Sandbox == core.SandboxStrict {
		if tn.bwrap, err = probeSandbox(lo); err != nil {
			return nil, fmt.Errorf("broker config: tenancy.sandbox: strict: %w", err)
		}
	}
	return tn, nil
}

// openUIDs opens the principal → uid file. A uid is in memory only once
// its record is fsynced (WrittenFirst): a uid served before it is durable
// could, after a restart, be given to another principal, or the principal
// another uid.
func openUIDs(path string, log *slog.Logger) (*bindindex.Index[uidRecord], error) {
	return bindindex.OpenRequired(bindindex.Spec[uidRecord]{
		Path:         path,
		Durable:      true,
		WrittenFirst: true,
		Key:          func(r uidRecord) (string, bool) { return r.Principal, r.UID != 0 },
		// A principal's uid is never replaced, nor given to another.
		Accept: func(_ uidRecord, had bool, _ uidRecord) bool { return !had },
		What:   "principal → uid file",
		Skip:   "skipping a principal → uid line that is not a whole record (torn by a crash mid-write, or edited)",
		Lost:   "the claim that allocated this uid is refused and the uid not given",
		Read:   safedir.ReadOwned,
	}, log)
}

// checkTenancyRoot refuses tenancy: to a non-root spawnd, before anything
// of state_dir is touched.
func checkTenancyRoot(cfg *core.Config) error {
	if euid := os.Geteuid(); cfg.Tenancy != nil && euid != 0 {
		return fmt.Errorf("broker config: tenancy: nexus-spawnd runs as uid %d, and tenancy needs root to start instances under the uids of tenancy.uid_range; run nexus-spawnd as root or remove tenancy", euid)
	}
	return nil
}

func (tn *tenancy) close() {
	if tn == nil {
		return
	}
	tn.uids.Close()
	if tn.homesFD >= 0 {
		_ = unix.Close(tn.homesFD)
	}
	if tn.lock != nil {
		_ = tn.lock.Close()
	}
}

// uidFor is principal's uid, allocated and durably recorded on its first
// claim; errNoUID once the range is spent.
func (tn *tenancy) uidFor(principal string) (uint32, error) {
	tn.mu.Lock()
	defer tn.mu.Unlock()
	if r, ok := tn.uids.Get(principal); ok {
		return r.UID, nil
	}
	if tn.next > uint64(tn.hi) {
		return 0, errNoUID
	}
	uid := uint32(tn.next)
	// A failed write allocates nothing: the uid stays the next to give, and
	// the file is rewritten whole from memory (without this record) before
	// it is appended to again, so a record the failed write may have left
	// is gone before the uid is given.
	if err := tn.uids.Put(uidRecord{Principal: principal, UID: uid}); err != nil {
		return 0, fmt.Errorf("recording uid %d for a new principal in %s failed, so the claim is refused and the uid not given: %w", uid, uidsFile, err)
	}
	tn.next++
	return uid, nil
}

// home makes sure <homes_dir>/<uid> is uid's: created 0700 and chowned to
// it if missing, else a real directory it owns. Nothing inside a home is
// ever read, chowned or walked.
func (tn *tenancy) home(uid uint32) (string, error) {
	name := strconv.FormatUint(uint64(uid), 10)
	path := filepath.Join(tn.homes, name)
	made := true
	if err := unix.Mkdirat(tn.homesFD, name, 0o700); errors.Is(err, unix.EEXIST) {
		made = false
	} else if err != nil {
		return "", fmt.Errorf("creating home %s: %w", path, err)
	}
	fd, err := unix.Openat(tn.homesFD, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", fmt.Errorf("home %s is not a directory (a symlink or a file?): %w", path, err)
	}
	defer unix.Close(fd)
	if made {
		if err := unix.Fchown(fd, int(uid), int(uid)); err != nil {
			return "", fmt.Errorf("giving home %s to uid %d: %w", path, uid, err)
		}
		return path, nil
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return "", fmt.Errorf("checking home %s: %w", path, err)
	}
	if st.Uid != uid {
		return "", fmt.Errorf("home %s is owned by uid %d, not its principal's uid %d: refusing to run an instance in it; remove it", path, st.Uid, uid)
	}
	return path, nil
}

// openHomes creates homes_dir (root, 0711: each home is found by name,
// and none listed) if missing, refuses one with another owner or mode, and
// opens it.
func openHomes(dir string) (int, error) {
	if err := unix.Mkdir(dir, 0o711); err != nil && !errors.Is(err, unix.EEXIST) {
		return -1, fmt.Errorf("creating %s: %w; create its parent directory", dir, err)
	}
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("%s is not a directory (a symlink or a file?): %w", dir, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Uid != 0 || st.Mode&0o7777 != 0o711 {
		_ = unix.Close(fd)
		return -1, fmt.Errorf("%s is owned by uid %d with mode %04o; want root and 0711, so no principal can list the homes or replace one: refusing to boot; chown root and chmod 711 it", dir, st.Uid, st.Mode&0o7777)
	}
	return fd, nil
}

// lockRange takes the host-wide lock on the bytes lo..hi of the range lock
// file (an open file description lock: held until spawnd exits). The file
// is never removed: another spawnd may hold a lock in it.
func lockRange(lo, hi uint32) (*os.File, error) {
	dir := cmp.Or(os.Getenv(LockDirEnv), "/run")
	if !filepath.IsAbs(dir) {
		return nil, fmt.Errorf("%s=%q is not an absolute directory; unset it for /run", LockDirEnv, dir)
	}
	rangeLockPath := filepath.Join(dir, rangeLockName)
	f, err := os.OpenFile(rangeLockPath, os.O_RDWR|os.O_CREATE|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, fmt.Errorf("opening the host-wide uid range lock %s: %w", rangeLockPath, err)
	}
	lk := unix.Flock_t{Type: unix.F_WRLCK, Whence: 0, Start: int64(lo), Len: int64(hi) - int64(lo) + 1}
	if err := unix.FcntlFlock(f.Fd(), unix.F_OFD_SETLK, &lk); err != nil {
		f.Close()
		if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EACCES) {
			return nil, fmt.Errorf("%d-%d overlaps the range another nexus-spawnd of this host holds (%s); give each spawnd a range of its own", lo, hi, rangeLockPath)
		}
		return nil, fmt.Errorf("locking %d-%d in %s: %w", lo, hi, rangeLockPath, err)
	}
	return f, nil
}

// idFiles are the host's id databases a range must stay clear of, and the
// fields of each line holding ids: a single id (uid, gid) or, for the
// subordinate ranges, a start and a count.
var idFiles = []struct {
	path   string
	fields []int
	span   bool
}{
	{"/etc/passwd", []int{2, 3}, false},
	{"/etc/group", []int{2}, false},
	{"/etc/subuid", []int{1, 2}, true},
	{"/etc/subgid", []int{1, 2}, true},
}

// checkRangeIsFree refuses a range that holds an id of the host's
// accounts, groups, subordinate ranges, systemd's dynamic users, the
// gateway's uid or the socket group.
func checkRangeIsFree(lo, hi uint32, sp core.Spawnd) error {
	in := func(a, b uint64) bool { return a <= uint64(hi) && b >= uint64(lo) }
	if in(systemdDynamicLo, systemdDynamicHi) {
		return fmt.Errorf("overlaps systemd's dynamic users (%d-%d)", systemdDynamicLo, systemdDynamicHi)
	}
	if gw := sp.Gateway(os.Getuid()); in(uint64(gw), uint64(gw)) {
		return fmt.Errorf("holds uid %d, the gateway's (spawnd.gateway_uid)", gw)
	}
	if g := sp.SocketGID; g != nil && in(uint64(*g), uint64(*g)) {
		return fmt.Errorf("holds gid %d, spawnd.socket_gid", *g)
	}
	for _, f := range idFiles {
		data, err := os.ReadFile(f.path)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return fmt.Errorf("cannot be checked against %s: %w", f.path, err)
		}
		sc := bufio.NewScanner(bytes.NewReader(data))
		for n := 1; sc.Scan(); n++ {
			cols := strings.Split(sc.Text(), ":")
			ids := make([]uint64, 0, 2)
			for _, i := range f.fields {
				if i < len(cols) {
					if v, err := strconv.ParseUint(cols[i], 10, 32); err == nil {
						ids = append(ids, v)
					}
				}
			}
			switch {
			case f.span && len(ids) == 2 && ids[1] > 0 && in(ids[0], ids[0]+ids[1]-1):
				return fmt.Errorf("overlaps %s's subordinate ids %d-%d in %s (line %d)", cols[0], ids[0], ids[0]+ids[1]-1, f.path, n)
			case !f.span:
				for _, id := range ids {
					if in(id, id) {
						return fmt.Errorf("holds id %d of %s in %s (line %d)", id, cols[0], f.path, n)
					}
				}
			}
		}
	}
	return nil
}

// credential is the principal's: its uid, the gid of the same number, and
// no supplementary group (an empty, non-nil Groups).
func tenantCredential(uid uint32) *syscall.Credential {
	return &syscall.Credential{Uid: uid, Gid: uid, Groups: []uint32{}}
}

// probeSandbox runs one sandbox as uid, as a spawn would, and returns
// bubblewrap's path; what this machine lacks fails it, named.
func probeSandbox(uid uint32) (string, error) {
	bwrap, err := exec.LookPath("bwrap")
	if err != nil {
		return "", fmt.Errorf("bubblewrap (bwrap) is not on nexus-spawnd's PATH (%s); install it (Debian: apt-get install bubblewrap)", os.Getenv("PATH"))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	argv := sandboxArgv(bwrap, "", "", []string{bwrap, "--version"})
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Dir = "/"
	cmd.Env = []string{}
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: tenantCredential(uid), Setsid: true}
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("a probe sandbox run as uid %d failed (%v): %s; this machine must allow unprivileged user namespaces (user.max_user_namespaces above 0, and no AppArmor or sysctl restriction of them) for bubblewrap to work unprivileged",
			uid, err, strings.TrimSpace(string(out)))
	}
	return bwrap, nil
}
