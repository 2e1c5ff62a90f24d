package spawnclient

import (
	"bytes"
	"log/slog"
	"reflect"
	"strings"
	"testing"
)

func TestParseTextRecord(t *testing.T) {
	for _, c := range []struct {
		line  string
		level slog.Level
		msg   string
		attrs []any
		ok    bool
	}{
		{`time=2026-12-01T01:51:30.419Z level=INFO msg="binary registry entry" name=vision path=/opt/v resolved_path=/opt/v spawn_env=HOME,PATH`,
			slog.LevelInfo, "binary registry entry", []any{"name", "vision", "path", "/opt/v", "resolved_path", "/opt/v", "spawn_env", "HOME,PATH"}, true},
		{`time=x level=WARN msg=plain missing=""`, slog.LevelWarn, "plain", []any{"missing", ""}, true},
		{`level=ERROR msg="a \"quoted\" one\nand a newline" error="x y"`, slog.LevelError, "a \"quoted\" one\nand a newline", []any{"error", "x y"}, true},
		{`--- 2026-12-01T01:51:30Z nexus-broker pid 1 launching nexus-spawnd`, 0, "", nil, false},
		{`nexus-spawnd: broker config: binaries: nexus: path "x" does not exist`, 0, "", nil, false},
		{`level=INFO name=nomsg`, 0, "", nil, false},
		{`msg=nolevel`, 0, "", nil, false},
		{`level=LOUD msg=x`, 0, "", nil, false},
		{`level=INFO msg="unterminated`, 0, "", nil, false},
		{`level=INFO msg="x"y`, 0, "", nil, false},
		{`level=INFO msg=x level=WARN`, 0, "", nil, false},
	} {
		level, msg, attrs, ok := parseTextRecord(c.line)
		if ok != c.ok || (ok && (level != c.level || msg != c.msg || !reflect.DeepEqual(attrs, c.attrs))) {
			t.Errorf("parseTextRecord(%q) = %v %q %q %v, want %v %q %q %v", c.line, level, msg, attrs, ok, c.level, c.msg, c.attrs, c.ok)
		}
	}
}

// FuzzParseTextRecord: whatever slog's TextHandler writes parses back to
// what it was given, and no input panics.
func FuzzParseTextRecord(f *testing.F) {
	f.Add("binary registry entry", "name", "vision", "/opt/v")
	f.Add("a \"quoted\" = one", "k", "x y", "\n\x00")
	f.Fuzz(func(t *testing.T, msg, key, v1, v2 string) {
		parseTextRecord(msg)
		parseTextRecord(key + "=" + v1 + " " + v2)
		if key == "" || strings.ContainsAny(key, " =\"") || !isPlainKey(key) {
			return
		}
		var buf bytes.Buffer
		slog.New(slog.NewTextHandler(&buf, nil)).Warn(msg, key, v1, "second", v2)
		level, gotMsg, attrs, ok := parseTextRecord(strings.TrimSuffix(buf.String(), "\n"))
		if !ok || level != slog.LevelWarn || gotMsg != msg || !reflect.DeepEqual(attrs, []any{key, v1, "second", v2}) {
			t.Fatalf("%q parsed to %v %q %q %v", buf.String(), level, gotMsg, attrs, ok)
		}
	})
}

// isPlainKey reports whether slog writes key unquoted and it is not one of
// the keys the parser takes as the record's own.
func isPlainKey(key string) bool {
	for _, r := range key {
		if r <= ' ' || r >= 0x7f {
			return false
		}
	}
	return key != slog.TimeKey && key != slog.LevelKey && key != slog.MessageKey && key != "second"
}
