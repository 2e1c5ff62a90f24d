// Package bootlog turns the error that stops nexus-broker or nexus-spawnd
// into the one record upstream's broker logs for it: its message, its keys
// and the error, through the process's own slog handler, so a failed start
// reads like every other line of the log.
package bootlog

import (
	"errors"
	"log/slog"
)

// Upstream's messages for a start that fails at each of these steps.
const (
	LoadConfig   = "failed to load config"
	OpenState    = "failed to open lease state"
	LoadSpawnKey = "failed to load the broker spawn key"
	HTTPGateway  = "http gateway failed"
)

// Error is an error with the record that reports it.
type Error struct {
	Msg   string
	Attrs []any
	Err   error
}

func (e *Error) Error() string { return e.Err.Error() }
func (e *Error) Unwrap() error { return e.Err }

// Wrap gives err the record msg with attrs (key, value pairs). An err that
// already has a record keeps it: the innermost step knows best what failed.
func Wrap(msg string, err error, attrs ...any) error {
	if err == nil {
		return nil
	}
	var e *Error
	if errors.As(err, &e) {
		return err
	}
	return &Error{Msg: msg, Attrs: attrs, Err: err}
}

// Log writes err's record at ERROR, with its attributes and error=; an
// error without one is logged with fallback as its message.
func Log(log *slog.Logger, err error, fallback string) {
	var e *Error
	if !errors.As(err, &e) {
		e = &Error{Msg: fallback, Err: err}
	}
	log.Error(e.Msg, append(append([]any(nil), e.Attrs...), "error", err.Error())...)
}
