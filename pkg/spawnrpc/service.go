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

// Client is the Spawner service as the gateway calls it: the generated
// client's verbs, and Spawn and Record in a unary call's shape, carried on
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

// Conn is the Client of one attachment: cc's verbs, and lanes dial
// opens. Close closes the lanes; cc is the caller's.
type Conn struct {
	spawnpb.SpawnerClient // the gRPC verbs and Watch
	spawn                 *laneClient[spawnpb.SpawnRequest, spawnpb.SpawnResponse, spawnpb.SpawnCall, spawnpb.SpawnReply]
	record                *laneClient[spawnpb.RecordRequest, spawnpb.RecordResponse, spawnpb.RecordCall, spawnpb.RecordReply]
}

var _ Client = (*Conn)(nil)

// NewConn is the Conn of cc and dial.
func NewConn(cc grpc.ClientConnInterface, dial LaneDialer) *Conn {
	return &Conn{
		SpawnerClient: spawnpb.NewSpawnerClient(cc),
		spawn:         newLaneClient(&spawnLane, dial),
		record:        newLaneClient(&recordLane, dial),
	}
}

// Spawn runs one Spawn on its lane.
func (c *Conn) Spawn(ctx context.Context, r *spawnpb.SpawnRequest) (*spawnpb.SpawnResponse, error) {
	return c.spawn.do(ctx, r)
}

// Record runs one Record on its lane.
func (c *Conn) Record(ctx context.Context, r *spawnpb.RecordRequest) (*spawnpb.RecordResponse, error) {
	return c.record.do(ctx, r)
}

// Close closes the lanes: the calls on them, and every later one, fail
// with codes.Unavailable.
func (c *Conn) Close() {
	c.spawn.close()
	c.record.close()
}
