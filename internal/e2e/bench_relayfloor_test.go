package e2e

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// relayFloorRole makes the test binary a minimal WebSocket relay process
// (see runRelayFloor) instead of running tests.
const relayFloorRole = "E2E_RELAY_FLOOR"

// runRelayFloor is the least any relay can do: accept one instance dial-back
// (its handshake is read and dropped) and one client, and copy messages
// between them, one goroutine per direction, without decoding anything. It
// runs as its own process, as the gateway does, so a round trip through it
// pays the same two extra process hops. It prints its address and serves
// until killed.
func runRelayFloor() {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Println(ln.Addr().String())
	instance, client := make(chan *websocket.Conn, 1), make(chan *websocket.Conn, 1)
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
	go func() {
		in, cl := <-instance, <-client
		copyMessages := func(dst, src *websocket.Conn) {
			for {
				_, data, err := src.ReadMessage()
				if err != nil || dst.WriteMessage(websocket.TextMessage, data) != nil {
					os.Exit(0)
				}
			}
		}
		go copyMessages(in, cl)
		copyMessages(cl, in)
	}()
	_ = http.Serve(ln, mux)
}

// startRelayFloor starts the relay process and a nexus-echo dialing it, and
// returns a client connection through it.
func startRelayFloor(b *testing.B) *brokerclient.Conn {
	b.Helper()
	exe, err := os.Executable()
	if err != nil {
		b.Fatal(err)
	}
	relay := exec.Command(exe)
	relay.Env = append(os.Environ(), relayFloorRole+"=1")
	out, err := relay.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := relay.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = relay.Process.Kill(); _ = relay.Wait() })
	addr, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		b.Fatalf("relay floor: %v", err)
	}
	addr = strings.TrimSpace(addr)

	rig := newInstanceRig(b) // for its HOME and config
	echo := exec.Command(bin("nexus-echo"), "-config", rig.config)
	echo.Env = []string{"HOME=" + rig.home, "PATH=" + os.Getenv("PATH"),
		"NEXUS_BROKER_ADDR=ws://" + addr + "/instance", "NEXUS_BROKER_LEASE_ID=floor", "NEXUS_BROKER_SPAWN_SECRET=floor"}
	echo.Dir = rig.home
	echo.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := echo.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = syscall.Kill(-echo.Process.Pid, syscall.SIGKILL); _ = echo.Wait() })
	deadline := time.Now().Add(rttDeadline)
	for {
		conn, err := brokerclient.Dial(b.Context(), "ws://"+addr+"/lease/floor", brokerclient.DialOptions{})
		if err == nil {
			return conn
		}
		if time.Now().After(deadline) {
			b.Fatalf("relay floor: %v", err)
		}
		time.Sleep(10 * time.Millisecond) // the relay's listener is up; polling with a deadline
	}
}
