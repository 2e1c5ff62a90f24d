package brokerd

import (
	"os"
	"runtime"
	"runtime/debug"
	"testing"

	"github.com/nexus-broker/nexus-broker/internal/footprint"
)

func TestProcsForLeavesTheHostsCPUs(t *testing.T) {
	for n, want := range map[int]int{1: 1, 2: 1, 4: 1, 7: 1, 8: 2, 16: 4, 64: 16} {
		if got := procsFor(n); got != want {
			t.Errorf("procsFor(%d) = %d, want %d", n, got, want)
		}
	}
}

func TestTuneProcsYieldsToGOMAXPROCS(t *testing.T) {
	prev, gc := runtime.GOMAXPROCS(0), debug.SetGCPercent(100)
	t.Cleanup(func() { runtime.GOMAXPROCS(prev); debug.SetGCPercent(gc) })
	t.Setenv("GOMAXPROCS", "3")
	runtime.GOMAXPROCS(3)
	footprint.Tune(procsFor)
	if got := runtime.GOMAXPROCS(0); got != 3 {
		t.Fatalf("with GOMAXPROCS=3 set, the gateway runs on %d processors", got)
	}
	os.Unsetenv("GOMAXPROCS")
	runtime.GOMAXPROCS(8)
	footprint.Tune(procsFor)
	if got := runtime.GOMAXPROCS(0); got != 2 {
		t.Fatalf("unset, on 8 processors the gateway runs on %d, want 2", got)
	}
}
