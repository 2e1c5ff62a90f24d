package e2e

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// UpstreamBrokerEnv names the upstream project's own nexus-broker binary
// (the single process this broker's pair replaces, built from its source).
const UpstreamBrokerEnv = "NEXUS_UPSTREAM_BROKER"

// UpstreamSrcEnv names a checkout of the upstream project's source, from
// which the benchmarks and tests build what UpstreamBrokerEnv and
// stockNexusEnv would name when those are not set.
const UpstreamSrcEnv = "NEXUS_UPSTREAM_SRC"

// upstreamBuilds memoizes upstreamBinary's builds, by package.
var upstreamBuilds sync.Map // string → *upstreamBuild

type upstreamBuild struct {
	once sync.Once
	path string
	err  error
}

// upstreamBinary is one of the upstream project's binaries: the path env
// names, else pkg (./cmd/nexus-broker, ./cmd/nexus) built once per run from
// the checkout UpstreamSrcEnv names, into the run's binaries directory; ""
// when neither is set. A build that fails fails tb, with go's output.
func upstreamBinary(tb testing.TB, env, pkg string) string {
	tb.Helper()
	if path := os.Getenv(env); path != "" {
		return path
	}
	src := os.Getenv(UpstreamSrcEnv)
	if src == "" {
		return ""
	}
	v, _ := upstreamBuilds.LoadOrStore(pkg, &upstreamBuild{})
	u := v.(*upstreamBuild)
	u.once.Do(func() {
		u.path = filepath.Join(binDir, "upstream-"+filepath.Base(pkg))
		cmd := exec.Command("go", "build", "-o", u.path, pkg)
		cmd.Dir = src
		if out, err := cmd.CombinedOutput(); err != nil {
			u.err = fmt.Errorf("building %s from %s=%s: %v\n%s", pkg, UpstreamSrcEnv, src, err, out)
		}
	})
	if u.err != nil {
		tb.Fatal(u.err)
	}
	return u.path
}

// upstreamBroker is a running upstream nexus-broker, configured as the
// harness configures ours: loopback, nexus-echo as the nexus entry, no
// state_dir, its temp configs on the same tmpfs.
type upstreamBroker struct {
	Client *brokerclient.Client
	home   string
}

// startUpstream starts the upstream broker at path with yaml added to its
// config, and waits until it answers /healthz.
func startUpstream(b *testing.B, path, yaml string) *upstreamBroker {
	b.Helper()
	dir := b.TempDir()
	u := &upstreamBroker{home: filepath.Join(dir, "home")}
	if err := os.MkdirAll(u.home, 0o755); err != nil {
		b.Fatal(err)
	}
	// Upstream listens on listen_addr as written and hands it to its
	// instances, so the port is picked here.
	addr := fmt.Sprintf("127.0.0.1:%d", freePort(b))
	config := filepath.Join(dir, "broker.yaml")
	cfg := fmt.Sprintf("listen_addr: %q\nbinaries:\n  nexus:\n    path: %q\n", addr, bin("nexus-echo")) + yaml
	if err := os.WriteFile(config, []byte(cfg), 0o600); err != nil {
		b.Fatal(err)
	}
	log := newLogBuffer()
	cmd := exec.Command(path, "-config", config)
	cmd.Env = []string{"HOME=" + u.home, "PATH=" + os.Getenv("PATH"), "LANG=C.UTF-8", "TZ=UTC", "TMPDIR=" + privateTmp(b)}
	cmd.Stdout, cmd.Stderr = log, log
	p := startProc(b, cmd)
	b.Cleanup(func() {
		p.signal(syscall.SIGKILL)
		killGroupsOf(processesOf(bin("nexus-echo"), u.home))
		if b.Failed() {
			b.Logf("upstream broker's log:\n%s", log)
		}
	})
	log.wait(b, regexp.MustCompile(`msg="http gateway listening"`), 30*time.Second)
	eventually(b, 10*time.Second, func() string { return "upstream broker answering /healthz: " + log.String() }, func() bool {
		resp, err := http.Get("http://" + addr + "/healthz")
		if err == nil {
			resp.Body.Close()
		}
		return err == nil && resp.StatusCode == http.StatusOK
	})
	u.Client = &brokerclient.Client{Base: "http://" + addr, HTTP: unchecked} // as the broker's in a benchmark
	return u
}

