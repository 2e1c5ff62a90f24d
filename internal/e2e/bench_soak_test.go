package e2e

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// The soak: soakLeases leases, each with a client streaming soakRate echo
// frames a second for soakDuration. It passes on no frame lost and a flat
// RSS (growth within soakRSSSlack over the run, after the first
// soakWarmup).
const (
	soakLeases   = 200
	soakRate     = 50
	soakDuration = 60 * time.Second
	soakWarmup   = 30 * time.Second
	soakSample   = 5 * time.Second // how often RSS is read after the warm-up
	soakRSSSlack = 4 << 20
	// soakDrain bounds the wait for the last echoes after sending stops.
	soakDrain = 30 * time.Second
)

// BenchmarkSoak runs the soak once per broker (this build's, then the base
// build's when one is named) and reports relay latency (send to echo, at
// the client), CPU of the gateway, spawnd, the instances and the load
// generator (this process), how busy the machine was, and the broker's RSS
// growth. On 2 cores the generator and the instances compete with the
// broker, so the saturation figure says how far the latency is the
// machine's. Each lease's replay buffer (client_replay_buffer_bytes) is
// bounded at soakReplayBytes, which it reaches well within soakWarmup (at
// even half the rate), so the growth measured is not the buffers filling as
// designed.
func BenchmarkSoak(b *testing.B) {
	benchPreflight(b)
	subjects := benchSubjects(b, Options{YAML: fmt.Sprintf("max_concurrent: 0\nidle_timeout: 0s\nclient_replay_buffer_bytes: %d\n", soakReplayBytes)})
	for b.Loop() {
		for _, s := range subjects {
			soak(b, s)
		}
	}
}

// soakReplayBytes bounds each lease's replay buffer in the soak: about 13 s
// of its stream.
const soakReplayBytes = 64 << 10

