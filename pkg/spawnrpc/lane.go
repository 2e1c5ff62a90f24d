package spawnrpc

import (
	"context"
	"errors"
	"io"
	"sync"

	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// A lane carries one verb's calls (Spawn's, Record's) as messages on one
// long-lived bidirectional gRPC stream per connection, each tagged with a
// call id the answer echoes: on an idle pair a unary call's new stream,
// HEADERS and handler goroutine cost ~0.25 ms a round trip of the claim's
// two (docs/architecture.md, "The claim's lanes"). A lane changes how a
// call travels, not what it is: spawnd's side hands every message to the
// verb's own handler, as a unary call would, and answers with what it
// returned; the gateway's side gives each call its own deadline and fails
// every call in flight with codes.Unavailable once the stream breaks.

// laneSpec says how one verb's requests and answers ride its lane.
type laneSpec[Req, Resp, C, R any] struct {
	name  string
	call  func(id uint64, req *Req) *C                // the gateway's message
	req   func(*C) (uint64, *Req)                     // spawnd reads it
	reply func(id uint64, resp *Resp, st []byte) *R   // spawnd's answer
	parts func(*R) (id uint64, resp *Resp, st []byte) // the gateway reads it
}

var spawnLane = laneSpec[spawnpb.SpawnRequest, spawnpb.SpawnResponse, spawnpb.SpawnCall, spawnpb.SpawnReply]{
	name: "Spawn",
	call: func(id uint64, r *spawnpb.SpawnRequest) *spawnpb.SpawnCall {
		return &spawnpb.SpawnCall{CallId: id, Request: r}
	},
	req: func(c *spawnpb.SpawnCall) (uint64, *spawnpb.SpawnRequest) { return c.GetCallId(), c.GetRequest() },
	reply: func(id uint64, r *spawnpb.SpawnResponse, st []byte) *spawnpb.SpawnReply {
		return &spawnpb.SpawnReply{CallId: id, Response: r, Status: st}
	},
	parts: func(r *spawnpb.SpawnReply) (uint64, *spawnpb.SpawnResponse, []byte) {
		return r.GetCallId(), r.GetResponse(), r.GetStatus()
	},
}

var recordLane = laneSpec[spawnpb.RecordRequest, spawnpb.RecordResponse, spawnpb.RecordCall, spawnpb.RecordReply]{
	name: "Record",
	call: func(id uint64, r *spawnpb.RecordRequest) *spawnpb.RecordCall {
		return &spawnpb.RecordCall{CallId: id, Request: r}
	},
	req: func(c *spawnpb.RecordCall) (uint64, *spawnpb.RecordRequest) { return c.GetCallId(), c.GetRequest() },
	reply: func(id uint64, r *spawnpb.RecordResponse, st []byte) *spawnpb.RecordReply {
		return &spawnpb.RecordReply{CallId: id, Response: r, Status: st}
	},
	parts: func(r *spawnpb.RecordReply) (uint64, *spawnpb.RecordResponse, []byte) {
		return r.GetCallId(), r.GetResponse(), r.GetStatus()
	},
}

// MaxLaneCalls bounds the calls of one lane spawnd runs at once; past it
// spawnd reads no further message until one answers (gRPC's flow control
// then holds the gateway's sends).
const MaxLaneCalls = 64

// MaxLaneMessage is the largest call the gateway sends on a lane: gRPC's
// default receive limit, which spawnd keeps. A larger message would end
// the stream, every call on it with it; the gateway refuses that one call
// instead (codes.ResourceExhausted), as a unary call's limit would.
const MaxLaneMessage = 4 << 20

// serveLane answers the calls of one lane stream until the gateway closes
// it or it breaks, each through handle (the verb's handler) with the
// stream's context, which carries the peer's credentials. The goroutine
// that received a call runs it, after starting the next receiver, so a call
// reaches its handler without a hand-off to another goroutine, and a slow
// one (an fsync) holds up no other.
func serveLane[Req, Resp, C, R any](stream grpc.BidiStreamingServer[C, R], spec *laneSpec[Req, Resp, C, R],
	handle func(context.Context, *Req) (*Resp, error),
) error {
	ls := &laneServer[Req, Resp, C, R]{stream: stream, spec: spec, handle: handle,
		slots: make(chan struct{}, MaxLaneCalls), done: make(chan error, 1)}
	ls.wg.Add(1)
	go ls.receive()
	err := <-ls.done
	// A call still running answers on a stream that is gone; wait for it,
	// since a handler may not outlive its stream's.
	ls.wg.Wait()
	if errors.Is(err, io.EOF) {
		return nil
	}
	return err
}

type laneServer[Req, Resp, C, R any] struct {
	stream grpc.BidiStreamingServer[C, R]
	spec   *laneSpec[Req, Resp, C, R]
	handle func(context.Context, *Req) (*Resp, error)
	slots  chan struct{}
	done   chan error // the one receiver whose Recv fails sends once
	sendMu sync.Mutex // gRPC allows one sender at a time
	wg     sync.WaitGroup
}

func (ls *laneServer[Req, Resp, C, R]) receive() {
	defer ls.wg.Done()
	ls.slots <- struct{}{}
	defer func() { <-ls.slots }()
	c, err := ls.stream.Recv()
	if err != nil {
		ls.done <- err
		return
	}
	ls.wg.Add(1)
	go ls.receive()
	id, req := ls.spec.req(c)
	if req == nil {
		req = new(Req) // as a unary call decodes an empty message
	}
	resp, err := ls.handle(ls.stream.Context(), req)
	var st []byte
	if err != nil {
		resp = nil
		st = encodeStatus(err)
	} else if resp == nil {
		resp = new(Resp)
	}
	ls.sendMu.Lock()
	defer ls.sendMu.Unlock()
	// A failed send means the stream is gone: its Recv fails as well, and
	// the gateway fails the call.
	_ = ls.stream.Send(ls.spec.reply(id, resp, st))
}

// encodeStatus is err as a unary call's trailers would carry it.
func encodeStatus(err error) []byte {
	b, merr := proto.Marshal(status.Convert(err).Proto())
	if merr != nil {
		b, _ = proto.Marshal(status.New(codes.Internal, "nexus-spawnd could not encode its error: "+merr.Error()).Proto())
	}
	return b
}

// decodeStatus is encodeStatus's error back.
func decodeStatus(b []byte) error {
	var p spb.Status
	if err := proto.Unmarshal(b, &p); err != nil {
		return status.Errorf(codes.Internal, "nexus-spawnd answered with an undecodable status: %v", err)
	}
	if codes.Code(p.GetCode()) == codes.OK {
		return status.Error(codes.Internal, "nexus-spawnd answered with a status but no error")
	}
	return status.FromProto(&p).Err()
}

// laneClient is the gateway's end of one lane of one connection: it opens
// the stream at its first call and again at the first after a break, and
// routes each answer to its caller.
type laneClient[Req, Resp, C, R any] struct {
	spec *laneSpec[Req, Resp, C, R]
	open func(ctx context.Context, opts ...grpc.CallOption) (grpc.BidiStreamingClient[C, R], error)

	mu     sync.Mutex
	cur    *laneStream[Req, Resp, C, R]
	nextID uint64
}

// laneStream is one stream of a lane and the calls waiting on it.
type laneStream[Req, Resp, C, R any] struct {
	spec   *laneSpec[Req, Resp, C, R]
	s      grpc.BidiStreamingClient[C, R]
	cancel context.CancelFunc
	sendMu sync.Mutex // gRPC allows one sender at a time

	mu      sync.Mutex
	pending map[uint64]chan laneResult[Resp]
	broken  error // the error every later call gets; set once
}

type laneResult[Resp any] struct {
	resp *Resp
	err  error
}

// do runs one call: it is answered, or fails with ctx, or with
// codes.Unavailable when the stream breaks before its answer.
func (l *laneClient[Req, Resp, C, R]) do(ctx context.Context, req *Req) (*Resp, error) {
	if err := ctx.Err(); err != nil {
		return nil, status.FromContextError(err).Err()
	}
	ls, id, ch, err := l.register()
	if err != nil {
		return nil, err
	}
	msg := l.spec.call(id, req)
	if n := any(msg).(interface{ SizeVT() int }).SizeVT(); n > MaxLaneMessage {
		ls.forget(id)
		return nil, status.Errorf(codes.ResourceExhausted, "%s: the request is %d bytes, past the %d nexus-spawnd accepts", l.spec.name, n, MaxLaneMessage)
	}
	ls.sendMu.Lock()
	err = ls.s.Send(msg)
	ls.sendMu.Unlock()
	if err != nil {
		// The stream is gone; Recv says why, and fails this call too.
		ls.fail(err)
	}
	select {
	case r := <-ch:
		return r.resp, r.err
	case <-ctx.Done():
		// A late answer finds no caller and is dropped.
		ls.forget(id)
		return nil, status.FromContextError(ctx.Err()).Err()
	}
}

// register enters a call on the lane's live stream, opening one if the
// last has broken.
func (l *laneClient[Req, Resp, C, R]) register() (*laneStream[Req, Resp, C, R], uint64, chan laneResult[Resp], error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.cur == nil || l.cur.err() != nil {
		ls, err := l.openStream()
		if err != nil {
			return nil, 0, nil, err
		}
		l.cur = ls
	}
	l.nextID++
	id, ch := l.nextID, make(chan laneResult[Resp], 1)
	if err := l.cur.add(id, ch); err != nil {
		return nil, 0, nil, err
	}
	return l.cur, id, ch, nil
}

// openStream opens a stream that lives until the connection closes or
// breaks (its context is no caller's).
func (l *laneClient[Req, Resp, C, R]) openStream() (*laneStream[Req, Resp, C, R], error) {
	ctx, cancel := context.WithCancel(context.Background())
	s, err := l.open(ctx)
	if err != nil {
		cancel()
		return nil, err
	}
	ls := &laneStream[Req, Resp, C, R]{spec: l.spec, s: s, cancel: cancel, pending: map[uint64]chan laneResult[Resp]{}}
	go ls.receive()
	return ls, nil
}

// receive hands each answer to its call until the stream breaks, then
// fails every call still waiting.
func (ls *laneStream[Req, Resp, C, R]) receive() {
	for {
		r, err := ls.s.Recv()
		if err != nil {
			ls.fail(err)
			return
		}
		id, resp, st := ls.spec.parts(r)
		ls.mu.Lock()
		ch := ls.pending[id]
		delete(ls.pending, id)
		ls.mu.Unlock()
		if ch == nil {
			continue // its caller gave up (its deadline); nobody waits
		}
		switch {
		case len(st) > 0:
			ch <- laneResult[Resp]{err: decodeStatus(st)}
		case resp == nil:
			ch <- laneResult[Resp]{err: status.Errorf(codes.Internal, "nexus-spawnd answered %s with neither a response nor a status", ls.spec.name)}
		default:
			ch <- laneResult[Resp]{resp: resp}
		}
	}
}

func (ls *laneStream[Req, Resp, C, R]) err() error {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return ls.broken
}

func (ls *laneStream[Req, Resp, C, R]) add(id uint64, ch chan laneResult[Resp]) error {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if ls.broken != nil {
		return ls.broken
	}
	ls.pending[id] = ch
	return nil
}

func (ls *laneStream[Req, Resp, C, R]) forget(id uint64) {
	ls.mu.Lock()
	delete(ls.pending, id)
	ls.mu.Unlock()
}

// fail breaks the stream for good: every call waiting on it, and every
// call entered after, gets codes.Unavailable (the next call opens another
// stream).
func (ls *laneStream[Req, Resp, C, R]) fail(cause error) {
	ls.mu.Lock()
	if ls.broken == nil {
		ls.broken = status.Errorf(codes.Unavailable, "lost connection to nexus-spawnd: its %s stream ended (%v)", ls.spec.name, status.Convert(cause).Message())
	}
	pending := ls.pending
	ls.pending = map[uint64]chan laneResult[Resp]{}
	broken := ls.broken
	ls.mu.Unlock()
	ls.cancel()
	for _, ch := range pending {
		ch <- laneResult[Resp]{err: broken}
	}
}
