package e2e

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gorilla/websocket"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// relayFloorRole makes the test binary a minimal WebSocket relay process
// (see runRelayFloor) instead of running tests.
const relayFloorRole = "E2E_RELAY_FLOOR"

// runRelayFloor is the least any relay can do: accept instance dial-backs
// (each handshake read and dropped) and clients, pair them in the order
// they come (every instance is an echo, so any pairing will do), and copy
// messages within each pair, one goroutine per direction, without decoding
// anything. It runs as its own process, as the gateway does, so a round
// trip through it pays the same two extra process hops. It prints its
// address and serves until killed.
func runRelayFloor() {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Println(ln.Addr().String())
	instance, client := make(chan *websocket.Conn), make(chan *websocket.Conn)
	up := websocket.Upgrader{}
	mux := http.NewServeMux()
	mux.HandleFunc("/instance", func(w http.ResponseWriter, r *http.Request) {
		ws, err := up.Upgrade(w, r, nil)
		if err != nil {
			return
		}
		for i := 0; i < 3; i++ { // register, ready, session-id-report
			if _, _, err := ws.ReadMessage(); err != nil {
				return
			}
		}
		instance <- ws
	})
	mux.HandleFunc("/lease/floor", func(w http.ResponseWriter, r *http.Request) {
		ws, err := up.Upgrade(w, r, nil)
		if err != nil {
			return
		}
		client <- ws
	})
	copyMessages := func(dst, src *websocket.Conn) {
		for {
			_, data, err := src.ReadMessage()
			if err != nil || dst.WriteMessage(websocket.TextMessage, data) != nil {
				os.Exit(0)
			}
		}
	}
	go func() {
		for {
			in, cl := <-instance, <-client
			go copyMessages(in, cl)
			go copyMessages(cl, in)
		}
	}()
	_ = http.Serve(ln, mux)
}

// startRelayFloor starts the relay process and n nexus-echo instances
// dialing it, and returns n client connections through it.
func startRelayFloor(b *testing.B, n int) []*brokerclient.Conn {
	b.Helper()
	addr := startRole(b, relayFloorRole, "1")

	rig := newInstanceRig(b) // for its HOME and config
	conns := make([]*brokerclient.Conn, n)
	for i := range conns {
		echo := exec.Command(bin("nexus-echo"), "-config", rig.config)
		echo.Env = []string{"HOME=" + rig.home, "PATH=" + os.Getenv("PATH"),
			"NEXUS_BROKER_ADDR=ws://" + addr + "/instance", "NEXUS_BROKER_LEASE_ID=floor", "NEXUS_BROKER_SPAWN_SECRET=floor"}
		echo.Dir = rig.home
		echo.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		if err := echo.Start(); err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = syscall.Kill(-echo.Process.Pid, syscall.SIGKILL); _ = echo.Wait() })
		conns[i] = dialBench(b, "ws://"+addr+"/lease/floor")
	}
	return conns
}

// rpcFloorRole makes the test binary a gRPC server of nothing but the
// health check, on the unix socket its value names, scheduled as spawnd is
// (one processor): the least any RPC to spawnd can cost (see rpcFloor).
const rpcFloorRole = "E2E_RPC_FLOOR"

func runRPCFloor(path string) {
	runtime.GOMAXPROCS(1)
	ln, err := net.Listen("unix", path)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Println("serving")
	srv := grpc.NewServer()
	healthpb.RegisterHealthServer(srv, health.NewServer())
	_ = srv.Serve(ln)
}

// rpcFloor is a client of that server in its own process: a claim through
// the split pays at least two such round trips over the exec floor (Spawn
// and Record), both after the socket idled.
type rpcFloor struct{ health healthpb.HealthClient }

func startRPCFloor(b *testing.B) *rpcFloor {
	b.Helper()
	path := filepath.Join(b.TempDir(), "rpc.sock")
	startRole(b, rpcFloorRole, path)
	cc, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = cc.Close() })
	f := &rpcFloor{healthpb.NewHealthClient(cc)}
	f.roundTrip(b) // connects
	return f
}

// roundTrip times one health check.
func (f *rpcFloor) roundTrip(b *testing.B) time.Duration {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), rttDeadline)
	defer cancel()
	start := time.Now()
	if _, err := f.health.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
		b.Fatalf("rpc floor: %v", err)
	}
	return time.Since(start)
}

// startRole runs this test binary as a helper process in role (the env var
// TestMain dispatches on, set to value), killed at cleanup, and returns the
// first line it prints, which it prints once it serves.
func startRole(b *testing.B, role, value string) string {
	b.Helper()
	exe, err := os.Executable()
	if err != nil {
		b.Fatal(err)
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), role+"="+value)
	out, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		b.Fatalf("%s: %v", role, err)
	}
	return strings.TrimSpace(line)
}
