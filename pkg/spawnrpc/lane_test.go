package spawnrpc

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// laneVerbs answers Spawn with the pid its lease id names, or refuses an
// id starting with "bad" as spawnd refuses a failed exec; a lease id
// starting with "hold" waits for release. Record refuses "bad" alike.
type laneVerbs struct {
	spawnpb.UnimplementedSpawnerServer // the verbs no test here calls
	entered                            chan string
	release                            chan struct{}
}

func (v *laneVerbs) Spawn(_ context.Context, r *spawnpb.SpawnRequest) (*spawnpb.SpawnResponse, error) {
	id := r.GetLeaseId()
	if len(id) >= 4 && id[:4] == "hold" {
		v.entered <- id
		<-v.release
	}
	if len(id) >= 3 && id[:3] == "bad" {
		st, err := status.New(codes.Internal, "exec failed: "+id).WithDetails(&spawnpb.SpawnFailure{Step: spawnpb.SpawnStep_SPAWN_STEP_EXEC})
		if err != nil {
			return nil, err
		}
		return nil, st.Err()
	}
	pid, _ := strconv.Atoi(id[len(id)-3:])
	return &spawnpb.SpawnResponse{Pid: int64(pid)}, nil
}

func (v *laneVerbs) Record(_ context.Context, r *spawnpb.RecordRequest) (*spawnpb.RecordResponse, error) {
	if r.GetLeaseId() == "bad" {
		return nil, status.Error(codes.FailedPrecondition, "Record: refused")
	}
	return &spawnpb.RecordResponse{}, nil
}

func (v *laneVerbs) Status(context.Context, *spawnpb.StatusRequest) (*spawnpb.StatusResponse, error) {
	return &spawnpb.StatusResponse{}, nil
}

// laneSocket is a socket path that fits sun_path.
func laneSocket(t *testing.T) string {
	dir, err := os.MkdirTemp("", "lane")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return filepath.Join(dir, "s.sock")
}

// serveOn serves ss on path with both ends' codec; the server stops at
// the test's end or at stop.
func serveOn(t *testing.T, path string, ss spawnpb.SpawnerServer) (stop func()) {
	t.Helper()
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.ForceServerCodecV2(Codec{}))
	spawnpb.RegisterSpawnerServer(srv, ss)
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(srv.Stop)
	return srv.Stop
}

func dialLane(t *testing.T, path string) Client {
	t.Helper()
	cc, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(Codec{})))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return NewClient(cc)
}

func newLaneVerbs() *laneVerbs {
	return &laneVerbs{entered: make(chan string, 2*MaxLaneCalls), release: make(chan struct{})}
}

func laneCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// TestLaneConcurrentCalls: calls in flight together on one lane each get
// their own answer, a refusal keeps its code and detail, and Record's lane
// runs beside Spawn's.
func TestLaneConcurrentCalls(t *testing.T) {
	path := laneSocket(t)
	serveOn(t, path, Service(newLaneVerbs()))
	c := dialLane(t, path)
	ctx := laneCtx(t)
	var wg sync.WaitGroup
	errs := make(chan error, 300)
	for i := range 100 {
		wg.Add(3)
		go func() {
			defer wg.Done()
			res, err := c.Spawn(ctx, &spawnpb.SpawnRequest{LeaseId: fmt.Sprintf("lease-%03d", i)})
			if err != nil || res.GetPid() != int64(i) {
				errs <- fmt.Errorf("Spawn lease-%03d: pid %d, %v", i, res.GetPid(), err)
			}
		}()
		go func() {
			defer wg.Done()
			_, err := c.Spawn(ctx, &spawnpb.SpawnRequest{LeaseId: fmt.Sprintf("bad-%03d", i)})
			st := status.Convert(err)
			if st.Code() != codes.Internal || st.Message() != fmt.Sprintf("exec failed: bad-%03d", i) || len(st.Details()) != 1 {
				errs <- fmt.Errorf("Spawn bad-%03d: %v, details %v", i, err, st.Details())
			} else if f, ok := st.Details()[0].(*spawnpb.SpawnFailure); !ok || f.GetStep() != spawnpb.SpawnStep_SPAWN_STEP_EXEC {
				errs <- fmt.Errorf("Spawn bad-%03d: detail %v", i, st.Details()[0])
			}
		}()
		go func() {
			defer wg.Done()
			id := "ok"
			if i%2 == 1 {
				id = "bad"
			}
			_, err := c.Record(ctx, &spawnpb.RecordRequest{LeaseId: id})
			if want := map[string]codes.Code{"ok": codes.OK, "bad": codes.FailedPrecondition}[id]; status.Code(err) != want {
				errs <- fmt.Errorf("Record %s: %v, want %v", id, err, want)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// TestLaneBreakFailsEveryCallInFlight: calls waiting on a stream that
// breaks (spawnd gone) fail with codes.Unavailable, and the first call
// once spawnd is back opens a new stream.
func TestLaneBreakFailsEveryCallInFlight(t *testing.T) {
	path := laneSocket(t)
	v := newLaneVerbs()
	stop := serveOn(t, path, Service(v))
	c := dialLane(t, path)
	ctx := laneCtx(t)
	const n = 3
	errs := make(chan error, n)
	for i := range n {
		go func() {
			_, err := c.Spawn(ctx, &spawnpb.SpawnRequest{LeaseId: fmt.Sprintf("hold-%03d", i)})
			errs <- err
		}()
	}
	for range n {
		<-v.entered
	}
	// Stop cancels the streams at once; their handlers still hold.
	go stop()
	for range n {
		if err := <-errs; status.Code(err) != codes.Unavailable {
			t.Fatalf("a call in flight when the stream broke: %v, want Unavailable", err)
		}
	}
	close(v.release)

	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	serveOn(t, path, Service(newLaneVerbs()))
	for {
		res, err := c.Spawn(ctx, &spawnpb.SpawnRequest{LeaseId: "lease-007"})
		if err == nil {
			if res.GetPid() != 7 {
				t.Fatalf("pid %d after the reconnect", res.GetPid())
			}
			return
		}
		// gRPC reconnects with a backoff, failing fast meanwhile.
		if status.Code(err) != codes.Unavailable || ctx.Err() != nil {
			t.Fatalf("Spawn once spawnd is back: %v", err)
		}
		cc := c.(*client)
		if _, err := cc.Status(ctx, &spawnpb.StatusRequest{}, grpc.WaitForReady(true)); err != nil {
			t.Fatal(err)
		}
	}
}

// TestLaneDeadlineIsPerCall: a call whose deadline passes returns
// DeadlineExceeded alone; its late answer, for a call id nobody waits on
// any more, is dropped, and the next call gets its own.
func TestLaneDeadlineIsPerCall(t *testing.T) {
	path := laneSocket(t)
	v := newLaneVerbs()
	serveOn(t, path, Service(v))
	c := dialLane(t, path)
	ctx := laneCtx(t)
	short, cancel := context.WithCancel(ctx)
	errc := make(chan error, 1)
	go func() {
		_, err := c.Spawn(short, &spawnpb.SpawnRequest{LeaseId: "hold-001"})
		errc <- err
	}()
	<-v.entered
	cancel()
	if err := <-errc; status.Code(err) != codes.Canceled {
		t.Fatalf("the canceled call: %v", err)
	}
	close(v.release) // hold-001 answers now, to nobody
	for i := 2; i < 5; i++ {
		res, err := c.Spawn(ctx, &spawnpb.SpawnRequest{LeaseId: fmt.Sprintf("lease-%03d", i)})
		if err != nil || res.GetPid() != int64(i) {
			t.Fatalf("call %d after a canceled one: pid %d, %v", i, res.GetPid(), err)
		}
	}
	dead, cancel2 := context.WithDeadline(ctx, time.Now())
	defer cancel2()
	if _, err := c.Record(dead, &spawnpb.RecordRequest{LeaseId: "ok"}); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("a call past its deadline: %v", err)
	}
}

// strayReplies answers each Spawn first for a call id nobody sent, then
// with neither a response nor a status for call id 2, then properly.
type strayReplies struct {
	spawnpb.UnimplementedSpawnerServer
}

func (strayReplies) Spawn(s grpc.BidiStreamingServer[spawnpb.SpawnCall, spawnpb.SpawnReply]) error {
	for {
		c, err := s.Recv()
		if err != nil {
			return nil
		}
		if err := s.Send(&spawnpb.SpawnReply{CallId: c.CallId + 1000, Response: &spawnpb.SpawnResponse{Pid: 1}}); err != nil {
			return err
		}
		reply := &spawnpb.SpawnReply{CallId: c.CallId, Response: &spawnpb.SpawnResponse{Pid: 2}}
		if c.CallId == 2 {
			reply.Response = nil
		}
		if err := s.Send(reply); err != nil {
			return err
		}
	}
}

// TestLaneDropsAnAnswerForAnUnknownCall: an answer whose call id no call
// waits on reaches nobody; one with neither a response nor a status is
// the call's Internal error.
func TestLaneDropsAnAnswerForAnUnknownCall(t *testing.T) {
	path := laneSocket(t)
	serveOn(t, path, strayReplies{})
	c := dialLane(t, path)
	ctx := laneCtx(t)
	if res, err := c.Spawn(ctx, &spawnpb.SpawnRequest{LeaseId: "a"}); err != nil || res.GetPid() != 2 {
		t.Fatalf("pid %d, %v: want the call's own answer", res.GetPid(), err)
	}
	if _, err := c.Spawn(ctx, &spawnpb.SpawnRequest{LeaseId: "b"}); status.Code(err) != codes.Internal {
		t.Fatalf("an empty answer: %v, want Internal", err)
	}
	if res, err := c.Spawn(ctx, &spawnpb.SpawnRequest{LeaseId: "c"}); err != nil || res.GetPid() != 2 {
		t.Fatalf("after an empty answer: pid %d, %v", res.GetPid(), err)
	}
}

// TestLaneRefusesAnOversizedCall: a call past MaxLaneMessage fails alone
// with ResourceExhausted, never sent, so the stream and the calls after it
// carry on.
func TestLaneRefusesAnOversizedCall(t *testing.T) {
	path := laneSocket(t)
	serveOn(t, path, Service(newLaneVerbs()))
	c := dialLane(t, path)
	ctx := laneCtx(t)
	if _, err := c.Spawn(ctx, &spawnpb.SpawnRequest{LeaseId: "lease-001"}); err != nil {
		t.Fatal(err)
	}
	big := &spawnpb.SpawnRequest{LeaseId: "lease-002", Config: make([]byte, MaxLaneMessage)}
	if _, err := c.Spawn(ctx, big); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("an oversized call: %v", err)
	}
	big.Config = big.Config[:MaxLaneMessage-64]
	if res, err := c.Spawn(ctx, big); err != nil || res.GetPid() != 2 {
		t.Fatalf("a call just below the limit: pid %d, %v", res.GetPid(), err)
	}
}
