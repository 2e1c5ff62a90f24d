package spawnclient

import (
	"bytes"
	"context"
	"encoding/binary"
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
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// laneVerbs answers Spawn with the pid its lease id names, or refuses an
// id starting with "bad" as spawnd refuses a failed exec; a lease id
// starting with "hold" waits for release, and "nnp" answers pid 1 when
// its thread has no_new_privs. Record refuses "bad" alike, and answers
// "nnp" with a refusal when its thread has the flag.
type laneVerbs struct {
	spawnpb.UnimplementedSpawnerServer // the verbs no test here calls
	entered                            chan string
	release                            chan struct{}
}

func threadNNP() bool {
	v, err := unix.PrctlRetInt(unix.PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0)
	return err == nil && v == 1
}

func (v *laneVerbs) Spawn(_ context.Context, r *spawnpb.SpawnRequest) (*spawnpb.SpawnResponse, error) {
	id := r.GetLeaseId()
	switch {
	case id == "nnp":
		if threadNNP() {
			return &spawnpb.SpawnResponse{Pid: 1}, nil
		}
		return &spawnpb.SpawnResponse{}, nil
	case strings.HasPrefix(id, "hold"):
		v.entered <- id
		<-v.release
	case strings.HasPrefix(id, "bad"):
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
	if r.GetLeaseId() == "bad" || r.GetLeaseId() == "nnp" && threadNNP() {
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

// serveOn serves v on path as spawnd does, its Spawn lanes' threads with
// no_new_privs, logging to log (nil: discarded); the server stops at the
// test's end or at stop.
func serveOn(t *testing.T, path string, v spawnrpc.Verbs, log io.Writer) (stop func()) {
	t.Helper()
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	if log == nil {
		log = io.Discard
	}
	nnp := func() error { return unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) }
	var once sync.Once
	s := spawnrpc.ServeListener(ln, v, os.Getuid(), nnp, slog.New(slog.NewTextHandler(log, nil)))
	stop = func() { once.Do(s) }
	t.Cleanup(stop)
	return stop
}

func dialLane(t *testing.T, path string) *RPC {
	t.Helper()
	dial := func(ctx context.Context) (net.Conn, error) { return spawnrpc.DialVerdict(ctx, path) }
	cc, err := grpc.NewClient("passthrough:///spawnd", grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return dial(ctx) }),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(spawnrpc.Codec{})))
	if err != nil {
		t.Fatal(err)
	}
	c := NewRPC(cc, dial)
	t.Cleanup(func() {
		c.Close()
		cc.Close()
	})
	return c
}

func newLaneVerbs() *laneVerbs {
	return &laneVerbs{entered: make(chan string, 2*spawnrpc.MaxLaneCalls), release: make(chan struct{})}
}

func laneCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// TestLaneConcurrentCalls: calls in flight together each get their own
// answer, a refusal keeps its code and detail, Record's lanes run beside
// Spawn's, and gRPC's verbs beside both on the same socket.
func TestLaneConcurrentCalls(t *testing.T) {
	path := laneSocket(t)
	serveOn(t, path, newLaneVerbs(), nil)
	c := dialLane(t, path)
	ctx := laneCtx(t)
	var wg sync.WaitGroup
	errs := make(chan error, 400)
	for i := range 100 {
		wg.Add(4)
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
		go func() {
			defer wg.Done()
			if _, err := c.Status(ctx, &spawnpb.StatusRequest{}); err != nil {
				errs <- fmt.Errorf("Status: %v", err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// TestLaneThreads: a Spawn runs on a thread the server's SpawnThread
// prepared (no_new_privs, here), one of its lanes' own; a Record on none.
func TestLaneThreads(t *testing.T) {
	path := laneSocket(t)
	serveOn(t, path, newLaneVerbs(), nil)
	c := dialLane(t, path)
	ctx := laneCtx(t)
	for range 3 {
		if res, err := c.Spawn(ctx, &spawnpb.SpawnRequest{LeaseId: "nnp"}); err != nil || res.GetPid() != 1 {
			t.Fatalf("Spawn's thread: pid %d (1 when it has no_new_privs), %v", res.GetPid(), err)
		}
		if _, err := c.Record(ctx, &spawnpb.RecordRequest{LeaseId: "nnp"}); err != nil {
			t.Fatalf("Record ran on a thread with no_new_privs: %v", err)
		}
	}
}

// TestLaneBreakFailsEveryCallInFlight: calls waiting on lanes that break
// (spawnd gone) fail with codes.Unavailable, and the first call once
// spawnd is back opens a new lane.
func TestLaneBreakFailsEveryCallInFlight(t *testing.T) {
	path := laneSocket(t)
	v := newLaneVerbs()
	stop := serveOn(t, path, v, nil)
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
	// stop shuts the lanes at once, then waits for their handlers.
	go stop()
	for range n {
		if err := <-errs; status.Code(err) != codes.Unavailable {
			t.Fatalf("a call in flight when its lane broke: %v, want Unavailable", err)
		}
	}
	close(v.release)

	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	serveOn(t, path, newLaneVerbs(), nil)
	if res, err := c.Spawn(ctx, &spawnpb.SpawnRequest{LeaseId: "lease-007"}); err != nil || res.GetPid() != 7 {
		t.Fatalf("Spawn once spawnd is back: pid %d, %v", res.GetPid(), err)
	}
}

// TestLaneDeadlineIsPerCall: a call whose caller gives up returns alone;
// its lane, left mid-call, is closed (the late answer reaches nobody), and
// the next call gets its own.
func TestLaneDeadlineIsPerCall(t *testing.T) {
	path := laneSocket(t)
	v := newLaneVerbs()
	serveOn(t, path, v, nil)
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

// rawSpawnd accepts lanes on path as spawnd would, and answers each call
// with answer's reply.
func rawSpawnd(t *testing.T, path string, answer func(c *spawnpb.SpawnCall) *spawnpb.SpawnReply) {
	t.Helper()
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				pre := make([]byte, len(spawnrpc.LanePreface(spawnrpc.SpawnLane.Name)))
				if _, err := io.WriteString(conn, spawnrpc.VerdictOK); err != nil {
					return
				}
				if _, err := io.ReadFull(conn, pre); err != nil {
					return
				}
				for {
					c, err := spawnrpc.ReadFrame[spawnpb.SpawnCall](conn)
					if err != nil || spawnrpc.WriteFrame(conn, answer(c)) != nil {
						return
					}
				}
			}()
		}
	}()
}

// TestLaneRefusesAStrayAnswer: an answer for another call is the call's
// Internal error and ends its lane; one with neither a response nor a
// status is the call's Internal error alone.
func TestLaneRefusesAStrayAnswer(t *testing.T) {
	path := laneSocket(t)
	rawSpawnd(t, path, func(c *spawnpb.SpawnCall) *spawnpb.SpawnReply {
		switch c.GetRequest().GetLeaseId() {
		case "stray":
			return &spawnpb.SpawnReply{CallId: c.CallId + 1000, Response: &spawnpb.SpawnResponse{Pid: 1}}
		case "empty":
			return &spawnpb.SpawnReply{CallId: c.CallId}
		}
		return &spawnpb.SpawnReply{CallId: c.CallId, Response: &spawnpb.SpawnResponse{Pid: 2}}
	})
	c := NewRPC(nil, func(ctx context.Context) (net.Conn, error) { return spawnrpc.DialVerdict(ctx, path) })
	defer c.Close()
	ctx := laneCtx(t)
	for _, id := range []string{"stray", "a", "empty", "b"} {
		res, err := c.Spawn(ctx, &spawnpb.SpawnRequest{LeaseId: id})
		switch id {
		case "stray", "empty":
			if status.Code(err) != codes.Internal {
				t.Fatalf("%s answer: %v, want Internal", id, err)
			}
		default:
			if err != nil || res.GetPid() != 2 {
				t.Fatalf("after a bad answer: pid %d, %v", res.GetPid(), err)
			}
		}
	}
}

// TestLaneRefusesAnOversizedCall: a call past spawnrpc.MaxLaneMessage fails alone
// with ResourceExhausted, never sent, so the calls after it carry on.
func TestLaneRefusesAnOversizedCall(t *testing.T) {
	path := laneSocket(t)
	serveOn(t, path, newLaneVerbs(), nil)
	c := dialLane(t, path)
	ctx := laneCtx(t)
	if _, err := c.Spawn(ctx, &spawnpb.SpawnRequest{LeaseId: "lease-001"}); err != nil {
		t.Fatal(err)
	}
	big := &spawnpb.SpawnRequest{LeaseId: "lease-002", Config: make([]byte, spawnrpc.MaxLaneMessage)}
	if _, err := c.Spawn(ctx, big); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("an oversized call: %v", err)
	}
	big.Config = big.Config[:spawnrpc.MaxLaneMessage-64]
	if res, err := c.Spawn(ctx, big); err != nil || res.GetPid() != 2 {
		t.Fatalf("a call just below the limit: pid %d, %v", res.GetPid(), err)
	}
}

// syncBuffer is a log the server writes and the test waits on.
type syncBuffer struct {
	mu   sync.Mutex
	b    bytes.Buffer
	wake chan struct{} // closed and replaced by each write
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	close(s.wake)
	s.wake = make(chan struct{})
	return s.b.Write(p)
}

// wait waits until the log holds want, or fails t.
func (s *syncBuffer) wait(t *testing.T, want string) {
	t.Helper()
	timeout := time.After(20 * time.Second)
	for {
		s.mu.Lock()
		got, wake := s.b.String(), s.wake
		s.mu.Unlock()
		if strings.Contains(got, want) {
			return
		}
		select {
		case <-wake:
		case <-timeout:
			t.Fatalf("the log lacks %q:\n%s", want, got)
		}
	}
}

// TestLaneServerRefusesWhatIsNotACall: as a peer past the check sending
// what no gateway sends, each connection is closed without an answer (an
// unknown preface, a frame past spawnrpc.MaxLaneMessage, a message that does not
// decode, one whose string is not UTF-8), logged, and nothing else
// changes: the next call is answered.
func TestLaneServerRefusesWhatIsNotACall(t *testing.T) {
	path := laneSocket(t)
	log := &syncBuffer{wake: make(chan struct{})}
	serveOn(t, path, newLaneVerbs(), log)
	ctx := laneCtx(t)
	frame := func(n uint32, body []byte) []byte {
		return append(binary.BigEndian.AppendUint32(nil, n), body...)
	}
	badUTF8, _ := (&spawnpb.SpawnCall{CallId: 1, Request: &spawnpb.SpawnRequest{LeaseId: "\xff"}}).MarshalVT()
	for name, tc := range map[string]struct{ preface, send, logged string }{
		"unknown preface": {fmt.Sprintf("%-23s\n", "NEXUS-LANE/1 Reload"), "", "neither gRPC nor a lane"},
		"oversized frame": {spawnrpc.LanePreface("Spawn"), string(frame(spawnrpc.MaxLaneMessage+1, nil)), "past the 4194304 a lane carries"},
		"undecodable":     {spawnrpc.LanePreface("Record"), string(frame(3, []byte{0x0a, 0xff, 0x01})), `verb=Record error="an undecodable lane message`},
		"not UTF-8":       {spawnrpc.LanePreface("Spawn"), string(frame(uint32(len(badUTF8)), badUTF8)), "SpawnRequest.lease_id"},
	} {
		conn, err := spawnrpc.DialVerdict(ctx, path)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := io.WriteString(conn, tc.preface+tc.send); err != nil {
			t.Fatal(err)
		}
		_ = conn.SetReadDeadline(time.Now().Add(20 * time.Second))
		if n, err := conn.Read(make([]byte, 1)); err != io.EOF {
			t.Fatalf("%s: read %d bytes, %v; want the connection closed", name, n, err)
		}
		conn.Close()
		log.wait(t, tc.logged)
	}
	c := dialLane(t, path)
	if res, err := c.Spawn(ctx, &spawnpb.SpawnRequest{LeaseId: "lease-003"}); err != nil || res.GetPid() != 3 {
		t.Fatalf("after the refusals: pid %d, %v", res.GetPid(), err)
	}
}
