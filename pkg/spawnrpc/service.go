package spawnrpc

import (
	"context"

	"google.golang.org/grpc"

	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// Verbs is spawnd's side of the service: every verb in a unary call's
// shape, Spawn and Record included, which travel on their lanes
// (lane.go); Service serves the others over gRPC.
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

// Service serves v's verbs but Spawn and Record as the Spawner service.
func Service(v Verbs) spawnpb.SpawnerServer { return &service{v: v} }

type service struct {
	spawnpb.UnimplementedSpawnerServer
	v Verbs
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
