package brokerd

// cpuShare: the gateway runs its goroutines on one CPU in this many of
// what Go would give it (at least one). Its work per frame, request or RPC
// is a few microseconds between system calls, so what a relayed frame
// waits for is threads handing goroutines to each other: with a second
// processor idle, every goroutine made ready wakes a thread on another
// CPU (a futex and an interprocessor interrupt, tens of microseconds on a
// paravirtual VM) and idle threads spin looking for work, on the CPUs the
// host's instances and clients need. One processor per four CPUs still
// leaves room for concurrent leases on a large host. docs/performance.md
// ("The gateway's processors") has the figures.
const cpuShare = 4

// procsFor is the gateway's processors where Go would use n.
func procsFor(n int) int { return max(1, n/cpuShare) }
