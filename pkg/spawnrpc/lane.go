package spawnrpc

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// A lane carries one verb's calls (Spawn's, Record's): the two a cold
// claim waits on, kept off gRPC (docs/architecture.md, "The claim's
// lanes"). A lane is a connection of its own to spawnd's socket: the
// gateway dials it as it dials gRPC's, passes the same SO_PEERCRED check
// and reads the same verdict line, then writes LanePreface(verb) where
// gRPC's client writes HTTP/2's preface (both 24 bytes, which spawnd reads
// before deciding which the connection is). From there it carries one
// call at a time: the gateway writes a frame, spawnd answers with one, and
// the connection waits for the next call; the gateway opens another for a
// call while every open one is busy.
//
// A frame is a message's length (4 bytes, big-endian, at most
// MaxLaneMessage) and the message, protobuf: SpawnCall or RecordCall from
// the gateway, decoded with spawnpb.Codec as a gRPC message is, and
// SpawnReply or RecordReply back, carrying the response, or the
// google.rpc.Status a unary call's trailers would have carried.
//
// spawnd serves a Spawn lane on an OS thread of its own, locked, prepared
// by ServeOptions.SpawnThread (spawnd sets no_new_privs on it) and reading
// with blocking reads, so that a claim's Spawn wakes the thread that forks
// its instance; a Record lane runs on a goroutine.

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

// MaxLaneCalls bounds the calls of one verb the gateway has in flight, so
// the lanes it keeps open; spawnd serves at most twice as many of a verb
// (a gateway's lanes linger a moment after it re-attaches) and closes any
// past that at once.
const MaxLaneCalls = 64

// MaxLaneMessage is the largest message a lane carries either way: gRPC's
// default receive limit, which the gRPC verbs keep. The gateway refuses a
// larger call itself (codes.ResourceExhausted), unsent; spawnd closes a
// lane whose frame claims more.
const MaxLaneMessage = 4 << 20

// http2Preface is what a gRPC client writes first.
const http2Preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

// LanePreface is what the gateway writes, after spawnd's verdict, on a
// connection that carries verb's lane: as long as HTTP/2's preface.
func LanePreface(verb string) string {
	return fmt.Sprintf("%-*s\n", len(http2Preface)-1, "NEXUS-LANE/1 "+verb)
}

// vtMessage is a spawnpb message as a lane writes it.
type vtMessage interface {
	SizeVT() int
	MarshalToSizedBufferVT([]byte) (int, error)
}

// writeFrame writes m as one frame, in one write.
func writeFrame(w io.Writer, m vtMessage) error {
	n := m.SizeVT()
	if n > MaxLaneMessage {
		return fmt.Errorf("a lane message of %d bytes, past the %d a lane carries", n, MaxLaneMessage)
	}
	b := make([]byte, 4+n)
	binary.BigEndian.PutUint32(b, uint32(n))
	if _, err := m.MarshalToSizedBufferVT(b[4:]); err != nil {
		return err
	}
	_, err := w.Write(b)
	return err
}

// readFrame reads one frame and decodes its message. io.EOF is a close
// between frames.
func readFrame[M any](r io.Reader) (*M, error) {
	var h [4]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return nil, err
	}
	n := binary.BigEndian.Uint32(h[:])
	if n > MaxLaneMessage {
		return nil, fmt.Errorf("a lane frame of %d bytes, past the %d a lane carries", n, MaxLaneMessage)
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(r, b); err != nil {
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return nil, err
	}
	m := new(M)
	if err := (spawnpb.Codec{}).Unmarshal(mem.BufferSlice{mem.SliceBuffer(b)}, m); err != nil {
		return nil, fmt.Errorf("an undecodable lane message: %w", err)
	}
	return m, nil
}

