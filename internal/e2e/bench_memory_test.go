package e2e

import (
	"bufio"
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

// BenchmarkIdleLeaseMemory reports what one idle lease, with its client
// connected, costs the gateway process.
//
// Method. The gateway has no pprof endpoint, so the measure is its resident
// set (VmRSS): read once with no lease, again with idleLeases leases open,
// each read taken only once two reads 250 ms apart agree (within
// rssTolerance), because a Go process's RSS drifts for a while after a
// burst as the collector and scavenger catch up. The difference over
// idleLeases is the cost per lease. RSS counts only touched pages, so
// memory a lease allocates but never touches (the unused tails of its
// sockets' I/O buffers) is not in it; it does include garbage the
// collector has not yet returned, which is why a second figure, the slope
// between idleLeases/2 and idleLeases leases, is reported too: it cancels
// whatever the first claims cost once (heap growth, connection pools).
//
// "Buffers excluded": an idle lease's replay buffer holds just the two
// frames its instance sent on registering (ready and session-id-report,
// seq 1 and 2), re-encoded with the lease id. Those bytes, computed
// exactly as the gateway encodes them, are subtracted. (They are about
// 200 bytes a lease: the subtraction is for honesty, not effect.)
//
// Each iteration of the loop is one more stable reading at idleLeases; the
// median is reported. spawnd's growth is reported beside it for scale.
func BenchmarkIdleLeaseMemory(b *testing.B) {
	benchPreflight(b)
	br := startBroker(b, Options{YAML: "max_concurrent: 0\nidle_timeout: 0s\n"})
	gw, sp := br.gateway.cmd.Process.Pid, br.spawnd.cmd.Process.Pid
	// A warm-up claim so that one-time costs (the spawnd connection, the
	// HTTP server's first goroutines) are in the baseline, not in the leases.
	releaseMany(b, br, claimMany(b, br, 1, 1))
	gw0, sp0 := stableRSS(b, gw), stableRSS(b, sp)

	open := func(n int) []*brokerclient.Claim {
		leases := claimMany(b, br, n, 8)
		for _, c := range leases {
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
		return leases
	}
	leases := open(idleLeases / 2)
	gwHalf := stableRSS(b, gw)
	leases = append(leases, open(idleLeases-idleLeases/2)...)

	var retained int64
	for _, c := range leases {
		retained += retainedBytes(b, c)
	}
	var readings []int64
	for b.Loop() {
		readings = append(readings, stableRSS(b, gw))
	}
	gwK := pct(readings, 50)
	spK := stableRSS(b, sp)

	perLease := float64(gwK-gw0-retained) / idleLeases
	slope := float64(gwK-gwHalf) / float64(idleLeases-idleLeases/2)
	b.ReportMetric(perLease, "bytes/lease")
	b.ReportMetric(slope, "marginal-bytes/lease")
	b.ReportMetric(float64(retained)/idleLeases, "replay-bytes/lease")
	b.ReportMetric(float64(spK-sp0)/idleLeases, "spawnd-bytes/lease")
	b.ReportMetric(float64(gw0)/(1<<20), "gateway-rss-0-MiB")
	b.ReportMetric(float64(gwK)/(1<<20), "gateway-rss-K-MiB")
	verdict(b, "gateway memory per idle lease, buffers excluded, ≤ 64 KiB", perLease <= 64<<10,
		"%.1f KiB/lease over %d leases (RSS %.1f → %.1f MiB, %d B of replay buffers subtracted); marginal %.1f KiB/lease between %d and %d leases; spawnd %.1f KiB/lease",
		perLease/1024, idleLeases, float64(gw0)/(1<<20), float64(gwK)/(1<<20), retained, slope/1024, idleLeases/2, idleLeases, float64(spK-sp0)/idleLeases/1024)
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

// stableRSS returns pid's VmRSS once two reads 250 ms apart agree within
// rssTolerance, or the last read after 20 s (logged). Memory settling has
// no event to wait on; the ticker is the sampling interval, not a guess at
// when something finished.
func stableRSS(b *testing.B, pid int) int64 {
	b.Helper()
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	deadline := time.Now().Add(20 * time.Second)
	prev := vmRSS(b, pid)
	for {
		<-tick.C
		cur := vmRSS(b, pid)
		if d := cur - prev; -rssTolerance <= d && d <= rssTolerance {
			return cur
		}
		if time.Now().After(deadline) {
			b.Logf("RSS of pid %d still moving after 20 s (%d → %d bytes); using the last read", pid, prev, cur)
			return cur
		}
		prev = cur
	}
}

// vmRSS reads a process's resident set size in bytes from /proc.
func vmRSS(b testing.TB, pid int) int64 {
	b.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		b.Fatal(err)
	}
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		if rest, ok := bytes.CutPrefix(sc.Bytes(), []byte("VmRSS:")); ok {
			kb, err := strconv.ParseInt(string(bytes.TrimSuffix(bytes.TrimSpace(rest), []byte(" kB"))), 10, 64)
			if err != nil {
				b.Fatalf("/proc/%d/status: VmRSS: %v", pid, err)
			}
			return kb << 10
		}
	}
	b.Fatalf("/proc/%d/status has no VmRSS line", pid)
	return 0
}
