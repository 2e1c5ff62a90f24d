// Package clusterdemo is `make cluster`: an embedded nats-server and three
// brokers on loopback, each with its own nexus-spawnd and state_dir, in
// cluster mode. It prints each broker's base URL and what to try, and on
// Ctrl-C releases every lease and stops all of it.
//
// It runs the built binaries rather than linking them: of the project it
// imports only pkg/spawnrpc (to find each spawnd).
package clusterdemo

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"syscall"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"

	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc"
)

// Names are the demo's broker ids.
var Names = []string{"a", "b", "c"}

const secretEnv = "NEXUS_CLUSTER_SECRET"

var listening = regexp.MustCompile(`msg="nexus-broker listening" addr=(\S+)`)

type broker struct {
	name, config, runDir, base string
	cmd                        *exec.Cmd
}

// Run starts the demo with the binaries in binDir and serves until ctx
// ends; out gets the lines a user reads (each broker logs to broker.log in
// its directory).
func Run(ctx context.Context, binDir string, out io.Writer) error {
	// Under /tmp, not $TMPDIR: spawnd's socket path must stay short.
	dir, err := os.MkdirTemp("/tmp", "nexus-cluster-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	ns, err := natsserver.NewServer(&natsserver.Options{Host: "127.0.0.1", Port: -1, NoLog: true, NoSigs: true})
	if err != nil {
		return err
	}
	go ns.Start()
	if !ns.ReadyForConnections(10 * time.Second) {
		return fmt.Errorf("the embedded nats-server did not start")
	}
	defer ns.Shutdown()
	var key [32]byte
	_, _ = rand.Read(key[:])
	env := append(os.Environ(), secretEnv+"="+hex.EncodeToString(key[:]))

	var bs []*broker
	defer func() { stopAll(binDir, bs, env) }()
	for _, name := range Names {
		b, err := start(binDir, filepath.Join(dir, name), name, ns.ClientURL(), env)
		if b != nil {
			bs = append(bs, b)
		}
		if err != nil {
			return err
		}
	}
	fmt.Fprintf(out, "nats: %s\n", ns.ClientURL())
	for _, b := range bs {
		fmt.Fprintf(out, "broker %s: %s\n", b.name, b.base)
	}
	a, b, c := bs[0].base, bs[1].base, bs[2].base
	fmt.Fprintf(out, `
# claim on a, then use the lease through any broker
lease=$(curl -s -X POST %[1]s/claim -d '{"config":"engine:\n  name: example\n"}' | jq -r .lease_id)
bin/nexus-client -ws ws://%[4]s/lease/$lease      # the WebSocket through b
curl -s %[3]s/leases                                # every broker's leases, from c
curl -s -X POST %[3]s/release/$lease                # released through c
# Ctrl-C releases every lease and stops the brokers and nats-server
`, a, b, c, b[len("http://"):])
	<-ctx.Done()
	fmt.Fprintln(out, "releasing every lease and stopping")
	return nil
}

// start writes broker name's config under dir and starts its gateway,
// which launches its own spawnd, and waits until it listens.
func start(binDir, dir, name, natsURL string, env []string) (*broker, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	b := &broker{name: name, config: filepath.Join(dir, "broker.yaml"), runDir: filepath.Join(dir, "run")}
	yaml := fmt.Sprintf("listen_addr: \"127.0.0.1:%d\"\nadvertise_addr: \"127.0.0.1:%d\"\nbroker_id: %s\nstate_dir: %q\nspawnd:\n  run_dir: %q\nbinaries:\n  nexus:\n    path: %q\ncluster:\n  urls: %s\n  secret_env: %s\n",
		port, port, name, filepath.Join(dir, "state"), b.runDir, filepath.Join(binDir, "nexus-echo"), natsURL, secretEnv)
	if err := os.WriteFile(b.config, []byte(yaml), 0o600); err != nil {
		return nil, err
	}
	logf, err := os.Create(filepath.Join(dir, "broker.log"))
	if err != nil {
		return nil, err
	}
	pr, pw := io.Pipe()
	b.cmd = exec.Command(filepath.Join(binDir, "nexus-broker"), "-config", b.config)
	b.cmd.Env = env
	b.cmd.Stdout, b.cmd.Stderr = io.MultiWriter(logf, pw), io.MultiWriter(logf, pw)
	if err := b.cmd.Start(); err != nil {
		return nil, err
	}
	found := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			if m := listening.FindStringSubmatch(sc.Text()); m != nil {
				found <- m[1]
				break
			}
		}
		_, _ = io.Copy(io.Discard, pr)
	}()
	select {
	case addr := <-found:
		b.base = "http://" + addr
		return b, nil
	case <-time.After(30 * time.Second):
		return b, fmt.Errorf("broker %s did not start listening; see %s", name, logf.Name())
	}
}

// stopAll releases every lease of each broker's spawnd (nexus-broker
// -stop), stops the gateways, then the spawnds.
func stopAll(binDir string, bs []*broker, env []string) {
	for _, b := range bs {
		stop := exec.Command(filepath.Join(binDir, "nexus-broker"), "-stop", "-config", b.config)
		stop.Env = env
		_ = stop.Run()
	}
	for _, b := range bs {
		_ = b.cmd.Process.Signal(syscall.SIGTERM)
		_ = b.cmd.Wait()
		if ep, err := spawnrpc.ReadEndpoint(b.runDir); err == nil {
			_ = syscall.Kill(ep.Pid, syscall.SIGTERM)
		}
	}
}