// serveCalls answers the calls of one lane, one at a time, each through
// handle (the verb's handler, as a unary call would reach it) with ctx,
// until the gateway closes the lane (nil) or it breaks.
func serveCalls[Req, Resp, C, R any](ctx context.Context, rw io.ReadWriter, spec *laneSpec[Req, Resp, C, R],
	handle func(context.Context, *Req) (*Resp, error),
) error {
	r := bufio.NewReader(rw)
	for {
		c, err := readFrame[C](r)
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		id, req := spec.req(c)
		if req == nil {
			req = new(Req) // as a unary call decodes an empty message
		}
		resp, err := handle(ctx, req)
		var st []byte
		if err != nil {
			resp = nil
			st = encodeStatus(err)
		} else if resp == nil {
			resp = new(Resp)
		}
		if err := writeFrame(rw, any(spec.reply(id, resp, st)).(vtMessage)); err != nil {
			return err
		}
	}
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

// laneServer is spawnd's side: it serves every connection whose preface
// names a lane.
type laneServer struct {
	v Verbs
	// spawnThread prepares a Spawn lane's thread before its first call.
	spawnThread func() error
	log         *slog.Logger

	mu     sync.Mutex
	lanes  map[*servedLane]struct{}
	count  map[string]int // lanes served, by verb
	closed bool
	wg     sync.WaitGroup
}

// servedLane is one lane connection spawnd serves; shut ends it.
type servedLane struct {
	verb string
	shut func()
}

func newLaneServer(v Verbs, spawnThread func() error, log *slog.Logger) *laneServer {
	return &laneServer{v: v, spawnThread: spawnThread, log: log, lanes: map[*servedLane]struct{}{}, count: map[string]int{}}
}

// dispatch serves conn's lane if preface names one, and says whether it
// did; conn is then the lane server's to close.
func (s *laneServer) dispatch(preface string, conn net.Conn, pc PeerCred) bool {
	var verb string
	switch preface {
	case LanePreface(spawnLane.name):
		verb = spawnLane.name
	case LanePreface(recordLane.name):
		verb = recordLane.name
	default:
		return false
	}
	s.mu.Lock()
	if s.closed || s.count[verb] >= 2*MaxLaneCalls {
		closed := s.closed
		s.mu.Unlock()
		if !closed {
			s.log.Warn("refused a spawnrpc lane: the gateway already has the most open", "verb", verb, "lanes", 2*MaxLaneCalls, "peer_pid", pc.PID)
		}
		_ = conn.Close()
		return true
	}
	sl := &servedLane{verb: verb, shut: func() { _ = conn.Close() }}
	s.lanes[sl] = struct{}{}
	s.count[verb]++
	s.wg.Add(1)
	s.mu.Unlock()
	// The handlers' context carries the peer, as a gRPC call's does, and
	// ends with the lane.
	ctx, cancel := context.WithCancel(peer.NewContext(context.Background(),
		&peer.Peer{Addr: conn.RemoteAddr(), LocalAddr: conn.LocalAddr(), AuthInfo: pc}))
	if verb == spawnLane.name {
		go s.serveSpawn(ctx, cancel, sl, conn)
	} else {
		go func() {
			err := serveCalls(ctx, conn, &recordLane, s.v.Record)
			cancel()
			s.done(sl, err)
			_ = conn.Close()
		}()
	}
	return true
}

// serveSpawn serves a Spawn lane on a thread of its own: locked for the
// lane's life and never unlocked, so the thread ends with it, whatever
// spawnThread set on it. Its reads are blocking system calls on a
// duplicate of conn's descriptor.
func (s *laneServer) serveSpawn(ctx context.Context, cancel context.CancelFunc, sl *servedLane, conn net.Conn) {
	runtime.LockOSThread()
	defer cancel()
	var f *os.File
	err := fmt.Errorf("a %T has no descriptor to read", conn)
	if fc, ok := conn.(interface{ File() (*os.File, error) }); ok {
		f, err = fc.File()
	}
	_ = conn.Close()
	if err == nil && s.spawnThread != nil {
		if err = s.spawnThread(); err != nil {
			f.Close()
		}
	}
	if err != nil {
		s.done(sl, fmt.Errorf("preparing the lane's thread: %w", err))
		return
	}
	fd := int(f.Fd()) // blocking from here
	s.mu.Lock()
	sl.shut = func() { _ = unix.Shutdown(fd, unix.SHUT_RDWR) }
	closed := s.closed
	s.mu.Unlock()
	if closed {
		sl.shut()
	}
	err = serveCalls(ctx, fdConn(fd), &spawnLane, s.v.Spawn)
	s.done(sl, err) // before the close: shut may not reach a reused descriptor
	f.Close()
}

// fdConn reads and writes a blocking descriptor (its *os.File's, whose
// Fd would make each call a fcntl as well).
type fdConn int

func (c fdConn) Read(b []byte) (int, error) {
	for {
		n, err := unix.Read(int(c), b)
		switch {
		case err == unix.EINTR:
			continue
		case err != nil:
			return 0, err
		case n == 0 && len(b) > 0:
			return 0, io.EOF
		}
		return n, nil
	}
}

func (c fdConn) Write(b []byte) (int, error) {
	n := 0
	for n < len(b) {
		m, err := unix.Write(int(c), b[n:])
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return n, err
		}
		n += m
	}
	return n, nil
}

