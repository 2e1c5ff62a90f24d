package e2e

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// idleLeases is how many idle leases BenchmarkIdleLeaseMemory holds open:
// enough that the per-lease share dwarfs the noise of a Go heap, few enough
// that their nexus-echo processes fit a laptop.
const idleLeases = 200

// BenchmarkIdleLeaseMemory reports what one idle lease costs the broker:
// its gateway and its spawnd together, without a client and with one.
//
// Method. Neither process has a pprof endpoint, so the measure is their
// resident sets: read with no lease, again with idleLeases leases claimed
// and no client, and again once each has a client connected. Each read is
// taken only once two reads 250 ms apart agree (within rssTolerance),
// because a Go process's RSS drifts for a while after a burst as the
// collector and scavenger catch up. The growth of the anonymous part
// (RssAnon: heap, stacks, the runtime's own structures) over idleLeases is
// the cost per lease. RSS counts only touched pages, so memory a lease
// allocates but never touches (the unused tails of its sockets' I/O
// buffers) is not in it; it does include garbage the collector has not yet
// returned.
//
// The file-backed part (RssFile: the executable's pages, mapped from the
// page cache) is reported apart, as file-KiB, and is not a cost per lease:
// a lease maps no file. What grows there during the claims is the
// executable's frame tables (.gopclntab's pc and func data, which the
// runtime reads to scan and grow the stacks of claims in flight) and some
// read-only data, faulted in 64 KiB at a time, once: a second idleLeases
// leases add nothing to it. Divided by the leases it was 40% of spawnd's
// former figure, and moved with the binary's layout alone.
//
// "Buffers excluded": an idle lease's replay buffer holds just the two
// frames its instance sent on registering (ready and session-id-report,
// seq 1 and 2), re-encoded with the lease id. Those bytes, computed
// exactly as the gateway encodes them, are subtracted. (They are about
// 200 bytes a lease: the subtraction is for honesty, not effect.)
//
// Each iteration of the loop is one more stable reading with clients; the
// median is reported.
func BenchmarkIdleLeaseMemory(b *testing.B) {
	benchPreflight(b)
	subjects := benchSubjects(b, Options{YAML: "max_concurrent: 0\nidle_timeout: 0s\n"})
	type reading struct{ gateway, spawnd resident }
	stable := func(p pair) reading { return reading{stableRSS(b, p.gateway), stableRSS(b, p.spawnd)} }
	type figures struct {
		idle, noClient reading
		withClient     []reading
		retained       int64
	}
	figs := make([]figures, len(subjects))
	for k, s := range subjects {
		p := s.br.pair()
		// A warm-up claim so that one-time costs (the spawnd connection,
		// the HTTP server's first goroutines) are in the baseline, not in
		// the leases.
		releaseMany(b, s.br, claimMany(b, s.br, 1, 1))
		figs[k].idle = stable(p)
		leases := claimMany(b, s.br, idleLeases, 8)
		figs[k].noClient = stable(p)
		for _, c := range leases {
			figs[k].retained += retainedBytes(b, c)
			conn := dialBench(b, c.WSURL)
			// Read so that gorilla answers the gateway's pings; an idle
			// client that never reads would be detached after 45 s.
			go func() {
				for {
					if _, err := conn.Next(); err != nil {
						return
					}
				}
			}()
		}
	}
	for b.Loop() {
		for k, s := range subjects {
			figs[k].withClient = append(figs[k].withClient, stable(s.br.pair()))
		}
	}
	for k, s := range subjects {
		f := figs[k]
		median := func(of func(reading) int64) int64 {
			v := make([]int64, len(f.withClient))
			for i, r := range f.withClient {
				v[i] = of(r)
			}
			return pct(v, 50)
		}
		with := reading{
			resident{anon: median(func(r reading) int64 { return r.gateway.anon }), file: median(func(r reading) int64 { return r.gateway.file })},
			resident{anon: median(func(r reading) int64 { return r.spawnd.anon }), file: median(func(r reading) int64 { return r.spawnd.file })},
		}
		per := func(r reading) (gw, sp float64) {
			return float64(r.gateway.anon-f.idle.gateway.anon-f.retained) / idleLeases, float64(r.spawnd.anon-f.idle.spawnd.anon) / idleLeases
		}
		gwWith, spWith := per(with)
		gwNo, spNo := per(f.noClient)
		idleMiB := float64(f.idle.gateway.total()+f.idle.spawnd.total()) / (1 << 20)
		b.ReportMetric(gwWith+spWith, s.prefix+"bytes/lease")
		b.ReportMetric(gwWith, s.prefix+"gateway-bytes/lease")
		b.ReportMetric(spWith, s.prefix+"spawnd-bytes/lease")
		b.ReportMetric(gwNo+spNo, s.prefix+"noclient-bytes/lease")
		b.ReportMetric(float64(f.retained)/idleLeases, s.prefix+"replay-bytes/lease")
		b.ReportMetric(idleMiB, s.prefix+"idle-pair-MiB")
		b.ReportMetric(float64(f.idle.gateway.total())/(1<<20), s.prefix+"gateway-idle-MiB")
		b.ReportMetric(float64(f.idle.spawnd.total())/(1<<20), s.prefix+"spawnd-idle-MiB")
		b.ReportMetric(float64(with.gateway.file-f.idle.gateway.file)/1024, s.prefix+"gateway-file-KiB")
		b.ReportMetric(float64(with.spawnd.file-f.idle.spawnd.file)/1024, s.prefix+"spawnd-file-KiB")
		verdict(b, s.prefix+"gateway + spawnd memory per idle lease, buffers excluded, ≤ 48 KiB", gwWith+spWith <= 48<<10,
			"%.1f KiB/lease with a client (gateway %.1f + spawnd %.1f), %.1f without (gateway %.1f + spawnd %.1f), over %d leases; %d B of replay buffers subtracted; "+
				"executable pages faulted in meanwhile, not counted: gateway %d KiB, spawnd %d KiB",
			(gwWith+spWith)/1024, gwWith/1024, spWith/1024, (gwNo+spNo)/1024, gwNo/1024, spNo/1024, idleLeases, f.retained,
			(with.gateway.file-f.idle.gateway.file)>>10, (with.spawnd.file-f.idle.spawnd.file)>>10)
		verdict(b, s.prefix+"idle gateway + spawnd ≤ 24 MiB", idleMiB <= 24,
			"%.1f MiB (gateway %.1f + spawnd %.1f)", idleMiB, float64(f.idle.gateway.total())/(1<<20), float64(f.idle.spawnd.total())/(1<<20))
	}
}

