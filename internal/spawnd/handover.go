package spawnd

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/nexus-broker/nexus-broker/internal/inotify"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// Released hands: a release the gateway answered while spawnd did not
// answer (stopped, or restarting) must not be forgotten if the gateway stops
// too before spawnd acts on it. So the gateway also hands it over durably,
// as an empty file named by the lease id in <run_dir>/releases, a directory
// of the gateway's uid that spawnd creates; spawnd terminates each lease it
// finds there, at boot (after recovery) and as each file appears, and
// removes the file once the lease is gone. A file is a Terminate the
// gateway may send anyway: spawnd reads names only, never a file's content,
// and opens nothing there.

// reasonHandedRelease is the ended reason of a handed release: the
// gateway's for POST /release.
const reasonHandedRelease = "manual release"

// TakeReleases creates dir (mode 0700, owned by gatewayUID) unless it is
// there, carries out the releases already in it, and watches it for more
// until Close. Call it once, after New.
func (d *Daemon) TakeReleases(dir string, gatewayUID int) error {
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("creating the released-lease directory %s: %w", dir, err)
	}
	// The run directory is spawnd's, so nobody else put dir there; a
	// directory is all it may be.
	if st, err := os.Lstat(dir); err != nil || !st.IsDir() {
		return fmt.Errorf("released-lease directory %s is not a directory; remove it", dir)
	}
	if err := os.Chown(dir, gatewayUID, -1); err != nil {
		return fmt.Errorf("giving the released-lease directory %s to spawnd.gateway_uid %d: %w", dir, gatewayUID, err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return err
	}
	fd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	if err != nil {
		return fmt.Errorf("watching %s: %w", dir, err)
	}
	if _, err := unix.InotifyAddWatch(fd, dir, unix.IN_MOVED_TO|unix.IN_CLOSE_WRITE); err != nil {
		_ = unix.Close(fd)
		return fmt.Errorf("watching %s: %w", dir, err)
	}
	w := os.NewFile(uintptr(fd), "inotify "+dir)
	d.mu.Lock()
	d.releases, d.releaseWatch = dir, w
	d.mu.Unlock()
	// Watched before the scan, so no file falls between the two.
	names, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("reading %s: %w", dir, err)
	}
	for _, de := range names {
		d.takeRelease(de.Name())
	}
	d.wg.Add(1)
	go d.watchReleases(w)
	return nil
}

// watchReleases carries out each release handed over until Close closes w.
func (d *Daemon) watchReleases(w *os.File) {
	defer d.wg.Done()
	buf := make([]byte, 64<<10)
	for {
		n, err := w.Read(buf)
		if err != nil {
			return
		}
		for name, mask := range inotify.Events(buf[:n]) {
			if mask&unix.IN_Q_OVERFLOW != 0 {
				if names, err := os.ReadDir(d.releases); err == nil {
					for _, de := range names {
						d.takeRelease(de.Name())
					}
				}
				continue
			}
			d.takeRelease(name)
		}
	}
}

// takeRelease begins the teardown of the lease a handed-over file names,
// and removes the file of a lease spawnd does not hold (gone, or never
// ours); a spawning lease's file stays until that lease is gone.
func (d *Daemon) takeRelease(name string) {
	if name == "" || strings.HasPrefix(name, ".") {
		return // the gateway's temp file, renamed into place when whole
	}
	_, err := d.Terminate(context.Background(), &spawnpb.TerminateRequest{LeaseId: name, Reason: reasonHandedRelease, NoWait: true})
	switch status.Code(err) {
	case codes.OK:
		d.log.Info("carrying out a release the gateway handed over", "lease_id", name)
	case codes.NotFound, codes.InvalidArgument:
		d.dropRelease(name)
	}
}

// dropRelease removes a lease's handed-over release, if any.
func (d *Daemon) dropRelease(id string) {
	d.mu.Lock()
	dir := d.releases
	d.mu.Unlock()
	if dir == "" {
		return
	}
	if err := os.Remove(filepath.Join(dir, id)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		d.log.Warn("removing a carried-out release the gateway handed over failed", "path", filepath.Join(dir, id), "error", err)
	}
}
