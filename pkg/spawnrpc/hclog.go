package spawnrpc

import (
	"log/slog"

	"github.com/hashicorp/go-hclog"
)

// PluginLogger passes go-plugin's WARN and ERROR lines to l as WARNs (the
// message keeps go-plugin's level), so one process writes one format; its
// default logs everything at TRACE to stderr. While quiet returns true (our
// shutdown), the ERROR every clean stop logs ("use of closed network
// connection": the listener closes before gRPC stops) is dropped.
func PluginLogger(l *slog.Logger, quiet func() bool) hclog.Logger {
	return hclog.FromStandardLogger(slog.NewLogLogger(l.Handler(), slog.LevelWarn), &hclog.LoggerOptions{
		Name:  "go-plugin",
		Level: hclog.Warn,
		Exclude: func(level hclog.Level, msg string, _ ...any) bool {
			return level == hclog.Error && msg == "grpc server" && quiet()
		},
	})
}