// done forgets a lane that ended, and logs why when it broke.
func (s *laneServer) done(sl *servedLane, err error) {
	s.mu.Lock()
	delete(s.lanes, sl)
	s.count[sl.verb]--
	closed := s.closed
	s.mu.Unlock()
	if err != nil && !closed && !errors.Is(err, net.ErrClosed) {
		s.log.Warn("a spawnrpc lane closed on an error", "verb", sl.verb, "error", err)
	}
	s.wg.Done()
}

// close ends every lane and waits for the calls on them.
func (s *laneServer) close() {
	s.mu.Lock()
	s.closed = true
	for sl := range s.lanes {
		sl.shut()
	}
	s.mu.Unlock()
	s.wg.Wait()
}

// LaneDialer opens a connection to spawnd that has passed its peer check
// and verdict, for a lane.
type LaneDialer func(ctx context.Context) (net.Conn, error)

// laneClient is the gateway's end of one verb's lanes: the idle ones it
// keeps open, one call at a time on each.
type laneClient[Req, Resp, C, R any] struct {
	spec   *laneSpec[Req, Resp, C, R]
	dial   LaneDialer
	slots  chan struct{} // MaxLaneCalls
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

func newLaneClient[Req, Resp, C, R any](spec *laneSpec[Req, Resp, C, R], dial LaneDialer) *laneClient[Req, Resp, C, R] {
	return &laneClient[Req, Resp, C, R]{spec: spec, dial: dial, slots: make(chan struct{}, MaxLaneCalls), open: map[*laneConn]struct{}{}}
}

// do runs one call: it is answered, or fails with ctx, or with
// codes.Unavailable when its lane cannot be opened or breaks.
func (l *laneClient[Req, Resp, C, R]) do(ctx context.Context, req *Req) (*Resp, error) {
	if err := ctx.Err(); err != nil {
		return nil, status.FromContextError(err).Err()
	}
	id := l.nextID.Add(1)
	msg := any(l.spec.call(id, req)).(vtMessage)
	if n := msg.SizeVT(); n > MaxLaneMessage {
		return nil, status.Errorf(codes.ResourceExhausted, "%s: the request is %d bytes, past the %d nexus-spawnd accepts", l.spec.name, n, MaxLaneMessage)
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
		return nil, status.Errorf(codes.Unavailable, "lost connection to nexus-spawnd: cannot open its %s lane (%v)", l.spec.name, err)
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
func (l *laneClient[Req, Resp, C, R]) exchange(lc *laneConn, id uint64, msg vtMessage) (_ *Resp, intact bool, _ error) {
	broke := func(err error) (*Resp, bool, error) {
		return nil, false, status.Errorf(codes.Unavailable, "lost connection to nexus-spawnd: its %s lane broke (%v)", l.spec.name, err)
	}
	if err := writeFrame(lc, msg); err != nil {
		return broke(err)
	}
	r, err := readFrame[R](lc.r)
	if err != nil {
		return broke(err)
	}
	got, resp, st := l.spec.parts(r)
	switch {
	case got != id:
		return nil, false, status.Errorf(codes.Internal, "nexus-spawnd answered %s call %d on the lane of call %d", l.spec.name, got, id)
	case len(st) > 0:
		return nil, true, decodeStatus(st)
	case resp == nil:
		return nil, true, status.Errorf(codes.Internal, "nexus-spawnd answered %s with neither a response nor a status", l.spec.name)
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
	if _, err := io.WriteString(conn, LanePreface(l.spec.name)); err != nil {
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
