package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// paddedEcho is an echo payload made large, so that a flood is mostly bytes.
type paddedEcho struct {
	Type string `json:"type"`
	N    int    `json:"n"`
	Pad  string `json:"pad"`
}

// TestEchoLosesNothingToASlowGateway: a gateway that stops reading (SIGSTOP
// for 2 s in the middle of a flood of echoes) makes nexus-echo wait, not
// evict: every echo arrives, in order, and the instance logs no drop.
func TestEchoLosesNothingToASlowGateway(t *testing.T) {
	const (
		n     = 2000
		pad   = 16 << 10 // 2 000 × 16 KiB: ~32 MiB, far past nexus-echo's 1 MiB outbox
		pause = 2 * time.Second
	)
	b := startBroker(t, Options{})
	conn := b.dial(b.claim(brokerclient.ClaimRequest{}), brokerclient.DialOptions{})
	padding := strings.Repeat("x", pad)
	writeErr := make(chan error, 1)
	// A failure returns with the writer still sending: cut its socket and
	// wait for it before the cleanup closes the connection.
	defer func() { _ = conn.Underlying().UnderlyingConn().Close(); <-writeErr }()
	go func() {
		for i := range n {
			if err := conn.Send(paddedEcho{Type: "echo", N: i, Pad: padding}); err != nil {
				writeErr <- err
				return
			}
		}
		writeErr <- nil
	}()
	_ = conn.Underlying().SetReadDeadline(time.Now().Add(3 * time.Minute))
	var prevSeq uint64
	for i := range n {
		if i == n/4 {
			// The flood is under way. The instance stalls first, so client
			// frames queue up on its socket; then the gateway stops and the
			// instance, running again, has megabytes to echo to a gateway
			// that reads none of them for 2 s.
			pids := b.Instances()
			if len(pids) != 1 {
				t.Fatalf("instances: %v", pids)
			}
			signal(t, pids[0], syscall.SIGSTOP)
			time.Sleep(time.Second) // the fault: an instance that does not run for 1 s
			signal(t, b.gateway.cmd.Process.Pid, syscall.SIGSTOP)
			signal(t, pids[0], syscall.SIGCONT)
			time.Sleep(pause) // the fault: a gateway that does not run for 2 s
			signal(t, b.gateway.cmd.Process.Pid, syscall.SIGCONT)
		}
		f, err := conn.Next()
		if err != nil {
			t.Fatalf("after %d of %d echoes: %v", i, n, err)
		}
		var p paddedEcho
		if err := json.Unmarshal(f.Payload, &p); err != nil || p.Type != "echo" || p.N != i {
			t.Fatalf("echo %d: got n=%d type=%q (%v): echoes %d..%d were lost", i, p.N, p.Type, err, i, p.N-1)
		}
		if prevSeq != 0 && f.Seq != prevSeq+1 {
			t.Fatalf("seq jumped from %d to %d at echo %d", prevSeq, f.Seq, i)
		}
		prevSeq = f.Seq
	}
	logs, _ := filepath.Glob(filepath.Join(b.Tmp, "nexus-spawnd-*", "logs", "*.log"))
	if len(logs) != 1 {
		t.Fatalf("instance logs: %v", logs)
	}
	log, err := os.ReadFile(logs[0])
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(log), "dropped") {
		t.Errorf("nexus-echo logged a drop while connected:\n%s", log)
	}
	m := b.metrics()
	for _, r := range []string{"no_instance", "client_buffer_full"} {
		if v := m[fmt.Sprintf(`nexus_broker_frames_dropped_total{reason=%q}`, r)]; v != 0 {
			t.Errorf("frames_dropped_total{%s} = %v", r, v)
		}
	}
}

func signal(t *testing.T, pid int, sig syscall.Signal) {
	t.Helper()
	if err := syscall.Kill(pid, sig); err != nil {
		t.Fatalf("kill -%d %d: %v", sig, pid, err)
	}
}