// retainedBytes is what an idle lease's replay buffer holds: its ready and
// session-id-report frames as the gateway's stream log encodes them.
func retainedBytes(b *testing.B, c *brokerclient.Claim) int64 {
	b.Helper()
	var n int64
	for i, f := range []brokerframe.Frame{
		{LeaseID: c.LeaseID, Signal: brokerframe.SignalReady},
		{LeaseID: c.LeaseID, Signal: brokerframe.SignalSessionIDReport, SessionID: c.SessionID},
	} {
		f.Seq = uint64(i + 1)
		data, err := brokerframe.Encode(f)
		if err != nil {
			b.Fatal(err)
		}
		n += int64(len(data))
	}
	return n
}

// rssTolerance is how far apart two RSS reads may be and still agree: a
// quarter of a KiB per lease at idleLeases, small against the target.
const rssTolerance = 64 << 10

// resident is a process's resident set: its anonymous pages (RssAnon)
// and those mapped from files (RssFile, here the executable's).
type resident struct{ anon, file int64 }

func (r resident) total() int64 { return r.anon + r.file }

// stableRSS returns pid's resident set once two reads 250 ms apart agree
// within rssTolerance, or the last read after 20 s (logged). Memory
// settling has no event to wait on; the ticker is the sampling interval,
// not a guess at when something finished.
func stableRSS(b *testing.B, pid int) resident {
	b.Helper()
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	deadline := time.Now().Add(20 * time.Second)
	read := func() resident {
		kb := statusKB(b, pid, "RssAnon:", "RssFile:")
		return resident{kb[0] << 10, kb[1] << 10}
	}
	prev := read()
	for {
		<-tick.C
		cur := read()
		if d := cur.total() - prev.total(); -rssTolerance <= d && d <= rssTolerance {
			return cur
		}
		if time.Now().After(deadline) {
			b.Logf("RSS of pid %d still moving after 20 s (%d → %d bytes); using the last read", pid, prev.total(), cur.total())
			return cur
		}
		prev = cur
	}
}

// vmRSS reads a process's resident set size in bytes from /proc.
func vmRSS(b testing.TB, pid int) int64 { return statusKB(b, pid, "VmRSS:")[0] << 10 }

// statusKB reads kB fields of a process's /proc status, in one read.
func statusKB(b testing.TB, pid int, fields ...string) []int64 {
	b.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		b.Fatal(err)
	}
	out := make([]int64, len(fields))
	for i, field := range fields {
		_, rest, ok := bytes.Cut(data, []byte("\n"+field))
		if !ok {
			b.Fatalf("/proc/%d/status has no %s line", pid, field)
		}
		line, _, _ := bytes.Cut(rest, []byte("\n"))
		if out[i], err = strconv.ParseInt(string(bytes.TrimSuffix(bytes.TrimSpace(line), []byte(" kB"))), 10, 64); err != nil {
			b.Fatalf("/proc/%d/status: %s %v", pid, field, err)
		}
	}
	return out
}