func soak(b *testing.B, s subject) {
	br := s.br
	leases := claimMany(b, br, soakLeases, 8)
	defer releaseMany(b, br, leases)
	conns := make([]*brokerclient.Conn, len(leases))
	for i, c := range leases {
		conns[i] = dialBench(b, c.WSURL)
		defer conns[i].Close()
	}
	p := br.pair()
	instances := br.Instances()
	cpu0, inst0, self0, mach0 := p.cpu(b), pidsCPU(b, instances), procCPU(b, os.Getpid()), machineCPU(b)
	var (
		mu        sync.Mutex
		latencies []time.Duration
		readErrs  = map[string]int{} // why a client stopped reading early
		sent      atomic.Int64
		received  atomic.Int64
		rss       []int64 // gateway + spawnd, every soakSample after soakWarmup
		wg        sync.WaitGroup
	)
	start := time.Now()
	stopSending := start.Add(soakDuration)
	for _, c := range conns {
		wg.Add(2)
		frames := int(soakDuration/time.Second) * soakRate
		stamps := make([]atomic.Int64, frames)
		_ = c.Underlying().SetReadDeadline(stopSending.Add(soakDrain))
		_ = c.Underlying().SetWriteDeadline(stopSending.Add(soakDrain))
		var last, got atomic.Int64 // frames this client sent, and got back
		sentAll := make(chan struct{})
		go func() {
			defer wg.Done()
			defer func() {
				close(sentAll)
				// A reader that already has every echo is waiting for a
				// frame that will never come: wake it.
				if got.Load() == last.Load() {
					_ = c.Underlying().SetReadDeadline(time.Now())
				}
			}()
			tick := time.NewTicker(time.Second / soakRate)
			defer tick.Stop()
			for n := 0; n < frames; n++ {
				if <-tick.C; !time.Now().Before(stopSending) {
					return
				}
				stamps[n].Store(time.Now().UnixNano())
				if err := c.Send(benchEcho{Type: "echo", N: n}); err != nil {
					return
				}
				sent.Add(1)
				last.Add(1)
			}
		}()
		go func() {
			defer wg.Done()
			mine := make([]time.Duration, 0, frames)
			var why string
			for n := 0; n < frames; n++ {
				f, err := c.Next()
				if err == nil {
					err = checkEcho(f.Payload, n)
				}
				if err != nil {
					select {
					case <-sentAll:
						if int64(n) == last.Load() {
							break // every frame this client sent is back
						}
						why = err.Error()
					default:
						why = err.Error()
					}
					break
				}
				mine = append(mine, time.Duration(time.Now().UnixNano()-stamps[n].Load()))
				received.Add(1)
				got.Add(1)
				select {
				case <-sentAll:
					if int64(n+1) == last.Load() {
						n = frames // every frame this client sent is back
					}
				default:
				}
			}
			mu.Lock()
			latencies = append(latencies, mine...)
			if why != "" {
				readErrs[why]++
			}
			mu.Unlock()
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	tick := time.NewTicker(soakSample)
wait:
	for {
		select {
		case <-tick.C:
			if time.Since(start) >= soakWarmup {
				rss = append(rss, vmRSS(b, p.gateway)+vmRSS(b, p.spawnd))
			}
		case <-done:
			break wait
		}
	}
	tick.Stop()
	elapsed := time.Since(start)
	cpu := p.cpu(b).since(cpu0)
	inst := pidsCPU(b, instances) - inst0
	self := procCPU(b, os.Getpid()) - self0
	busy, total := machineCPU(b).since(mach0)

	lost := sent.Load() - received.Load()
	var growth int64
	if len(rss) >= 2 {
		growth = rss[len(rss)-1] - rss[0]
	}
	perSec := func(d time.Duration) float64 { return d.Seconds() / elapsed.Seconds() }
	pre := s.prefix
	b.ReportMetric(ms(pct(latencies, 50)), pre+"p50-ms")
	b.ReportMetric(ms(pct(latencies, 99)), pre+"p99-ms")
	b.ReportMetric(float64(lost), pre+"lost-frames")
	b.ReportMetric(float64(growth)/(1<<20), pre+"rss-growth-MiB")
	b.ReportMetric(perSec(cpu.gateway), pre+"gateway-cpu-cores")
	b.ReportMetric(perSec(cpu.spawnd), pre+"spawnd-cpu-cores")
	b.ReportMetric(perSec(inst), pre+"instances-cpu-cores")
	b.ReportMetric(perSec(self), pre+"generator-cpu-cores")
	b.ReportMetric(busy/total, pre+"machine-busy")
	b.Logf("%ssoak: %d leases × %d frames/s for %s: %d sent, %d echoed; relay p50 %.2f ms, p99 %.2f ms; CPU in cores: gateway %.2f, spawnd %.3f, instances %.2f, generator %.2f; machine %.0f%% busy; broker RSS %v (MiB every %s after the warm-up), growth %.2f MiB; clients that stopped early, by reason: %v",
		pre, soakLeases, soakRate, soakDuration, sent.Load(), received.Load(), ms(pct(latencies, 50)), ms(pct(latencies, 99)),
		perSec(cpu.gateway), perSec(cpu.spawnd), perSec(inst), perSec(self), 100*busy/total, mibs(rss), soakSample, float64(growth)/(1<<20), readErrs)
	verdict(b, pre+"soak loses no frame and keeps RSS flat", lost == 0 && growth <= soakRSSSlack,
		"%d lost; RSS growth %.2f MiB, at most %d MiB allowed", lost, float64(growth)/(1<<20), soakRSSSlack>>20)
}

func mibs(v []int64) []string {
	out := make([]string, len(v))
	for i, x := range v {
		out[i] = fmt.Sprintf("%.1f", float64(x)/(1<<20))
	}
	return out
}

// pidsCPU is the CPU time the processes have used so far together.
func pidsCPU(b *testing.B, pids []int) time.Duration {
	var sum time.Duration
	for _, pid := range pids {
		sum += procCPU(b, pid)
	}
	return sum
}

// machineTicks is /proc/stat's first line: all CPUs' time, and how much of
// it was busy (neither idle nor waiting for I/O).
type machineTicks struct{ busy, total float64 }

func (m machineTicks) since(m0 machineTicks) (busy, total float64) {
	return m.busy - m0.busy, m.total - m0.total
}

func machineCPU(b *testing.B) machineTicks {
	b.Helper()
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		b.Fatal(err)
	}
	line, _, _ := bytes.Cut(data, []byte("\n"))
	f := bytes.Fields(line)
	var m machineTicks
	for i, s := range f[1:] {
		v, err := strconv.ParseFloat(string(s), 64)
		if err != nil {
			b.Fatalf("/proc/stat: %v", err)
		}
		if i >= 8 { // guest time is already in user
			break
		}
		m.total += v
		if i != 3 && i != 4 { // idle, iowait
			m.busy += v
		}
	}
	return m
}
