package spawnclient

import (
	"bufio"
	"context"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-plugin"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// The gateway's end of the spawnrpc service: gRPC's verbs through the
// generated client, and Spawn and Record on their lanes (pkg/spawnrpc's
// lane.go says what a lane is; spawnd's end lives there).

// clientPlugin is spawnrpc's plugin as the gateway dispenses it: an RPC
// whose lanes open with dial.
type clientPlugin struct {
	spawnrpc.SpawnerPlugin
	dial LaneDialer
}

// GRPCClient returns the RPC over go-plugin's connection.
func (p *clientPlugin) GRPCClient(_ context.Context, _ *plugin.GRPCBroker, cc *grpc.ClientConn) (any, error) {
	return NewRPC(cc, p.dial), nil
}

// clientPlugins is what the gateway registers.
func clientPlugins(dial LaneDialer) plugin.PluginSet {
	return plugin.PluginSet{spawnrpc.PluginName: &clientPlugin{dial: dial}}
}

// API is the Spawner service as the gateway calls it: the generated
// client's verbs, and Spawn and Record in a unary call's shape, carried on
// their lanes.
type API interface {
	Spawn(context.Context, *spawnpb.SpawnRequest) (*spawnpb.SpawnResponse, error)
	Verify(context.Context, *spawnpb.VerifyRequest, ...grpc.CallOption) (*spawnpb.VerifyResponse, error)
	Terminate(context.Context, *spawnpb.TerminateRequest, ...grpc.CallOption) (*spawnpb.TerminateResponse, error)
	List(context.Context, *spawnpb.ListRequest, ...grpc.CallOption) (*spawnpb.ListResponse, error)
	Watch(context.Context, *spawnpb.WatchRequest, ...grpc.CallOption) (grpc.ServerStreamingClient[spawnpb.ExitEvent], error)
	Record(context.Context, *spawnpb.RecordRequest) (*spawnpb.RecordResponse, error)
	Reload(context.Context, *spawnpb.ReloadRequest, ...grpc.CallOption) (*spawnpb.ReloadResponse, error)
	Status(context.Context, *spawnpb.StatusRequest, ...grpc.CallOption) (*spawnpb.StatusResponse, error)
	Binding(context.Context, *spawnpb.BindingRequest, ...grpc.CallOption) (*spawnpb.BindingResponse, error)
}

// RPC is the API of one attachment: cc's verbs, and lanes dial opens.
// Close closes the lanes; cc is the caller's.
type RPC struct {
	spawnpb.SpawnerClient // the gRPC verbs and Watch
	spawn                 *laneClient[spawnpb.SpawnRequest, spawnpb.SpawnResponse, spawnpb.SpawnCall, spawnpb.SpawnReply]
	record                *laneClient[spawnpb.RecordRequest, spawnpb.RecordResponse, spawnpb.RecordCall, spawnpb.RecordReply]
}

var _ API = (*RPC)(nil)

// NewRPC is the RPC of cc and dial.
func NewRPC(cc grpc.ClientConnInterface, dial LaneDialer) *RPC {
	return &RPC{
		SpawnerClient: spawnpb.NewSpawnerClient(cc),
		spawn:         newLaneClient(&spawnrpc.SpawnLane, dial),
		record:        newLaneClient(&spawnrpc.RecordLane, dial),
	}
}

// Spawn runs one Spawn on its lane.
func (c *RPC) Spawn(ctx context.Context, r *spawnpb.SpawnRequest) (*spawnpb.SpawnResponse, error) {
	return c.spawn.do(ctx, r)
}

// Record runs one Record on its lane.
func (c *RPC) Record(ctx context.Context, r *spawnpb.RecordRequest) (*spawnpb.RecordResponse, error) {
	return c.record.do(ctx, r)
}

// Close closes the lanes: the calls on them, and every later one, fail
// with codes.Unavailable.
func (c *RPC) Close() {
	c.spawn.close()
	c.record.close()
}

// LaneDialer opens a connection to spawnd that has passed its peer check
// and verdict, for a lane.
type LaneDialer func(ctx context.Context) (net.Conn, error)

// laneClient is the gateway's end of one verb's lanes: the idle ones it
// keeps open, one call at a time on each.
type laneClient[Req, Resp, C, R any] struct {
	spec   *spawnrpc.LaneSpec[Req, Resp, C, R]
	dial   LaneDialer
	slots  chan struct{} // spawnrpc.MaxLaneCalls
	nextID atomic.Uint64

	mu     sync.Mutex
	idle   []*laneConn
	open   map[*laneConn]struct{}
	closed bool
}

type laneConn struct {
	net.Conn
	r *bufio.Reader
}

func newLaneClient[Req, Resp, C, R any](spec *spawnrpc.LaneSpec[Req, Resp, C, R], dial LaneDialer) *laneClient[Req, Resp, C, R] {
	return &laneClient[Req, Resp, C, R]{spec: spec, dial: dial, slots: make(chan struct{}, spawnrpc.MaxLaneCalls), open: map[*laneConn]struct{}{}}
}

// do runs one call: it is answered, or fails with ctx, or with
// codes.Unavailable when its lane cannot be opened or breaks.
func (l *laneClient[Req, Resp, C, R]) do(ctx context.Context, req *Req) (*Resp, error) {
	if err := ctx.Err(); err != nil {
		return nil, status.FromContextError(err).Err()
	}
	id := l.nextID.Add(1)
	msg := any(l.spec.Call(id, req)).(spawnrpc.Message)
	if n := msg.SizeVT(); n > spawnrpc.MaxLaneMessage {
		return nil, status.Errorf(codes.ResourceExhausted, "%s: the request is %d bytes, past the %d nexus-spawnd accepts", l.spec.Name, n, spawnrpc.MaxLaneMessage)
	}
	select {
	case l.slots <- struct{}{}:
	case <-ctx.Done():
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	defer func() { <-l.slots }()
	lc, err := l.take(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil, status.FromContextError(ctx.Err()).Err()
		}
		return nil, status.Errorf(codes.Unavailable, "lost connection to nexus-spawnd: cannot open its %s lane (%v)", l.spec.Name, err)
	}
	// A caller that gives up unblocks the lane's read; the lane, left
	// mid-call, is closed.
	stop := context.AfterFunc(ctx, func() { _ = lc.SetDeadline(time.Unix(1, 0)) })
	resp, intact, err := l.exchange(lc, id, msg)
	if !stop() || !intact {
		l.discard(lc)
		if ctx.Err() != nil {
			return nil, status.FromContextError(ctx.Err()).Err()
		}
		return nil, err
	}
	l.put(lc)
	return resp, err
}

// exchange writes the call and reads its answer; intact says whether the
// lane may carry another call.
func (l *laneClient[Req, Resp, C, R]) exchange(lc *laneConn, id uint64, msg spawnrpc.Message) (_ *Resp, intact bool, _ error) {
	broke := func(err error) (*Resp, bool, error) {
		return nil, false, status.Errorf(codes.Unavailable, "lost connection to nexus-spawnd: its %s lane broke (%v)", l.spec.Name, err)
	}
	if err := spawnrpc.WriteFrame(lc, msg); err != nil {
		return broke(err)
	}
	r, err := spawnrpc.ReadFrame[R](lc.r)
	if err != nil {
		return broke(err)
	}
	got, resp, st := l.spec.Parts(r)
	switch {
	case got != id:
		return nil, false, status.Errorf(codes.Internal, "nexus-spawnd answered %s call %d on the lane of call %d", l.spec.Name, got, id)
	case len(st) > 0:
		return nil, true, spawnrpc.DecodeStatus(st)
	case resp == nil:
		return nil, true, status.Errorf(codes.Internal, "nexus-spawnd answered %s with neither a response nor a status", l.spec.Name)
	}
	return resp, true, nil
}

// take is an idle lane, else a new one.
func (l *laneClient[Req, Resp, C, R]) take(ctx context.Context) (*laneConn, error) {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil, net.ErrClosed
	}
	if n := len(l.idle); n > 0 {
		lc := l.idle[n-1]
		l.idle = l.idle[:n-1]
		l.mu.Unlock()
		return lc, nil
	}
	l.mu.Unlock()
	conn, err := l.dial(ctx)
	if err != nil {
		return nil, err
	}
	if _, err := io.WriteString(conn, spawnrpc.LanePreface(l.spec.Name)); err != nil {
		_ = conn.Close()
		return nil, err
	}
	lc := &laneConn{Conn: conn, r: bufio.NewReader(conn)}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		_ = conn.Close()
		return nil, net.ErrClosed
	}
	l.open[lc] = struct{}{}
	return lc, nil
}

func (l *laneClient[Req, Resp, C, R]) put(lc *laneConn) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return // close closed it
	}
	l.idle = append(l.idle, lc)
}

func (l *laneClient[Req, Resp, C, R]) discard(lc *laneConn) {
	l.mu.Lock()
	delete(l.open, lc)
	l.mu.Unlock()
	_ = lc.Close()
}

// close closes every lane, failing the calls on them with
// codes.Unavailable, and every later call.
func (l *laneClient[Req, Resp, C, R]) close() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.closed = true
	for lc := range l.open {
		_ = lc.Close()
	}
	l.open, l.idle = map[*laneConn]struct{}{}, nil
}
