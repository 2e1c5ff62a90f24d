package spawnrpc

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-plugin"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/nexus-broker/nexus-broker/internal/safedir"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// ServeOptions configures Serve.
type ServeOptions struct {
	// RunDir receives the socket and spawnd.json; the caller holds its
	// ClaimRunDir lock.
	RunDir string
	// AllowedUID is the only peer uid accepted (spawnd.gateway_uid).
	AllowedUID int
	// SocketGID, when >= 0, becomes the group of the socket and
	// spawnd.json, so the gateway's user can reach them.
	SocketGID int
	Impl      Verbs
	// SpawnThread, when set, prepares the thread of each Spawn lane before
	// its first call (spawnd sets no_new_privs there).
	SpawnThread func() error
	Logger      *slog.Logger
	// Booted, when set, runs once spawnd.json is published, and again when
	// the first gateway opens its exit stream (Watch), the last step of its
	// attach but for a List: both end a phase that runs once.
	Booted func()
}

// probeTimeout bounds Serve's check that its own socket accepts.
const probeTimeout = 5 * time.Second

// Serve runs the spawnrpc server until ctx is done, then stops it and
// withdraws spawnd.json. It returns an error if serving cannot start or
// stops on its own.
//
// go-plugin's test mode (ServeConfig.Test) hands the address back on a
// channel, not a launching host's stdout, and stops on a context: what a
// daemon outliving every gateway needs. The cookie check it skips is no
// security measure (SO_PEERCRED is).
func Serve(ctx context.Context, opts ServeOptions) error {
	log, runDir := opts.Logger, opts.RunDir
	if err := pluginEnv(runDir, opts.SocketGID); err != nil {
		return err
	}

	var stopping atomic.Bool // marks a shutdown as ours for PluginLogger
	lanes := newLaneServer(opts.Impl, opts.SpawnThread, log)
	defer lanes.close()
	creds := &serverCreds{allowedUID: opts.AllowedUID, log: log, lanes: lanes}
	// Only shutdown cancels go-plugin's context, so a stop is marked as
	// ours before go-plugin acts on it.
	serveCtx, stop := context.WithCancel(context.WithoutCancel(ctx))
	defer stop()
	reattachCh := make(chan *plugin.ReattachConfig, 1)
	closed := make(chan struct{})
	go plugin.Serve(&plugin.ServeConfig{
		HandshakeConfig: Handshake,
		Plugins:         Plugins(Service(opts.Impl)),
		GRPCServer: func(o []grpc.ServerOption) *grpc.Server {
			return grpc.NewServer(append(o, serverOptions(creds, opts.Booted)...)...)
		},
		Logger: PluginLogger(log, stopping.Load),
		Test: &plugin.ServeTestConfig{
			Context:          serveCtx,
			ReattachConfigCh: reattachCh,
			CloseCh:          closed,
		},
	})

	var rc *plugin.ReattachConfig
	select {
	case rc = <-reattachCh:
	case <-closed:
		return fmt.Errorf("go-plugin could not start serving in %s (its error is logged above)", runDir)
	}
	ep := Endpoint{
		Protocol:        string(rc.Protocol),
		ProtocolVersion: rc.ProtocolVersion,
		Network:         rc.Addr.Network(),
		Addr:            rc.Addr.String(),
		Pid:             rc.Pid,
	}
	shutdown := func() {
		stopping.Store(true)
		stop()
		<-closed
		lanes.close()
	}
	if ctx.Err() != nil {
		shutdown()
		return nil
	}
	// go-plugin sends the reattach config before its accept loop starts:
	// publish only once a connection has been accepted and answered.
	if err := probeAccepting(ctx, ep); err != nil {
		shutdown()
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("spawnrpc socket %s does not answer: %w", ep.Addr, err)
	}
	if err := writeEndpoint(runDir, ep, opts.SocketGID); err != nil {
		shutdown()
		return fmt.Errorf("publish %s: %w", filepath.Join(runDir, EndpointFile), err)
	}
	if opts.Booted != nil {
		opts.Booted()
	}
	log.Info("spawnrpc serving", "addr", ep.Addr, "pid", ep.Pid, "run_dir", runDir, "allowed_uid", opts.AllowedUID)

	var runErr error
	select {
	case <-ctx.Done():
		shutdown()
	case <-closed:
		runErr = errors.New("spawnrpc server stopped on its own (see the log above)")
	}
	if err := removeEndpointIfOurs(runDir, ep.Pid); err != nil {
		log.Warn("cannot withdraw spawnd.json", "error", err)
	}
	log.Info("spawnrpc stopped", "addr", ep.Addr)
	return runErr
}

// serverOptions are spawnd's gRPC server's: creds, our codec, and only our
// methods.
func serverOptions(creds *serverCreds, booted func()) []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.Creds(creds),
		grpc.StaticStreamWindowSize(StaticWindow),
		grpc.StaticConnWindowSize(StaticWindow),
		grpc.ForceServerCodecV2(Codec{}),
		grpc.ChainUnaryInterceptor(onlyOurMethods),
		grpc.ChainStreamInterceptor(onlyOurStreams, onFirstWatch(booted)),
	}
}

