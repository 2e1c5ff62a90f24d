// Package logbound bounds log lines that can repeat per frame or per
// request, so that no peer, however fast it misbehaves, can make a process
// write without bound (and fill the disk its state lives on).
//
// A line is keyed by its subject (a lease or a peer) and its message. The
// first occurrence of a key in a window is written at once; later ones in
// the same window are counted, and when the window ends one summary line
// is written: the same message and attributes as the first, plus
// suppressed (the count) and window. The next occurrence after that starts
// a new window. A key seen once costs one line; a flood costs two lines per
// window.
//
// It is of the gateway's floor: it may import none of the gateway's
// layers (internal/gateway/layers_test.go checks it).
package logbound

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// Window is the product's window: one line per key per 10 s, plus a summary.
const Window = 10 * time.Second

// maxKeys bounds the keys a Limiter tracks at once. Past it, new subjects
// share one key per message (subject overflowSubject), so that a peer
// inventing subjects (lease ids it makes up) cannot grow the map, nor the
// log, without bound.
const maxKeys = 4096

// overflowSubject is the subject lines share once maxKeys keys are live.
const overflowSubject = "(others)"

// Limiter writes bounded lines to one logger.
type Limiter struct {
	log    *slog.Logger
	window time.Duration

	mu   sync.Mutex
	open map[key]*occurrence
}

type key struct{ subject, msg string }

// occurrence is a key's window: the first line's level and attributes, for
// its summary, and how many were suppressed since.
type occurrence struct {
	level      slog.Level
	args       []any
	suppressed int
}

// New returns a Limiter writing to log with the given window.
func New(log *slog.Logger, window time.Duration) *Limiter {
	return &Limiter{log: log, window: window, open: map[key]*occurrence{}}
}

// Warn is Log at slog.LevelWarn.
func (l *Limiter) Warn(subject, msg string, args ...any) {
	l.Log(slog.LevelWarn, subject, msg, args...)
}

// Log writes msg with args unless (subject, msg) was already written in
// the current window, in which case it only counts it.
func (l *Limiter) Log(level slog.Level, subject, msg string, args ...any) {
	l.mu.Lock()
	k := key{subject, msg}
	if o := l.open[k]; o != nil {
		o.suppressed++
		l.mu.Unlock()
		return
	}
	if len(l.open) >= maxKeys {
		k.subject = overflowSubject
		if o := l.open[k]; o != nil {
			o.suppressed++
			l.mu.Unlock()
			return
		}
	}
	l.open[k] = &occurrence{level: level, args: args}
	l.mu.Unlock()
	time.AfterFunc(l.window, func() { l.close(k) })
	l.log.Log(context.Background(), level, msg, args...)
}

// close ends k's window, writing its summary if anything was suppressed.
func (l *Limiter) close(k key) {
	l.mu.Lock()
	o := l.open[k]
	delete(l.open, k)
	l.mu.Unlock()
	if o == nil || o.suppressed == 0 {
		return
	}
	args := append(append([]any(nil), o.args...), "suppressed", o.suppressed, "window", l.window)
	if k.subject == overflowSubject {
		args = append(args, "subjects", "many")
	}
	l.log.Log(context.Background(), o.level, k.msg, args...)
}
