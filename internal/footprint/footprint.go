// Package footprint keeps a daemon's footprint on its host to what its work
// needs: a collector goal for a small live heap, nothing resident that only
// the boot used, and the processors its goroutines run on.
//
// Both nexus-broker and nexus-spawnd link it, so it may import none of
// the gateway's layers nor anything else gateway-side
// (internal/gateway/layers_test.go and cmd/nexus-spawnd's deps test check
// it).
package footprint

import (
	"bufio"
	"bytes"
	"os"
	"runtime"
	"runtime/debug"

	"golang.org/x/sys/unix"
)

// gcPercent is the collector's goal in place of Go's 100: both heaps are a
// few MiB, so a collection costs little, while an idle daemon's resident
// headroom is the goal's, not its live data's.
const gcPercent = 50

// Tune sets the collector's goal and the processors (procs of what Go
// would use), each unless the operator chose it with GOGC or GOMAXPROCS.
func Tune(procs func(n int) int) {
	if _, set := os.LookupEnv("GOGC"); !set {
		debug.SetGCPercent(gcPercent)
	}
	if _, set := os.LookupEnv("GOMAXPROCS"); !set {
		runtime.GOMAXPROCS(procs(runtime.GOMAXPROCS(0)))
	}
}

// Booted gives back what only the boot used: the heap it left free, and the
// executable's pages it touched once (package initialisation), which stay in
// the page cache. A mapping with private copies of its pages (a debugger's
// breakpoint) is left alone. Call it again after a later one-time phase
// (spawnd: the first gateway's attach).
func Booted() {
	debug.FreeOSMemory()
	exe, err := os.Readlink("/proc/self/exe")
	if err != nil {
		return
	}
	smaps, err := os.ReadFile("/proc/self/smaps")
	if err != nil {
		return
	}
	for _, m := range readOnlyImage(smaps, exe) {
		_, _, _ = unix.Syscall(unix.SYS_MADVISE, m.start, m.end-m.start, unix.MADV_DONTNEED)
	}
}

// span is an address range [start, end).
type span struct{ start, end uintptr }

// readOnlyImage returns the read-only mappings of exe in an smaps listing
// that hold no anonymous (private, written) page.
func readOnlyImage(smaps []byte, exe string) []span {
	var out []span
	candidate := false
	sc := bufio.NewScanner(bytes.NewReader(smaps))
	for sc.Scan() {
		f := bytes.Fields(sc.Bytes())
		if len(f) == 0 {
			continue
		}
		if lo, hi, ok := bytes.Cut(f[0], []byte("-")); ok && len(f) >= 5 {
			// A mapping's header: range, perms, offset, device, inode, path.
			candidate = false
			s, ok1 := parseAddr(lo)
			e, ok2 := parseAddr(hi)
			if ok1 && ok2 && len(f) == 6 && string(f[5]) == exe && len(f[1]) == 4 && f[1][1] == '-' {
				out = append(out, span{uintptr(s), uintptr(e)})
				candidate = true
			}
			continue
		}
		if candidate && string(f[0]) == "Anonymous:" && (len(f) < 2 || string(f[1]) != "0") {
			out = out[:len(out)-1]
			candidate = false
		}
	}
	return out
}

// parseAddr reads an address as the kernel writes it in maps and smaps
// (%08lx): lowercase hex digits only. Anything else is not a mapping's
// header.
func parseAddr(b []byte) (uint64, bool) {
	if len(b) == 0 || len(b) > 16 {
		return 0, false
	}
	var v uint64
	for _, c := range b {
		switch {
		case '0' <= c && c <= '9':
			v = v<<4 | uint64(c-'0')
		case 'a' <= c && c <= 'f':
			v = v<<4 | uint64(c-'a'+10)
		default:
			return 0, false
		}
	}
	return v, true
}