// BenchmarkColdClaimVsUpstream is issue 28's cold claim beside the upstream
// broker's: claim p50 of this build's pair (and of NEXUS_BENCH_BASE_BIN's,
// when set), of the upstream nexus-broker (upstreamBinary: named by
// $NEXUS_UPSTREAM_BROKER, or built from $NEXUS_UPSTREAM_SRC) and of the
// floor (the same nexus-echo exec'd by the benchmark itself, timed until
// its session-id-report reaches a bare listener: what every broker's claim
// must pay, with no broker in it), same client, same nexus-echo, same
// claim, one sample of each per iteration in rotating order, each claim
// released before the next. The target is a ratio ours/upstream of at most
// 1.0. Beside it: this build and upstream each with a state_dir
// ("durable-"), and each broker's ratio to the floor, which is all there
// is without an upstream broker.
func BenchmarkColdClaimVsUpstream(b *testing.B) {
	benchPreflight(b)
	const yaml = "idle_timeout: 0s\n"
	type side struct {
		prefix string
		take   func() time.Duration
	}
	ctx := context.Background()
	claimer := func(prefix string, client *brokerclient.Client) side {
		return side{prefix, func() time.Duration {
			start := time.Now()
			c, err := client.Claim(ctx, brokerclient.ClaimRequest{Config: benchConfig})
			d := time.Since(start)
			if err != nil {
				b.Fatalf("%sclaim: %v", prefix, err)
			}
			if c.SessionID == "" {
				b.Fatalf("%sclaim answered no session id", prefix)
			}
			if err := client.Release(ctx, c.LeaseID); err != nil {
				b.Fatalf("%srelease: %v", prefix, err)
			}
			return d
		}}
	}
	var sides []side
	for _, s := range benchSubjects(b, Options{YAML: yaml}) {
		sides = append(sides, claimer(s.prefix, s.br.Client))
	}
	brokers := len(sides)
	durable := len(sides)
	// This build with state_dir on the benchmark's disk, as make run's
	// defaults and production run it, whose claim waits for its journal's
	// fsyncs (docs/architecture.md, "A session id answered ahead"), beside
	// upstream with a state_dir of its own there, which fsyncs its journal
	// too: reported, not held to the target.
	sides = append(sides, claimer("durable-", startBroker(b, Options{YAML: yaml, StateDir: true}).Client))
	up, durableUp := -1, -1
	if path := upstreamBinary(b, UpstreamBrokerEnv, "./cmd/nexus-broker"); path != "" {
		up, durableUp = len(sides), len(sides)+1
		sides = append(sides, claimer("upstream-", startUpstream(b, path, yaml).Client),
			claimer("durable-upstream-", startUpstream(b, path, yaml+fmt.Sprintf("state_dir: %q\n", filepath.Join(b.TempDir(), "state"))).Client))
	} else {
		b.Logf("neither %s nor %s is set: no upstream broker to compare with, only the floor", UpstreamBrokerEnv, UpstreamSrcEnv)
	}
	rig := newInstanceRig(b)
	floors := 0
	sides = append(sides, side{"floor-", func() time.Duration {
		floors++
		inst := rig.spawn(b, fmt.Sprintf("floor-%d", floors))
		d := inst.await(b).Sub(inst.started)
		inst.stop(b)
		return d
	}})
	samples := make([][]time.Duration, len(sides))
	sample := func(i int) {
		for k := range sides {
			j := (i + k) % len(sides)
			samples[j] = append(samples[j], sides[j].take())
		}
	}
	// Each side's first claim dials and warms what later ones find warm.
	sample(0)
	for k := range samples {
		samples[k] = samples[k][:0]
	}
	for i := 0; b.Loop(); i++ {
		sample(i)
	}
	p50 := make([]time.Duration, len(sides))
	for k, s := range sides {
		p50[k] = pct(samples[k], 50)
		b.ReportMetric(ms(p50[k]), s.prefix+"p50-ms")
		b.ReportMetric(ms(pct(samples[k], 99)), s.prefix+"p99-ms")
	}
	floor := p50[len(sides)-1]
	for k, s := range sides[:len(sides)-1] {
		b.ReportMetric(float64(p50[k])/float64(floor), s.prefix+"vs-floor-p50")
	}
	if up < 0 {
		return
	}
	ratio := float64(p50[durable]) / float64(p50[durableUp])
	b.ReportMetric(ratio, "durable-vs-durable-upstream-p50")
	b.Logf("with state_dir, both: p50 %.3f ms against upstream's %.3f ms: %.3f× (not held to the target)", ms(p50[durable]), ms(p50[durableUp]), ratio)
	for k, s := range sides[:brokers] {
		ratio := float64(p50[k]) / float64(p50[up])
		b.ReportMetric(ratio, s.prefix+"vs-upstream-p50")
		verdict(b, s.prefix+"cold claim p50 ≤ 1.0× the upstream broker's", ratio <= 1.0,
			"p50 %.3f ms against upstream's %.3f ms: %.3f×; above the floor's %.3f ms, %.3f ms against upstream's %.3f ms; %d samples each",
			ms(p50[k]), ms(p50[up]), ratio, ms(floor), ms(p50[k]-floor), ms(p50[up]-floor), len(samples[k]))
	}
}
