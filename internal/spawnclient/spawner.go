package spawnclient

import (
	"context"

	"google.golang.org/grpc"

	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// spawner implements API on top of whichever spawnd is attached at the
// time of each call.
type spawner struct{ c *Client }

var _ API = (*spawner)(nil)

func call[Req, Resp any](c *Client, ctx context.Context, in Req, opts []grpc.CallOption,
	method func(API, context.Context, Req, ...grpc.CallOption) (Resp, error),
) (Resp, error) {
	return callOn(c, ctx, func(api API) (Resp, error) { return method(api, ctx, in, opts...) })
}

// callOn runs one call on the current connection.
func callOn[Resp any](c *Client, ctx context.Context, do func(API) (Resp, error)) (Resp, error) {
	cn, err := c.current(ctx)
	if err != nil {
		var zero Resp
		return zero, err
	}
	out, err := do(cn.api)
	c.observe(err)
	return out, cn.lost(ctx, err)
}

// Spawn and Record travel on their lanes, which take no call options.
func (s *spawner) Spawn(ctx context.Context, in *spawnpb.SpawnRequest) (*spawnpb.SpawnResponse, error) {
	return callOn(s.c, ctx, func(api API) (*spawnpb.SpawnResponse, error) { return api.Spawn(ctx, in) })
}

func (s *spawner) Verify(ctx context.Context, in *spawnpb.VerifyRequest, opts ...grpc.CallOption) (*spawnpb.VerifyResponse, error) {
	return call(s.c, ctx, in, opts, API.Verify)
}

func (s *spawner) Terminate(ctx context.Context, in *spawnpb.TerminateRequest, opts ...grpc.CallOption) (*spawnpb.TerminateResponse, error) {
	return call(s.c, ctx, in, opts, API.Terminate)
}

func (s *spawner) List(ctx context.Context, in *spawnpb.ListRequest, opts ...grpc.CallOption) (*spawnpb.ListResponse, error) {
	return call(s.c, ctx, in, opts, API.List)
}

func (s *spawner) Record(ctx context.Context, in *spawnpb.RecordRequest) (*spawnpb.RecordResponse, error) {
	return callOn(s.c, ctx, func(api API) (*spawnpb.RecordResponse, error) { return api.Record(ctx, in) })
}

// Reload also records the version spawnd applied as the gateway's, so a
// re-attach after a SIGHUP expects that version, not the boot one.
func (s *spawner) Reload(ctx context.Context, in *spawnpb.ReloadRequest, opts ...grpc.CallOption) (*spawnpb.ReloadResponse, error) {
	res, err := call(s.c, ctx, in, opts, API.Reload)
	if err == nil && res.GetApplied() && in.GetConfigDigest() != "" {
		s.c.mu.Lock()
		s.c.digest = in.GetConfigDigest()
		s.c.mu.Unlock()
	}
	return res, err
}

func (s *spawner) Status(ctx context.Context, in *spawnpb.StatusRequest, opts ...grpc.CallOption) (*spawnpb.StatusResponse, error) {
	return call(s.c, ctx, in, opts, API.Status)
}

func (s *spawner) Binding(ctx context.Context, in *spawnpb.BindingRequest, opts ...grpc.CallOption) (*spawnpb.BindingResponse, error) {
	return call(s.c, ctx, in, opts, API.Binding)
}

func (s *spawner) Watch(ctx context.Context, in *spawnpb.WatchRequest, opts ...grpc.CallOption) (grpc.ServerStreamingClient[spawnpb.ExitEvent], error) {
	cn, err := s.c.current(ctx)
	if err != nil {
		return nil, err
	}
	stream, err := cn.api.Watch(ctx, in, opts...)
	s.c.observe(err)
	if err != nil {
		return nil, cn.lost(ctx, err)
	}
	return &watchStream{ServerStreamingClient: stream, c: s.c, cn: cn, ctx: ctx}, nil
}

// watchStream reports a broken stream to the supervisor like a failed
// call, and a stream cut by a lost spawnd as codes.Unavailable.
type watchStream struct {
	grpc.ServerStreamingClient[spawnpb.ExitEvent]
	c   *Client
	cn  *conn
	ctx context.Context
}

func (w *watchStream) Recv() (*spawnpb.ExitEvent, error) {
	ev, err := w.ServerStreamingClient.Recv()
	w.c.observe(err)
	return ev, w.cn.lost(w.ctx, err)
}