// ServeListener serves v on ln as Serve does, gRPC and lanes behind the
// same peer check, but without go-plugin, a run directory or spawnd.json:
// for a caller that holds a listener of its own (tests). stop ends it, and
// returns once every lane's calls have.
func ServeListener(ln net.Listener, v Verbs, allowedUID int, spawnThread func() error, log *slog.Logger) (stop func()) {
	lanes := newLaneServer(v, spawnThread, log)
	srv := grpc.NewServer(serverOptions(&serverCreds{allowedUID: allowedUID, log: log, lanes: lanes}, nil)...)
	spawnpb.RegisterSpawnerServer(srv, Service(v))
	go func() { _ = srv.Serve(ln) }()
	return func() {
		srv.Stop()
		lanes.close()
	}
}

// DialVerdict connects to spawnd's socket at path and reads its verdict,
// checking no credential of the server's: for a caller that trusts path
// (tests); the gateway checks who serves it (internal/spawnclient).
func DialVerdict(ctx context.Context, path string) (net.Conn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, err
	}
	line := make([]byte, len(VerdictOK))
	if _, err := io.ReadFull(c, line); err != nil || string(line) != VerdictOK {
		c.Close()
		return nil, fmt.Errorf("spawnd at %s: verdict %q, %v", path, line, err)
	}
	return c, nil
}

// ClaimRunDir prepares runDir and makes this process its only spawnd while
// the returned lock stays open. Claim it before touching shared state (the
// lease journal), and hold it through Serve.
func ClaimRunDir(runDir string, socketGID int) (lock *os.File, err error) {
	if err := PrepareRunDir(runDir, socketGID); err != nil {
		return nil, err
	}
	if lock, err = takeServeLock(runDir, socketGID); err != nil {
		return nil, err
	}
	// Holding the lock, every socket left in the directory is a dead
	// spawnd's.
	removeStaleSockets(runDir)
	return lock, nil
}

// takeServeLock flocks runDir's spawnd.lock, with our pid for the next
// one's error.
func takeServeLock(runDir string, gid int) (*os.File, error) {
	path := filepath.Join(runDir, ServeLockFile)
	f, err := safedir.LockPid(path, 0o640, nil)
	if held := (*safedir.HeldError)(nil); errors.As(err, &held) {
		return nil, fmt.Errorf("another nexus-spawnd (pid %s) is already serving run directory %s; stop it first, or give this one another spawnd.run_dir", held.Holder, runDir)
	}
	// The gateway reads the lock to tell a stopping spawnd from a dead one.
	if err == nil {
		if err = f.Chmod(0o640); err == nil && gid >= 0 {
			err = f.Chown(-1, gid)
		}
		if err != nil {
			f.Close()
		}
	}
	if err != nil {
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	return f, nil
}

// pluginEnv sets go-plugin's socket placement (it reads only the
// environment) and clears what would change its transport (AutoMTLS,
// multiplexing).
func pluginEnv(runDir string, gid int) error {
	for _, k := range []string{plugin.EnvUnixSocketGroup, "PLUGIN_CLIENT_CERT", "PLUGIN_MULTIPLEX_GRPC", "PLUGIN_PROTOCOL_VERSIONS"} {
		if err := os.Unsetenv(k); err != nil {
			return err
		}
	}
	if err := os.Setenv(plugin.EnvUnixSocketDir, runDir); err != nil {
		return err
	}
	if gid < 0 {
		return nil
	}
	// go-plugin then chowns the socket to gid, 0660: without group write
	// the gateway's connect gets EACCES.
	return os.Setenv(plugin.EnvUnixSocketGroup, strconv.Itoa(gid))
}

// probeAccepting connects and waits for the verdict line spawnd writes from
// the gRPC server's accept path; a refusal proves acceptance as well.
func probeAccepting(ctx context.Context, ep Endpoint) error {
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	var d net.Dialer
	conn, err := d.DialContext(ctx, ep.Network, ep.Addr)
	if err != nil {
		return err
	}
	defer conn.Close()
	deadline, _ := ctx.Deadline()
	if err := conn.SetReadDeadline(deadline); err != nil {
		return err
	}
	line, err := bufio.NewReader(io.LimitReader(conn, MaxVerdictLen)).ReadString('\n')
	if err == nil && !strings.HasPrefix(line, VerdictPrefix) {
		err = fmt.Errorf("the socket's server is not nexus-spawnd (handshake %q)", line)
	}
	return err
}

// The methods a gateway may call: the Spawner verbs and the two go-plugin
// services its client opens (health, and stdio, which streams nothing here).
// Not go-plugin's controller (its Shutdown stops spawnd) nor its broker
// (which dials addresses the client names).
var spawnerPrefix = "/" + spawnpb.Spawner_ServiceDesc.ServiceName + "/"

func checkMethod(m string) error {
	if strings.HasPrefix(m, spawnerPrefix) ||
		m == "/grpc.health.v1.Health/Check" ||
		m == "/plugin.GRPCStdio/StreamStdio" {
		return nil
	}
	return status.Errorf(codes.Unimplemented, "nexus-spawnd does not serve %s", m)
}

func onlyOurMethods(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	if err := checkMethod(info.FullMethod); err != nil {
		return nil, err
	}
	return h(ctx, req)
}

// onFirstWatch runs f once, as the first Watch stream starts.
func onFirstWatch(f func()) grpc.StreamServerInterceptor {
	var once sync.Once
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
		if f != nil && info.FullMethod == spawnpb.Spawner_Watch_FullMethodName {
			once.Do(f)
		}
		return h(srv, ss)
	}
}

func onlyOurStreams(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
	if err := checkMethod(info.FullMethod); err != nil {
		return err
	}
	return h(srv, ss)
}
