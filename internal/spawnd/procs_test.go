package spawnd

import (
	"os"
	"runtime"
	"runtime/debug"
	"testing"

	"github.com/nexus-broker/nexus-broker/internal/footprint"
)

func TestTuneProcsIsOneUnlessGOMAXPROCSIsSet(t *testing.T) {
	prev, gc := runtime.GOMAXPROCS(0), debug.SetGCPercent(100)
	t.Cleanup(func() { runtime.GOMAXPROCS(prev); debug.SetGCPercent(gc) })
	for _, c := range []struct {
		env       string // "" leaves GOMAXPROCS unset
		had, want int
	}{{"", 4, 1}, {"", 1, 1}, {"3", 3, 3}} {
		t.Run("GOMAXPROCS="+c.env, func(t *testing.T) {
			t.Setenv("GOMAXPROCS", c.env)
			if c.env == "" {
				os.Unsetenv("GOMAXPROCS") // t.Setenv restores it after
			}
			runtime.GOMAXPROCS(c.had)
			footprint.Tune(Procs)
			if got := runtime.GOMAXPROCS(0); got != c.want {
				t.Errorf("on %d processors, spawnd runs on %d, want %d", c.had, got, c.want)
			}
		})
	}
}
