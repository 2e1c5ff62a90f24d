// Package envdur reads the test-only duration overrides the broker's
// sockets and HTTP server take from the environment (the liveness probe,
// the write wait, the HTTP bounds): constants of the product that only
// tests shorten, never configuration keys.
//
// It imports nothing of the project.
package envdur

import (
	"os"
	"strings"
	"time"
)

// Override sets each of ds from a test override in env of as many
// positive Go durations, comma-separated; anything else leaves them alone.
func Override(env string, ds ...*time.Duration) {
	fields := strings.Split(os.Getenv(env), ",")
	if len(fields) != len(ds) {
		return
	}
	vals := make([]time.Duration, len(ds))
	for i, f := range fields {
		d, err := time.ParseDuration(f)
		if err != nil || d <= 0 {
			return
		}
		vals[i] = d
	}
	for i, d := range ds {
		*d = vals[i]
	}
}
