package spawnd

import (
	"bytes"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// threads is this process's OS thread count.
func threads(t *testing.T) int {
	t.Helper()
	data, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	_, rest, _ := bytes.Cut(data, []byte("\nThreads:"))
	line, _, _ := bytes.Cut(rest, []byte("\n"))
	n, err := strconv.Atoi(string(bytes.TrimSpace(line)))
	if err != nil {
		t.Fatalf("/proc/self/status Threads: %v", err)
	}
	return n
}

// TestSupervisorsPinNoThreadPerLease: a running lease's supervisor waits on
// the shared exit watch, not in a blocking poll of its own, so many leases
// cost no OS thread each; and every exit is still reported.
func TestSupervisorsPinNoThreadPerLease(t *testing.T) {
	const leases = 40
	h := newHarness(t, defaultYAML+"max_concurrent: 0\n")
	before := threads(t)
	var m0, m1 runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&m0)
	for i := range leases {
		h.spawn(fmt.Sprintf("%032x", i+1), "nexus")
	}
	runtime.GC()
	runtime.ReadMemStats(&m1)
	// What a lease costs this process (and the harness's gRPC client) once
	// garbage is collected, for the record.
	t.Logf("per running lease: heap in use %d B, stacks %d B, %d goroutines for %d leases",
		int64(m1.HeapInuse-m0.HeapInuse)/leases, int64(m1.StackInuse-m0.StackInuse)/leases, runtime.NumGoroutine(), leases)
	if grown := threads(t) - before; grown >= leases/2 {
		t.Fatalf("%d leases grew the process by %d OS threads; a supervisor must not pin one", leases, grown)
	}
	stream := h.watch()
	for i := range leases {
		if _, err := h.client.Terminate(h.ctx(), &spawnpb.TerminateRequest{LeaseId: fmt.Sprintf("%032x", i+1), SkipGrace: true}); err != nil {
			t.Fatal(err)
		}
	}
	seen := map[string]bool{}
	for len(seen) < leases {
		seen[h.nextExit(stream).LeaseId] = true
	}
}

// TestWatchersWaitOutsideSystemCalls: with a lease running and its log
// written, spawnd's watcher (instance exits and logs) waits parked on the
// runtime's poller, not in a blocking system call. One that blocked would
// keep the runtime's monitor thread polling every 20 µs for 10 ms after each
// of its wake-ups, on the CPU a booting instance needs.
func TestWatchersWaitOutsideSystemCalls(t *testing.T) {
	h := newHarness(t, defaultYAML)
	h.spawn(fmt.Sprintf("%032x", 1), "nexus")
	watchers := []string{"spawnd.(*exitWatch).deliver("}
	deadline := time.Now().Add(waitLimit)
	for {
		// It may be in a short system call at any instant (capping a
		// log); a waiter blocked in one stays there.
		buf := make([]byte, 1<<20)
		dump := string(buf[:runtime.Stack(buf, true)])
		parked := 0
		for _, g := range strings.Split(dump, "\n\n") {
			for _, w := range watchers {
				if strings.Contains(g, w) && !strings.Contains(g, "[syscall") {
					parked++
				}
			}
		}
		if parked == len(watchers) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("spawnd's watchers (%s) did not both wait outside a system call; every goroutine:\n%s", strings.Join(watchers, ", "), dump)
		}
		runtime.Gosched()
	}
}
