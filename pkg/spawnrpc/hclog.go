package spawnrpc

import (
	"log/slog"

	"github.com/hashicorp/go-hclog"
)

// PluginLogger is go-plugin's logger for a side that logs to l: its WARN
// and ERROR lines, as WARN lines of l (the message keeps go-plugin's own
// level), so one process writes one log format. go-plugin's default logs
// everything at TRACE to stderr. While quiet returns true (a shutdown we
// asked for), the ERROR go-plugin logs for grpc.Server.Serve's "use of
// closed network connection" is dropped: it closes the listener before it
// stops gRPC, so every clean stop logs it.
func PluginLogger(l *slog.Logger, quiet func() bool) hclog.Logger {
	return hclog.FromStandardLogger(slog.NewLogLogger(l.Handler(), slog.LevelWarn), &hclog.LoggerOptions{
		Name:  "go-plugin",
		Level: hclog.Warn,
		Exclude: func(level hclog.Level, msg string, _ ...any) bool {
			return level == hclog.Error && msg == "grpc server" && quiet()
		},
	})
}
