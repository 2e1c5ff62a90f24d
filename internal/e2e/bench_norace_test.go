//go:build !race

package e2e

// benchRace reports whether this test binary has the race detector, which
// would slow the benchmarks' own client side and so skew every ratio.
const benchRace = false
