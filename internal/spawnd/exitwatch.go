package spawnd

import (
	"errors"
	"fmt"
	"sync"

	"golang.org/x/sys/unix"
)

// exitWatch waits for every supervised instance's exit on one epoll over
// their pidfds, and for instance output (watch): one parked goroutine for
// all, where a poll per lease would pin a thread, and a goroutine per lease
// a stack, for its whole life.
type exitWatch struct {
	ep      *parkedEpoll
	stop    int
	ready   map[int32]func() // by descriptor; set before run
	mu      sync.Mutex
	waiting map[int32]func(exited bool, err error) // by pidfd
	stopped error                                  // set once run has returned
}

// errWatchStopped is an add after the watch has stopped.
var errWatchStopped = errors.New("the exit watch has stopped")

// newExitWatch opens the epoll; closing the pipe whose read end is stop
// ends run.
func newExitWatch(stop int) (*exitWatch, error) {
	ep, err := openParkedEpoll()
	if err != nil {
		return nil, fmt.Errorf("creating the exit watch: %w", err)
	}
	if err := ep.add(stop, unix.EPOLLIN); err != nil {
		_ = ep.close()
		return nil, fmt.Errorf("watching the supervisor stop pipe: %w", err)
	}
	return &exitWatch{ep: ep, stop: stop, ready: map[int32]func(){}, waiting: map[int32]func(bool, error){}}, nil
}

// watch has ready called, from the watch's goroutine, whenever fd is
// readable. Call it before run.
func (w *exitWatch) watch(fd int, ready func()) error {
	w.ready[int32(fd)] = ready
	return w.ep.add(fd, unix.EPOLLIN)
}

// add has done called once, from the watch's goroutine (so it must not
// block): true when pidfd's process has exited, false when the watch stops
// first (with its error, nil on the stop pipe). Polling a pidfd does not
// reap, so the leader still pins the group id for the supervisor. pidfd
// stays open until done has run; done is not called when add fails.
func (w *exitWatch) add(pidfd int, done func(exited bool, err error)) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.stopped != nil {
		return w.stopped
	}
	// One-shot: the pidfd stays readable once the process has exited.
	if err := w.ep.add(pidfd, unix.EPOLLIN|unix.EPOLLONESHOT); err != nil {
		return fmt.Errorf("watching pidfd %d: %w", pidfd, err)
	}
	w.waiting[int32(pidfd)] = done
	return nil
}

// run delivers exits until the stop pipe closes or the epoll fails, then
// tells every remaining waiter the watch has stopped.
func (w *exitWatch) run() error {
	err := w.deliver()
	w.mu.Lock()
	w.stopped = errWatchStopped
	waiting := w.waiting
	w.waiting = nil
	w.mu.Unlock()
	for pidfd, done := range waiting {
		// An exit that came with the stop is still an exit.
		pfd := []unix.PollFd{{Fd: pidfd, Events: unix.POLLIN}}
		n, _ := unix.Poll(pfd, 0)
		done(n == 1 && pfd[0].Revents != 0, err)
	}
	return err
}

func (w *exitWatch) deliver() error {
	for {
		events, err := w.ep.wait()
		if err != nil {
			return err
		}
		for _, ev := range events {
			if ev.Fd == int32(w.stop) {
				return nil
			}
			if ready := w.ready[ev.Fd]; ready != nil {
				ready()
				continue
			}
			w.mu.Lock()
			// Before its owner can close the pidfd and the number be reused.
			w.ep.remove(int(ev.Fd))
			done := w.waiting[ev.Fd]
			delete(w.waiting, ev.Fd)
			w.mu.Unlock()
			if done != nil {
				done(true, nil)
			}
		}
	}
}
