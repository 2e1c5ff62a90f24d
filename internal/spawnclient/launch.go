package spawnclient

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nexus-broker/nexus-broker/internal/config/core"
	"github.com/nexus-broker/nexus-broker/internal/safedir"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc"
)

// SpawndBinary is the executable name Launch mode looks for.
const SpawndBinary = "nexus-spawnd"

// Files a launching gateway keeps in the run directory.
const (
	// LogFile receives a launched spawnd's stdout and stderr.
	LogFile = "spawnd.log"
	// launchLockFile serialises gateways that want to launch spawnd.
	launchLockFile = "launch.lock"
)

// LaunchedIdleExit is how long a spawnd launched by a gateway stays up with
// no lease and no gateway attached (nexus-spawnd -idle-exit).
const LaunchedIdleExit = 10 * time.Second

// lockLaunch takes runDir/launch.lock, abandoning the wait when ctx ends.
func lockLaunch(ctx context.Context, runDir string) (*os.File, error) {
	// Launch mode is development: the gateway's user owns the run
	// directory and may create it, as the spawnd it launches will.
	if err := spawnrpc.PrepareRunDir(runDir, -1); err != nil {
		return nil, err
	}
	path := filepath.Join(runDir, launchLockFile)
	f, err := flock(path, os.O_RDWR|os.O_CREATE, 0o640, unix.LOCK_EX|unix.LOCK_NB)
	if err == nil || !errors.Is(err, unix.EWOULDBLOCK) {
		return f, err
	}
	// Another gateway is launching. flock cannot be interrupted, so wait
	// in a goroutine; if ctx ends first, that goroutine releases the lock
	// as soon as it gets it.
	got := make(chan *os.File, 1)
	failed := make(chan error, 1)
	go func() {
		f, err := flock(path, os.O_RDWR|os.O_CREATE, 0o640, unix.LOCK_EX)
		if err != nil {
			failed <- err
			return
		}
		got <- f
	}()
	select {
	case f := <-got:
		return f, nil
	case err := <-failed:
		return nil, err
	case <-ctx.Done():
		go func() {
			select {
			case f := <-got:
				f.Close()
			case <-failed:
			}
		}()
		return nil, ctx.Err()
	}
}

// launched is a spawnd this process started.
type launched struct {
	pid     int
	path    string
	logPath string
	// logStart is where this launch's output begins in spawnd.log, so an
	// error quotes this attempt only, never an earlier one's lines.
	logStart int64
	exited   <-chan error // receives cmd.Wait's result, which also reaps it
}

