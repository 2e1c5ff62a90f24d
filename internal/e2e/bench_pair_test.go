package e2e

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"
)

// BaseBinEnv names a directory holding another build's nexus-broker and
// nexus-spawnd (the commit a change started from, say). When it is set the
// benchmarks run that pair too, beside this build's, with the same client,
// the same nexus-echo and the same baselines, and report its figures with
// a "base-" prefix: before and after then come from one run on one machine
// under one load.
const BaseBinEnv = "NEXUS_BENCH_BASE_BIN"

// subject is one broker a benchmark measures: this build's ("") or the
// base build's ("base-", the prefix of its metrics).
type subject struct {
	prefix string
	br     *Broker
}

// benchSubjects starts this build's broker with o and, when BaseBinEnv is
// set, the base build's with the same options.
func benchSubjects(b *testing.B, o Options) []subject {
	b.Helper()
	subjects := []subject{{"", startBroker(b, o)}}
	if dir := os.Getenv(BaseBinEnv); dir != "" {
		o.BinDir = dir
		subjects = append(subjects, subject{"base-", startBroker(b, o)})
	}
	return subjects
}

// pair is the broker's two processes, read together: every figure about
// the broker counts the gateway and spawnd.
type pair struct{ gateway, spawnd int }

func (br *Broker) pair() pair {
	return pair{br.gateway.cmd.Process.Pid, br.spawnd.cmd.Process.Pid}
}

// cpuSample is the CPU time (user + system) each process has used so far.
type cpuSample struct{ gateway, spawnd time.Duration }

func (p pair) cpu(b testing.TB) cpuSample {
	return cpuSample{procCPU(b, p.gateway), procCPU(b, p.spawnd)}
}

// since is the CPU used between s0 and s.
func (s cpuSample) since(s0 cpuSample) cpuSample {
	return cpuSample{s.gateway - s0.gateway, s.spawnd - s0.spawnd}
}

// report records s over n events (frames, claims) as µs per event, for
// each process and for both together.
func (s cpuSample) report(b *testing.B, prefix, per string, n int) {
	if n == 0 {
		return
	}
	us := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) / float64(n) }
	b.ReportMetric(us(s.gateway), prefix+"gateway-cpu-us/"+per)
	b.ReportMetric(us(s.spawnd), prefix+"spawnd-cpu-us/"+per)
	b.ReportMetric(us(s.gateway+s.spawnd), prefix+"broker-cpu-us/"+per)
}

// clockTick is the unit of /proc/<pid>/stat's utime and stime (USER_HZ,
// 100 on every Linux ABI). The kernel derives both from the precise run
// time, so a sum over many events is exact to one tick.
const clockTick = 10 * time.Millisecond

// procCPU reads a process's user + system time, every thread's, including
// threads that have exited, from /proc/<pid>/stat.
func procCPU(b testing.TB, pid int) time.Duration {
	b.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		b.Fatal(err)
	}
	// Fields after the command name, which may hold spaces: state is the
	// first, utime the 12th and stime the 13th.
	i := bytes.LastIndexByte(data, ')')
	f := bytes.Fields(data[i+1:])
	if len(f) < 13 {
		b.Fatalf("/proc/%d/stat: too few fields", pid)
	}
	var ticks int64
	for _, s := range f[11:13] {
		n, err := strconv.ParseInt(string(s), 10, 64)
		if err != nil {
			b.Fatalf("/proc/%d/stat: %v", pid, err)
		}
		ticks += n
	}
	return time.Duration(ticks) * clockTick
}
