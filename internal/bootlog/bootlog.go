// Package bootlog turns the error that stops nexus-broker or nexus-spawnd
// into the one record upstream's broker logs for it: its message, its keys
// and the error, through the process's own slog handler, so a failed start
// reads like every other line of the log.
//
// Both nexus-broker and nexus-spawnd link it, so it may import none of
// the gateway's layers nor anything else gateway-side
// (internal/gateway/layers_test.go and cmd/nexus-spawnd's deps test check
// it).
package bootlog

import (
	"errors"
	"log/slog"
	"strings"
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

// configPrefix starts every error that names a broker.yaml key.
const configPrefix = "broker config: "

// Config gives an error that names a broker.yaml key, and has no record
// yet, upstream's "failed to load config" record for path: a value the
// file gives that this machine refuses (an entry's binary, a cgroup limit)
// is a config that did not load, as upstream, which checks them on load.
func Config(err error, path string) error {
	if err == nil || !strings.HasPrefix(err.Error(), configPrefix) {
		return err
	}
	return Wrap(LoadConfig, err, "path", path)
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