// startSpawnd starts spawnd detached: its own session (no terminal signal
// or hang-up reaches it), stdin /dev/null, stdout and stderr appended to
// spawnd.log. Never a pipe: a Go program writing to a pipe whose reader
// died is killed by SIGPIPE (go-plugin after its host died, nomad#27815),
// and this spawnd must outlive the gateway that started it.
func (c *Client) startSpawnd() (*launched, error) {
	path, err := c.spawndPath()
	if err != nil {
		return nil, err
	}
	logPath := filepath.Join(c.opts.RunDir, LogFile)
	logf, err := safedir.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o640)
	if err != nil {
		return nil, fmt.Errorf("open spawnd log: %w", err)
	}
	defer logf.Close()
	devnull, err := os.Open(os.DevNull)
	if err != nil {
		return nil, err
	}
	defer devnull.Close()

	args := []string{"-run-dir", c.opts.RunDir, "-idle-exit", LaunchedIdleExit.String()}
	if c.opts.ConfigPath != "" {
		args = append([]string{"-config", c.opts.ConfigPath}, args...)
	}
	cmd := exec.Command(path, args...)
	// *os.File stdio is handed over as the descriptors themselves, with no
	// copying goroutine in between.
	cmd.Stdin, cmd.Stdout, cmd.Stderr = devnull, logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	fmt.Fprintf(logf, "--- %s nexus-broker pid %d launching %s %s\n",
		time.Now().Format(time.RFC3339), os.Getpid(), path, strings.Join(args, " "))
	start, err := logf.Seek(0, io.SeekEnd)
	if err != nil {
		return nil, fmt.Errorf("spawnd log %s: %w", logPath, err)
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("launch %s: %w", path, err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	return &launched{pid: cmd.Process.Pid, path: path, logPath: logPath, logStart: start, exited: exited}, nil
}

// spawndPath is SpawndPath, else nexus-spawnd beside this executable (how
// a release is unpacked), else nexus-spawnd on PATH.
func (c *Client) spawndPath() (string, error) {
	if c.opts.SpawndPath != "" {
		return c.opts.SpawndPath, nil
	}
	if exe, err := os.Executable(); err == nil {
		p := filepath.Join(filepath.Dir(exe), SpawndBinary)
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() && st.Mode().Perm()&0o111 != 0 {
			return p, nil
		}
	}
	if p, err := exec.LookPath(SpawndBinary); err == nil {
		return p, nil
	}
	return "", fmt.Errorf("cannot find %s beside this executable or on PATH: build it (go build -o <dir of nexus-broker> ./cmd/nexus-spawnd), or start `%s` yourself", SpawndBinary, c.startHint())
}

// awaitEndpoint waits for the launched spawnd to publish spawnd.json with
// its own pid. An older spawnd.json (a dead spawnd's) does not count.
func (l *launched) awaitEndpoint(ctx context.Context, runDir string) (spawnrpc.Endpoint, error) {
	w := watchFile(runDir, spawnrpc.EndpointFile)
	defer w.Close()
	deadline := time.NewTimer(launchTimeout)
	defer deadline.Stop()
	backoff := 10 * time.Millisecond
	for {
		if ep, err := spawnrpc.ReadEndpoint(runDir); err == nil && ep.Pid == l.pid {
			return ep, nil
		}
		t := time.NewTimer(backoff)
		select {
		case err := <-l.exited:
			t.Stop()
			return spawnrpc.Endpoint{}, fmt.Errorf("nexus-spawnd (pid %d) exited during startup (%v); its log is %s", l.pid, err, l.logPath)
		case <-deadline.C:
			t.Stop()
			return spawnrpc.Endpoint{}, fmt.Errorf("nexus-spawnd (pid %d) did not publish %s within %v; see %s", l.pid, spawnrpc.EndpointFile, launchTimeout, l.logPath)
		case <-ctx.Done():
			t.Stop()
			return spawnrpc.Endpoint{}, fmt.Errorf("waiting for nexus-spawnd (pid %d) to start: %w", l.pid, ctx.Err())
		case <-w.C:
		case <-t.C:
		}
		t.Stop()
		// The watch makes this fast; the re-check covers a missed event.
		backoff = min(2*backoff, 500*time.Millisecond)
	}
}

// relayBootBytes bounds how much of a launched spawnd's boot output is
// relayed.
const relayBootBytes = 64 << 10

// relayBoot repeats in the gateway's log what a launched spawnd said at boot
// that an operator must see (its registry lines, every WARN and ERROR, such
// as why it refused to start): spawnd.log is not where someone running make
// run looks. Each record is logged again as itself (level, message,
// attributes, re-quoted by this log's handler, so no value can pose as a
// line of its own) and tagged spawnd_pid. It returns the last few lines
// that are not records (a flag error, a panic), for an error to quote.
func (l *launched) relayBoot(log *slog.Logger) (stray []string) {
	f, err := safedir.OpenFile(l.logPath, os.O_RDONLY, 0)
	if err != nil {
		return nil
	}
	defer f.Close()
	sc := bufio.NewScanner(io.NewSectionReader(f, l.logStart, relayBootBytes))
	for sc.Scan() {
		line := sc.Text()
		level, msg, attrs, ok := parseTextRecord(line)
		switch {
		case !ok && strings.TrimSpace(line) != "":
			stray = append(stray, line)
			if len(stray) > maxStray {
				stray = stray[1:]
			}
		case ok && msg == core.NoStateDirWarning:
			// The gateway says it itself, once, in upstream's words.
		case ok && (level >= slog.LevelWarn || msg == "binary registry entry"):
			log.Log(context.Background(), level, msg, append(attrs, "spawnd_pid", l.pid)...)
		}
	}
	return stray
}

// maxStray is how many of a launched spawnd's non-record lines an error
// quotes.
const maxStray = 8

// flock opens path as safedir.OpenFile does and takes an flock on it (how:
// unix.LOCK_EX or unix.LOCK_SH, optionally | unix.LOCK_NB). Closing the
// file releases it; the descriptor is close-on-exec, so no child ever
// inherits the lock.
func flock(path string, flag int, perm os.FileMode, how int) (*os.File, error) {
	f, err := safedir.OpenFile(path, flag, perm)
	if err != nil {
		return nil, err
	}
	for {
		err = unix.Flock(int(f.Fd()), how)
		if err != unix.EINTR {
			break
		}
	}
	if err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}
