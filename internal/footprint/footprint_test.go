package footprint

import (
	"bufio"
	"bytes"
	"os"
	"strconv"
	"strings"
	"testing"
)

const exe = "/usr/bin/nexus-broker"

// smaps is a trimmed /proc/<pid>/smaps: the executable's text, its
// read-only data (one of them holding a written page), its writable data,
// the heap, and a library.
const smaps = `00400000-00b90000 r-xp 00000000 fe:00 9978486                            /usr/bin/nexus-broker
Size:               7744 kB
Rss:                7032 kB
Anonymous:             0 kB
VmFlags: rd ex mr mw me
00b90000-0141e000 r--p 00790000 fe:00 9978486                            /usr/bin/nexus-broker
Size:               8760 kB
Rss:                7288 kB
Anonymous:             0 kB
VmFlags: rd mr mw me
0141e000-014a3000 rw-p 0101e000 fe:00 9978486                            /usr/bin/nexus-broker
Rss:                 404 kB
Anonymous:           140 kB
014a3000-014a4000 r--p 0101e000 fe:00 9978486                            /usr/bin/nexus-broker
Rss:                   4 kB
Anonymous:             4 kB
122018c00000-122019400000 rw-p 00000000 00:00 0 
Rss:                1956 kB
Anonymous:          1956 kB
7f8c7d0fd000-7f8c7d253000 r-xp 00026000 fe:00 326269                     /usr/lib/x86_64-linux-gnu/libc.so.6
Rss:                 972 kB
Anonymous:             0 kB
`

func TestReadOnlyImage(t *testing.T) {
	got := readOnlyImage([]byte(smaps), exe)
	want := []span{{0x400000, 0xb90000}, {0xb90000, 0x141e000}}
	if len(got) != len(want) {
		t.Fatalf("got %x, want %x: only the executable's read-only mappings without a written page", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("mapping %d: got %x, want %x", i, got[i], want[i])
		}
	}
	if got := readOnlyImage([]byte(smaps), "/usr/bin/other"); len(got) != 0 {
		t.Fatalf("another executable's listing gave %x", got)
	}
}

// TestBootedUnmapsTheImage: after Booted the test binary's own read-only
// pages are no longer all resident, and it still runs (everything it
// needs is mapped again on use).
func TestBootedUnmapsTheImage(t *testing.T) {
	before := rssFile(t)
	Booted()
	after := rssFile(t)
	t.Logf("RssFile %d kB before, %d kB after", before, after)
	if after >= before {
		t.Fatalf("RssFile %d kB after Booted, %d kB before: nothing was unmapped", after, before)
	}
}

func rssFile(t *testing.T) int64 {
	t.Helper()
	data, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "RssFile:"); ok {
			n, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatal("no RssFile in /proc/self/status")
	return 0
}

// FuzzReadOnlyImage: any listing yields only well-formed ranges of the
// executable, and never a panic.
func FuzzReadOnlyImage(f *testing.F) {
	f.Add([]byte(smaps))
	f.Add([]byte("0-1 r--p 0 0:0 1 /usr/bin/nexus-broker\nAnonymous:"))
	f.Fuzz(func(t *testing.T, data []byte) {
		for _, s := range readOnlyImage(data, exe) {
			if !bytes.Contains(data, []byte(strconv.FormatUint(uint64(s.start), 16))) {
				t.Fatalf("span %x is not in the listing", s)
			}
		}
	})
}
