package spawnclient

import (
	"os"

	"golang.org/x/sys/unix"

	"github.com/nexus-broker/nexus-broker/internal/inotify"
)

// fileWatcher signals on C whenever one file name in a directory is
// created, replaced (spawnd.json arrives by rename) or removed, so waiting
// for a spawnd to publish is event-driven. Callers still re-check on a
// capped backoff: inotify may be unavailable (limits, exotic filesystems)
// and then C is nil and never fires.
type fileWatcher struct {
	C    <-chan struct{}
	f    *os.File
	done chan struct{}
}

func watchFile(dir, name string) *fileWatcher {
	w := &fileWatcher{}
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		return w
	}
	if _, err := unix.InotifyAddWatch(fd, dir, unix.IN_CREATE|unix.IN_MOVED_TO|unix.IN_CLOSE_WRITE|unix.IN_DELETE|unix.IN_MOVED_FROM); err != nil {
		unix.Close(fd)
		return w
	}
	// A non-blocking descriptor handed to os.NewFile joins Go's poller:
	// Read parks the goroutine, and Close wakes it.
	w.f = os.NewFile(uintptr(fd), "inotify:"+dir)
	ch := make(chan struct{}, 1)
	w.C = ch
	w.done = make(chan struct{})
	go w.read(ch, name)
	return w
}

func (w *fileWatcher) read(ch chan<- struct{}, name string) {
	defer close(w.done)
	buf := make([]byte, 16*(unix.SizeofInotifyEvent+unix.NAME_MAX+1))
	for {
		n, err := w.f.Read(buf)
		if err != nil {
			return
		}
		for evName, mask := range inotify.Events(buf[:n]) {
			if evName == name || mask&unix.IN_Q_OVERFLOW != 0 {
				select {
				case ch <- struct{}{}:
				default:
				}
			}
		}
	}
}

// Close stops watching.
func (w *fileWatcher) Close() {
	if w.f == nil {
		return
	}
	w.f.Close()
	<-w.done
}
