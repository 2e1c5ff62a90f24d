package spawnrpc

import (
	"context"

	"google.golang.org/grpc"

	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// Verbs is spawnd's side of the service: every verb in a unary call's
// shape, Spawn and Record included, whichever way the call travels
// (Service carries those two on their lanes).
type Verbs interface {
	Spawn(context.Context, *spawnpb.SpawnRequest) (*spawnpb.SpawnResponse, error)
	Verify(context.Context, *spawnpb.VerifyRequest) (*spawnpb.VerifyResponse, error)
	Terminate(context.Context, *spawnpb.TerminateRequest) (*spawnpb.TerminateResponse, error)
	List(context.Context, *spawnpb.ListRequest) (*spawnpb.ListResponse, error)
	Watch(*spawnpb.WatchRequest, grpc.ServerStreamingServer[spawnpb.ExitEvent]) error
	Record(context.Context, *spawnpb.RecordRequest) (*spawnpb.RecordResponse, error)
	Reload(context.Context, *spawnpb.ReloadRequest) (*spawnpb.ReloadResponse, error)
	Status(context.Context, *spawnpb.StatusRequest) (*spawnpb.StatusResponse, error)
	Binding(context.Context, *spawnpb.BindingRequest) (*spawnpb.BindingResponse, error)
}

// Service serves v as the Spawner service: Spawn's and Record's lanes
// hand each call to v's handler of that verb, the other verbs are v's own.
func Service(v Verbs) spawnpb.SpawnerServer { return &service{v: v} }

type service struct {
	spawnpb.UnimplementedSpawnerServer
	v Verbs
}

func (s *service) Spawn(stream grpc.BidiStreamingServer[spawnpb.SpawnCall, spawnpb.SpawnReply]) error {
	return serveLane(stream, &spawnLane, s.v.Spawn)
}

func (s *service) Record(stream grpc.BidiStreamingServer[spawnpb.RecordCall, spawnpb.RecordReply]) error {
	return serveLane(stream, &recordLane, s.v.Record)
}

func (s *service) Verify(ctx context.Context, r *spawnpb.VerifyRequest) (*spawnpb.VerifyResponse, error) {
	return s.v.Verify(ctx, r)
}

func (s *service) Terminate(ctx context.Context, r *spawnpb.TerminateRequest) (*spawnpb.TerminateResponse, error) {
	return s.v.Terminate(ctx, r)
}

func (s *service) List(ctx context.Context, r *spawnpb.ListRequest) (*spawnpb.ListResponse, error) {
	return s.v.List(ctx, r)
}

func (s *service) Watch(r *spawnpb.WatchRequest, stream grpc.ServerStreamingServer[spawnpb.ExitEvent]) error {
	return s.v.Watch(r, stream)
}

func (s *service) Reload(ctx context.Context, r *spawnpb.ReloadRequest) (*spawnpb.ReloadResponse, error) {
	return s.v.Reload(ctx, r)
}

func (s *service) Status(ctx context.Context, r *spawnpb.StatusRequest) (*spawnpb.StatusResponse, error) {
	return s.v.Status(ctx, r)
}

func (s *service) Binding(ctx context.Context, r *spawnpb.BindingRequest) (*spawnpb.BindingResponse, error) {
	return s.v.Binding(ctx, r)
}

// Client is the Spawner service as the gateway calls it: the generated
// client's verbs, but Spawn and Record in a unary call's shape, carried on
// their lanes.
type Client interface {
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

// NewClient is the Client of one connection. Its lanes' streams end with
// cc (Close).
func NewClient(cc grpc.ClientConnInterface) Client {
	api := spawnpb.NewSpawnerClient(cc)
	return &client{
		SpawnerClient: api,
		spawn:         &laneClient[spawnpb.SpawnRequest, spawnpb.SpawnResponse, spawnpb.SpawnCall, spawnpb.SpawnReply]{spec: &spawnLane, open: api.Spawn},
		record:        &laneClient[spawnpb.RecordRequest, spawnpb.RecordResponse, spawnpb.RecordCall, spawnpb.RecordReply]{spec: &recordLane, open: api.Record},
	}
}

type client struct {
	spawnpb.SpawnerClient // the unary verbs and Watch
	spawn                 *laneClient[spawnpb.SpawnRequest, spawnpb.SpawnResponse, spawnpb.SpawnCall, spawnpb.SpawnReply]
	record                *laneClient[spawnpb.RecordRequest, spawnpb.RecordResponse, spawnpb.RecordCall, spawnpb.RecordReply]
}

func (c *client) Spawn(ctx context.Context, r *spawnpb.SpawnRequest) (*spawnpb.SpawnResponse, error) {
	return c.spawn.do(ctx, r)
}

func (c *client) Record(ctx context.Context, r *spawnpb.RecordRequest) (*spawnpb.RecordResponse, error) {
	return c.record.do(ctx, r)
}
