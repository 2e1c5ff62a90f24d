package e2e

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"syscall"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// UpstreamBrokerEnv names the upstream project's own nexus-broker binary
// (the single process this broker's pair replaces, built from its source).
// Benchmarks that compare against it skip without it.
const UpstreamBrokerEnv = "NEXUS_UPSTREAM_BROKER"

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
// when set) and of the upstream nexus-broker ($NEXUS_UPSTREAM_BROKER), same
// client, same nexus-echo, same claim, one sample of each per iteration in
// alternating order, each claim released before the next. The target is a
// ratio ours/upstream of at most 1.0.
func BenchmarkColdClaimVsUpstream(b *testing.B) {
	benchPreflight(b)
	path := os.Getenv(UpstreamBrokerEnv)
	if path == "" {
		b.Skip(UpstreamBrokerEnv + " is not set: it names the upstream nexus-broker binary to compare with")
	}
	const yaml = "idle_timeout: 0s\n"
	type side struct {
		prefix string
		client *brokerclient.Client
	}
	var sides []side
	for _, s := range benchSubjects(b, Options{YAML: yaml}) {
		sides = append(sides, side{s.prefix, s.br.Client})
	}
	sides = append(sides, side{"upstream-", startUpstream(b, path, yaml).Client})
	ctx := context.Background()
	samples := make([][]time.Duration, len(sides))
	sample := func(i int) {
		for k := range sides {
			j := (i + k) % len(sides)
			s := sides[j]
			start := time.Now()
			c, err := s.client.Claim(ctx, brokerclient.ClaimRequest{Config: benchConfig})
			d := time.Since(start)
			if err != nil {
				b.Fatalf("%sclaim: %v", s.prefix, err)
			}
			if c.SessionID == "" {
				b.Fatalf("%sclaim answered no session id", s.prefix)
			}
			samples[j] = append(samples[j], d)
			if err := s.client.Release(ctx, c.LeaseID); err != nil {
				b.Fatalf("%srelease: %v", s.prefix, err)
			}
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
	up := pct(samples[len(sides)-1], 50)
	b.ReportMetric(ms(up), "upstream-p50-ms")
	b.ReportMetric(ms(pct(samples[len(sides)-1], 99)), "upstream-p99-ms")
	for k, s := range sides[:len(sides)-1] {
		p50 := pct(samples[k], 50)
		ratio := float64(p50) / float64(up)
		b.ReportMetric(ms(p50), s.prefix+"p50-ms")
		b.ReportMetric(ms(pct(samples[k], 99)), s.prefix+"p99-ms")
		b.ReportMetric(ratio, s.prefix+"vs-upstream-p50")
		verdict(b, s.prefix+"cold claim p50 ≤ 1.0× the upstream broker's", ratio <= 1.0,
			"p50 %.3f ms against upstream's %.3f ms: %.3f×; %d samples each", ms(p50), ms(up), ratio, len(samples[k]))
	}
}
