package e2e

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// FUSE opcodes and sizes (linux/fuse.h) the stalling server needs.
const (
	fuseInit         = 26
	fuseInterrupt    = 36
	fuseInHeaderLen  = 40
	fuseOutHeaderLen = 16
	fuseInitOutLen   = 64
)

// stallingFUSE is a FUSE file system that answers INIT and nothing else.
// A process whose request it has read is, once killed, in uninterruptible
// sleep (state D) until the request is answered: the kernel waits out a
// request the server already holds (fuse's request_wait_answer). That is a
// real D state, produced without a broken disk.
type stallingFUSE struct {
	dev  *os.File
	held chan fuseRequest // every request but INIT and INTERRUPT
}

type fuseRequest struct {
	unique uint64
	pid    int
}

// mountStallingFUSE mounts a stallingFUSE that any user may enter, and
// unmounts it at cleanup. It skips where FUSE cannot be mounted.
func mountStallingFUSE(t *testing.T) (dir string, fsys *stallingFUSE) {
	t.Helper()
	// Blocking, and so outside Go's poller: a read blocks its goroutine's
	// thread until a request comes, or the unmount aborts the connection.
	fd, err := unix.Open("/dev/fuse", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Skipf("no FUSE here (%v): a process in state D cannot be produced", err)
	}
	dev := os.NewFile(uintptr(fd), "/dev/fuse")
	// Outside the test's 0700 temp directory, so that nobody reaches it.
	dir, err = os.MkdirTemp("", "nexus-e2e-fuse-")
	if err != nil {
		t.Fatal(err)
	}
	opts := fmt.Sprintf("fd=%d,rootmode=40755,user_id=0,group_id=0,allow_other", fd)
	if err := unix.Mount("nexus-e2e", dir, "fuse", unix.MS_NOSUID|unix.MS_NODEV, opts); err != nil {
		dev.Close()
		os.Remove(dir)
		t.Skipf("mounting FUSE: %v: a process in state D cannot be produced", err)
	}
	fsys = &stallingFUSE{dev: dev, held: make(chan fuseRequest, 16)}
	go fsys.serve()
	t.Cleanup(func() {
		// Unmounting aborts the connection: whatever still waits on it
		// gets an error and can die.
		_ = unix.Unmount(dir, unix.MNT_DETACH)
		dev.Close()
		os.Remove(dir)
	})
	return dir, fsys
}

func (f *stallingFUSE) serve() {
	buf := make([]byte, 64<<10)
	for {
		n, err := f.dev.Read(buf)
		if err != nil {
			return
		}
		if n < fuseInHeaderLen {
			continue
		}
		le := binary.LittleEndian
		op, unique, pid := le.Uint32(buf[4:]), le.Uint64(buf[8:]), int(le.Uint32(buf[32:]))
		switch op {
		case fuseInit:
			in := buf[fuseInHeaderLen:n]
			out := make([]byte, fuseInitOutLen)
			le.PutUint32(out[0:], 7)                 // major
			le.PutUint32(out[4:], 31)                // minor
			le.PutUint32(out[8:], le.Uint32(in[8:])) // max_readahead
			le.PutUint32(out[20:], 4096)             // max_write
			le.PutUint32(out[24:], 1)                // time_gran
			_ = f.reply(unique, 0, out)
		case fuseInterrupt:
		default:
			select {
			case f.held <- fuseRequest{unique, pid}:
			default:
			}
		}
	}
}

// reply answers request unique with errno (0 for success) and body.
func (f *stallingFUSE) reply(unique uint64, errno syscall.Errno, body []byte) error {
	out := make([]byte, fuseOutHeaderLen+len(body))
	binary.LittleEndian.PutUint32(out[0:], uint32(len(out)))
	binary.LittleEndian.PutUint32(out[4:], uint32(-int32(errno)))
	binary.LittleEndian.PutUint64(out[8:], unique)
	copy(out[fuseOutHeaderLen:], body)
	_, err := f.dev.Write(out)
	return err
}

// TestCgroupStuckInDStateIsRecorded: an instance's child is killed while
// the kernel waits on a FUSE request its server holds, so it sleeps
// uninterruptibly (state D) and its lease cgroup cannot empty. The release
// still ends the lease, with an ERROR and the reason (the member and its
// state) in the lease's ended record; once the request is answered the
// child dies and the retried removal takes the cgroup away.
func TestCgroupStuckInDStateIsRecorded(t *testing.T) {
	b, root := cgroupBroker(t, Options{StateDir: true, YAML: "release_grace: 1s\n"})
	mnt, fsys := mountStallingFUSE(t)
	claim, conn, _ := instancePid(t, b, "nexus")
	lease := filepath.Join(root, cgroupBrokerID, claim.LeaseID)

	answer := say(t, conn, "/run cat "+mnt+"/x >/dev/null 2>&1 & echo $!")
	child, err := strconv.Atoi(answer)
	if err != nil {
		t.Fatalf("/run answered %q", answer)
	}
	var req fuseRequest
	for req.pid != child {
		select {
		case req = <-fsys.held:
		case <-time.After(15 * time.Second):
			t.Fatalf("pid %d never reached the FUSE server", child)
		}
	}

	if status, _ := b.do("POST", "/release/"+claim.LeaseID, ""); status != 200 {
		t.Fatalf("release = %d", status)
	}
	eventually(t, 10*time.Second, func() string { return fmt.Sprintf("pid %d in state D", child) }, func() bool {
		st, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", child))
		s := string(st)
		return strings.HasPrefix(s[strings.LastIndexByte(s, ')')+1:], " D ")
	})
	b.SpawndLog.wait(t, regexp.MustCompile(`level=ERROR msg="lease cgroup did not empty.*lease_id=`+claim.LeaseID), 30*time.Second)
	var rec map[string]any
	eventually(t, 5*time.Second, func() string { return "an ended record for " + claim.LeaseID }, func() bool {
		rec = b.endedRecords()[claim.LeaseID]
		return rec != nil
	})
	want := fmt.Sprintf("pid %d (state D)", child)
	if left, _ := rec["cgroup_left"].(string); !strings.Contains(left, want) || !strings.Contains(left, "uninterruptible sleep") {
		t.Errorf("the ended record's cgroup_left is %q; want it to name %q and uninterruptible sleep (record: %v)", left, want, rec)
	}
	if _, err := os.Stat(lease); err != nil {
		t.Fatalf("the lease cgroup is gone although pid %d was stuck in it: %v", child, err)
	}

	if err := fsys.reply(req.unique, unix.ENOENT, nil); err != nil {
		t.Fatalf("answering the held FUSE request: %v", err)
	}
	eventually(t, 10*time.Second, func() string { return fmt.Sprintf("pid %d gone once its request was answered", child) },
		func() bool { return !alive(child) })
	b.SpawndLog.wait(t, regexp.MustCompile(`msg="lease cgroup removed after all" lease_id=`+claim.LeaseID), 15*time.Second)
	if _, err := os.Stat(lease); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("lease cgroup %s still there after the retried removal: %v", lease, err)
	}
}
