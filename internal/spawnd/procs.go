package spawnd

// Procs is the processors spawnd runs its goroutines on wherever Go would
// use more: one (footprint.Tune; GOMAXPROCS still wins). Its work per claim
// is a handful of RPCs, an exec and an exit, microseconds each between
// system calls, and its execs are serialised anyway (syscall.ForkLock); with a second processor
// idle, every goroutine made ready woke a thread on another CPU, the
// instance's. On the 2-core VM one processor cut spawnd's CPU per claim
// and release by a fifth and its context switches by a third, with the
// claim no slower (docs/performance.md, "Claim").
func Procs(int) int { return 1 }
