package spawnrpc

import (
	"context"
	"io"
	"log"
	"log/slog"
	"sync/atomic"

	"github.com/hashicorp/go-hclog"
)

// hclogAdapter sends go-plugin's hclog output to our slog logger, so one
// process writes one log format. go-plugin's own default logs everything
// at TRACE to stderr.
type hclogAdapter struct {
	log  *slog.Logger
	name string
	args []any
	// stopping, when set, marks a shutdown we asked for: go-plugin closes
	// the listener before stopping gRPC, so every clean stop makes it log
	// grpc.Server.Serve's "use of closed network connection" as an ERROR.
	stopping *atomic.Bool
}

// NewHCLog is go-plugin's logger for a side that logs to l.
func NewHCLog(l *slog.Logger) hclog.Logger { return newHCLog(l) }

func newHCLog(l *slog.Logger) *hclogAdapter {
	return &hclogAdapter{log: l.With("component", "go-plugin"), stopping: new(atomic.Bool)}
}

func slogLevel(l hclog.Level) slog.Level {
	switch l {
	case hclog.Trace:
		return slog.LevelDebug - 4
	case hclog.Debug:
		return slog.LevelDebug
	case hclog.Warn:
		return slog.LevelWarn
	case hclog.Error:
		return slog.LevelError
	default:
		return slog.LevelInfo
	}
}

func (a *hclogAdapter) Log(level hclog.Level, msg string, args ...any) {
	if level == hclog.Off {
		return
	}
	if level == hclog.Error && msg == "grpc server" && a.stopping.Load() {
		level = hclog.Debug
	}
	all := append(append([]any{}, a.args...), args...)
	if a.name != "" {
		all = append(all, "logger", a.name)
	}
	a.log.Log(context.Background(), slogLevel(level), msg, all...)
}

func (a *hclogAdapter) Trace(msg string, args ...any) { a.Log(hclog.Trace, msg, args...) }
func (a *hclogAdapter) Debug(msg string, args ...any) { a.Log(hclog.Debug, msg, args...) }
func (a *hclogAdapter) Info(msg string, args ...any)  { a.Log(hclog.Info, msg, args...) }
func (a *hclogAdapter) Warn(msg string, args ...any)  { a.Log(hclog.Warn, msg, args...) }
func (a *hclogAdapter) Error(msg string, args ...any) { a.Log(hclog.Error, msg, args...) }

func (a *hclogAdapter) enabled(l hclog.Level) bool {
	return a.log.Enabled(context.Background(), slogLevel(l))
}

func (a *hclogAdapter) IsTrace() bool { return a.enabled(hclog.Trace) }
func (a *hclogAdapter) IsDebug() bool { return a.enabled(hclog.Debug) }
func (a *hclogAdapter) IsInfo() bool  { return a.enabled(hclog.Info) }
func (a *hclogAdapter) IsWarn() bool  { return a.enabled(hclog.Warn) }
func (a *hclogAdapter) IsError() bool { return a.enabled(hclog.Error) }

func (a *hclogAdapter) ImpliedArgs() []any { return a.args }

func (a *hclogAdapter) With(args ...any) hclog.Logger {
	cp := *a
	cp.args = append(append([]any{}, a.args...), args...)
	return &cp
}

func (a *hclogAdapter) Name() string { return a.name }

func (a *hclogAdapter) Named(name string) hclog.Logger {
	cp := *a
	if cp.name != "" {
		name = cp.name + "." + name
	}
	cp.name = name
	return &cp
}

func (a *hclogAdapter) ResetNamed(name string) hclog.Logger {
	cp := *a
	cp.name = name
	return &cp
}

// SetLevel is a no-op: the slog handler owns the level.
func (a *hclogAdapter) SetLevel(hclog.Level) {}

func (a *hclogAdapter) GetLevel() hclog.Level {
	for _, l := range []hclog.Level{hclog.Trace, hclog.Debug, hclog.Info, hclog.Warn} {
		if a.enabled(l) {
			return l
		}
	}
	return hclog.Error
}

func (a *hclogAdapter) StandardLogger(*hclog.StandardLoggerOptions) *log.Logger {
	return slog.NewLogLogger(a.log.Handler(), slog.LevelInfo)
}

func (a *hclogAdapter) StandardWriter(*hclog.StandardLoggerOptions) io.Writer {
	return a.StandardLogger(nil).Writer()
}
