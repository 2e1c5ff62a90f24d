// Package footprint keeps a long-running process's resident memory to what
// its work needs: a collector goal suited to a daemon whose live heap is
// small, and, once the process has booted, nothing kept that only the boot
// used.
package footprint

import (
	"bufio"
	"bytes"
	"os"
	"runtime/debug"
	"strconv"

	"golang.org/x/sys/unix"
)

// gcPercent is the collector's goal for both processes, in place of Go's
// 100: the heap may grow half again over what is live before a
// collection, not double. Both heaps are small (a few MiB, most of it
// there from boot), so a collection costs little, while the headroom an
// idle daemon keeps resident is the goal's, not its live data's.
const gcPercent = 50

// Tune sets the collector's goal, unless the operator chose one with GOGC.
func Tune() {
	if _, set := os.LookupEnv("GOGC"); !set {
		debug.SetGCPercent(gcPercent)
	}
}

// Booted gives back what only the boot used: the heap it left free, and
// the executable's pages it touched once (the initialisation of every
// linked package), which stay in the page cache and are mapped again when
// something runs them. A mapping holding private copies of its pages (a
// debugger's breakpoint, a uprobe) is left alone, since dropping those
// would drop what was written into them. A process whose boot ends in a
// one-time phase it does not wait for (spawnd: the first gateway's attach)
// calls it again once that phase is over.
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
			s, err1 := strconv.ParseUint(string(lo), 16, 64)
			e, err2 := strconv.ParseUint(string(hi), 16, 64)
			if err1 == nil && err2 == nil && len(f) == 6 && string(f[5]) == exe && len(f[1]) == 4 && f[1][1] == '-' {
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
