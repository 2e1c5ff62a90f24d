package spawnd

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/nexus-broker/nexus-broker/internal/inotify"
)

// Instance output goes to one file per lease in logDir, held open by the
// instance with O_APPEND. spawnd bounds both the files and the directory:
//
//   - watching the directory (inotify), it truncates a log past
//     maxInstanceLog in place behind a marker; the appending instance writes
//     on after it. No pipe (it dies with spawnd) and no RLIMIT_FSIZE (it
//     kills the writer with SIGXFSZ).
//   - past maxLogsTotal, gone leases' logs are removed, oldest first, at boot
//     and every pruneEvery new logs; a live lease's never is.
const (
	maxInstanceLog = 8 << 20
	maxLogsTotal   = 256 << 20
	pruneEvery     = 32
	// logTruncated follows a truncation (maybe after a racing line).
	logTruncated = "[nexus-spawnd: this log passed 8 MiB and was truncated here; the output before this line is gone]\n"
)

// capLog truncates the log called name behind the marker once it passes
// maxInstanceLog.
func (d *Daemon) capLog(name string, warned map[string]bool) {
	path := filepath.Join(d.logDir, name)
	// Nearly every event is well under the cap: one lstat(2) says so.
	var st unix.Stat_t
	if unix.Lstat(path, &st) != nil || st.Size <= maxInstanceLog {
		return
	}
	fd, err := unix.Open(path, unix.O_WRONLY|unix.O_APPEND|unix.O_NOFOLLOW|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return // removed meanwhile
	}
	defer unix.Close(fd)
	if unix.Fstat(fd, &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFREG || st.Size <= maxInstanceLog {
		return
	}
	if err := unix.Ftruncate(fd, 0); err != nil {
		d.log.Error("truncating an instance log that passed its cap failed", "path", path, "error", err)
		return
	}
	_, _ = unix.Write(fd, []byte(logTruncated))
	if !warned[name] {
		warned[name] = true
		d.log.Warn("an instance log passed its cap and was truncated in place; its instance writes on after a marker",
			"path", path, "cap_bytes", maxInstanceLog)
	}
}

func (d *Daemon) capAllLogs(warned map[string]bool) {
	ents, _ := os.ReadDir(d.logDir)
	for _, e := range ents {
		if strings.HasSuffix(e.Name(), ".log") {
			d.capLog(e.Name(), warned)
		}
	}
}

// pruneLogs removes the logs of gone leases, oldest first, while the
// directory holds more than maxLogsTotal.
func (d *Daemon) pruneLogs() {
	ents, err := os.ReadDir(d.logDir)
	if err != nil {
		return
	}
	type logFile struct {
		name string
		info fs.FileInfo
	}
	var gone []logFile
	var total int64
	d.mu.Lock()
	for _, e := range ents {
		info, err := e.Info()
		if err != nil || !info.Mode().IsRegular() {
			continue
		}
		total += info.Size()
		if _, live := d.leases[strings.TrimSuffix(e.Name(), ".log")]; !live {
			gone = append(gone, logFile{e.Name(), info})
		}
	}
	d.mu.Unlock()
	slices.SortFunc(gone, func(a, b logFile) int { return a.info.ModTime().Compare(b.info.ModTime()) })
	removed := 0
	for _, f := range gone {
		if total <= maxLogsTotal {
			break
		}
		if err := os.Remove(filepath.Join(d.logDir, f.name)); err == nil || errors.Is(err, fs.ErrNotExist) {
			total -= f.info.Size()
			removed++
		}
	}
	if removed > 0 {
		d.log.Info("removed the oldest logs of ended leases to keep the instance log directory bounded",
			"dir", d.logDir, "removed", removed, "limit_bytes", maxLogsTotal)
	}
}

// startLogWatch prunes what an earlier run left and has the exit watch cap
// each log as it grows.
func (d *Daemon) startLogWatch() error {
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		return err
	}
	d.logWatch = fd // release closes it
	if _, err := unix.InotifyAddWatch(d.logWatch, d.logDir, unix.IN_MODIFY|unix.IN_CREATE); err != nil {
		return err
	}
	d.pruneLogs()
	warned := map[string]bool{} // one WARN per log, however often it fills
	created := 0
	buf := make([]byte, 64<<10)
	return d.exits.watch(d.logWatch, func() {
		n, err := unix.Read(d.logWatch, buf)
		if err != nil {
			return // EAGAIN: nothing after all
		}
		for name, mask := range inotify.Events(buf[:n]) {
			switch {
			case mask&unix.IN_Q_OVERFLOW != 0:
				d.capAllLogs(warned) // events were lost: look at every log
			case mask&unix.IN_CREATE != 0:
				if created++; created%pruneEvery == 0 {
					d.pruneLogs()
				}
			case strings.HasSuffix(name, ".log"):
				d.capLog(name, warned)
			}
		}
	})
}
