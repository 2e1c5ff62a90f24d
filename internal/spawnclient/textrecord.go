package spawnclient

import (
	"log/slog"
	"strconv"
	"strings"
)

// parseTextRecord reads one line written by slog's TextHandler (what
// nexus-spawnd logs with): its level, its message and its other attributes
// in order, the time dropped. ok is false for any other shape, which the
// caller then relays quoted whole.
func parseTextRecord(line string) (level slog.Level, msg string, attrs []any, ok bool) {
	var haveLevel, haveMsg bool
	for rest := line; rest != ""; {
		key, after, found := strings.Cut(rest, "=")
		if !found || key == "" || strings.ContainsAny(key, " \"") {
			return 0, "", nil, false
		}
		var val string
		if strings.HasPrefix(after, `"`) {
			q, err := strconv.QuotedPrefix(after)
			if err != nil {
				return 0, "", nil, false
			}
			val, _ = strconv.Unquote(q) // QuotedPrefix vouched for it
			after = after[len(q):]
		} else {
			end := strings.IndexByte(after, ' ')
			if end < 0 {
				end = len(after)
			}
			val, after = after[:end], after[end:]
		}
		if after != "" && after[0] != ' ' {
			return 0, "", nil, false
		}
		rest = strings.TrimPrefix(after, " ")
		switch key {
		case slog.TimeKey:
		case slog.LevelKey:
			if haveLevel || level.UnmarshalText([]byte(val)) != nil {
				return 0, "", nil, false
			}
			haveLevel = true
		case slog.MessageKey:
			if haveMsg {
				return 0, "", nil, false
			}
			msg, haveMsg = val, true
		default:
			attrs = append(attrs, key, val)
		}
	}
	return level, msg, attrs, haveLevel && haveMsg
}
