package spawnclient

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"

	"github.com/hashicorp/go-plugin/runner"
	"golang.org/x/sys/unix"
)

// pidfdRunner is the go-plugin AttachedRunner for an attached spawnd. It
// learns of spawnd's exit from a pidfd, which any user may open and poll
// for any pid. go-plugin's default runner polls kill(pid, 0) instead, which
// an unprivileged gateway gets EPERM for against a root spawnd and would
// report as dead.
//
// It never signals spawnd: Kill only detaches.
type pidfdRunner struct {
	pid  int
	done chan struct{} // closed when spawnd exited or we detached

	mu       sync.Mutex
	pidfd    int
	wakefd   int // eventfd that ends the poll on detach
	closed   bool
	exitSeen bool
}

var _ runner.AttachedRunner = (*pidfdRunner)(nil)

// openPidfdRunner opens a pidfd for pid. A pid that does not exist is
// ErrStale. Open it before checking the socket: a pidfd pins the
// process it was opened for, so a later check cannot be fooled by pid
// reuse.
func openPidfdRunner(pid int) (*pidfdRunner, error) {
	pidfd, err := unix.PidfdOpen(pid, 0)
	if errors.Is(err, unix.ESRCH) {
		return nil, fmt.Errorf("%w: spawnd pid %d is gone", ErrStale, pid)
	}
	if err != nil {
		return nil, fmt.Errorf("pidfd_open(%d): %w", pid, err)
	}
	wakefd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		unix.Close(pidfd)
		return nil, fmt.Errorf("eventfd: %w", err)
	}
	r := &pidfdRunner{pid: pid, pidfd: pidfd, wakefd: wakefd, done: make(chan struct{})}
	go r.watch()
	return r, nil
}

func (r *pidfdRunner) watch() {
	fds := []unix.PollFd{{Fd: int32(r.pidfd), Events: unix.POLLIN}, {Fd: int32(r.wakefd), Events: unix.POLLIN}}
	exited := false
	for {
		_, err := unix.Poll(fds, -1)
		if err == unix.EINTR {
			continue
		}
		// A pidfd turns readable when its process exits. Any other poll
		// error leaves us unable to watch, which we report as an exit so
		// the client re-attaches rather than trusting a blind connection.
		exited = err != nil || fds[0].Revents != 0
		break
	}
	r.mu.Lock()
	r.closed = true
	r.exitSeen = exited
	unix.Close(r.pidfd)
	unix.Close(r.wakefd)
	r.mu.Unlock()
	close(r.done)
}

// exited reports, once done is closed, whether spawnd exited (rather than
// us detaching).
func (r *pidfdRunner) exited() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.exitSeen
}

// detach ends the watch without touching spawnd.
func (r *pidfdRunner) detach() {
	r.mu.Lock()
	if !r.closed {
		// Any non-zero 8-byte count makes the eventfd readable.
		_, _ = unix.Write(r.wakefd, []byte{1, 1, 1, 1, 1, 1, 1, 1})
	}
	r.mu.Unlock()
	<-r.done
}

// Wait blocks until spawnd exits or we detach.
func (r *pidfdRunner) Wait(ctx context.Context) error {
	select {
	case <-r.done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Kill detaches. go-plugin's Client.Kill would call it after asking the
// server to shut down; spawnd must outlive every gateway, so neither
// happens (spawnd also refuses go-plugin's Shutdown RPC).
func (r *pidfdRunner) Kill(context.Context) error {
	r.detach()
	return nil
}

func (r *pidfdRunner) ID() string { return strconv.Itoa(r.pid) }

// PluginToHost and HostToPlugin: spawnd shares our network namespace.
func (r *pidfdRunner) PluginToHost(n, a string) (string, string, error) { return n, a, nil }
func (r *pidfdRunner) HostToPlugin(n, a string) (string, string, error) { return n, a, nil }
