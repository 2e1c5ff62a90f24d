package spawnd

import (
	"fmt"
	"sync"

	"golang.org/x/sys/unix"
)

// exitWatch waits for the exits of every supervised instance on one epoll
// over their pidfds. A blocking poll per lease would pin an OS thread, and
// its stacks, for each lease's whole life; here one thread waits for all,
// and each supervisor is a goroutine parked on a channel.
type exitWatch struct {
	epfd, stop int
	mu         sync.Mutex
	waiting    map[int32]chan struct{} // by pidfd
}

// newExitWatch opens the epoll; stop is the read end of the stop pipe,
// whose closing ends run.
func newExitWatch(stop int) (*exitWatch, error) {
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("creating the exit watch epoll: %w", err)
	}
	w := &exitWatch{epfd: epfd, stop: stop, waiting: map[int32]chan struct{}{}}
	if err := unix.EpollCtl(epfd, unix.EPOLL_CTL_ADD, stop, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(stop)}); err != nil {
		_ = unix.Close(epfd)
		return nil, fmt.Errorf("watching the supervisor stop pipe: %w", err)
	}
	return w, nil
}

// add returns a channel closed once the process behind pidfd has exited.
// Polling a pidfd does not reap, which is what lets supervise kill the
// group while the leader still pins its id. The caller keeps pidfd open
// until the channel is closed or the watch has stopped.
func (w *exitWatch) add(pidfd int) (<-chan struct{}, error) {
	ch := make(chan struct{})
	w.mu.Lock()
	w.waiting[int32(pidfd)] = ch
	w.mu.Unlock()
	// One-shot: the pidfd stays readable once the process has exited.
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLONESHOT, Fd: int32(pidfd)}
	if err := unix.EpollCtl(w.epfd, unix.EPOLL_CTL_ADD, pidfd, &ev); err != nil {
		w.mu.Lock()
		delete(w.waiting, int32(pidfd))
		w.mu.Unlock()
		return nil, fmt.Errorf("watching pidfd %d: %w", pidfd, err)
	}
	return ch, nil
}

// run delivers exits until the stop pipe closes or the epoll fails (its
// error is returned).
func (w *exitWatch) run() error {
	events := make([]unix.EpollEvent, 64)
	for {
		n, err := unix.EpollWait(w.epfd, events, -1)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		for _, ev := range events[:n] {
			if ev.Fd == int32(w.stop) {
				return nil
			}
			// Removed before its owner can close the pidfd and the number
			// be reused.
			_ = unix.EpollCtl(w.epfd, unix.EPOLL_CTL_DEL, int(ev.Fd), nil)
			w.mu.Lock()
			ch := w.waiting[ev.Fd]
			delete(w.waiting, ev.Fd)
			w.mu.Unlock()
			if ch != nil {
				close(ch)
			}
		}
	}
}
