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

// LaneSpec says how one verb's requests and answers ride its lane.
type LaneSpec[Req, Resp, C, R any] struct {
	Name  string
	Call  func(id uint64, req *Req) *C                // the gateway's message
	Req   func(*C) (uint64, *Req)                     // spawnd reads it
	Reply func(id uint64, resp *Resp, st []byte) *R   // spawnd's answer
	Parts func(*R) (id uint64, resp *Resp, st []byte) // the gateway reads it
}

// SpawnLane is Spawn's lane.
var SpawnLane = LaneSpec[spawnpb.SpawnRequest, spawnpb.SpawnResponse, spawnpb.SpawnCall, spawnpb.SpawnReply]{
	Name: "Spawn",
	Call: func(id uint64, r *spawnpb.SpawnRequest) *spawnpb.SpawnCall {
		return &spawnpb.SpawnCall{CallId: id, Request: r}
	},
	Req: func(c *spawnpb.SpawnCall) (uint64, *spawnpb.SpawnRequest) { return c.GetCallId(), c.GetRequest() },
	Reply: func(id uint64, r *spawnpb.SpawnResponse, st []byte) *spawnpb.SpawnReply {
		return &spawnpb.SpawnReply{CallId: id, Response: r, Status: st}
	},
	Parts: func(r *spawnpb.SpawnReply) (uint64, *spawnpb.SpawnResponse, []byte) {
		return r.GetCallId(), r.GetResponse(), r.GetStatus()
	},
}

// RecordLane is Record's lane.
var RecordLane = LaneSpec[spawnpb.RecordRequest, spawnpb.RecordResponse, spawnpb.RecordCall, spawnpb.RecordReply]{
	Name: "Record",
	Call: func(id uint64, r *spawnpb.RecordRequest) *spawnpb.RecordCall {
		return &spawnpb.RecordCall{CallId: id, Request: r}
	},
	Req: func(c *spawnpb.RecordCall) (uint64, *spawnpb.RecordRequest) { return c.GetCallId(), c.GetRequest() },
	Reply: func(id uint64, r *spawnpb.RecordResponse, st []byte) *spawnpb.RecordReply {
		return &spawnpb.RecordReply{CallId: id, Response: r, Status: st}
	},
	Parts: func(r *spawnpb.RecordReply) (uint64, *spawnpb.RecordResponse, []byte) {
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

// Message is a spawnpb message as a lane writes it.
type Message interface {
	SizeVT() int
	MarshalToSizedBufferVT([]byte) (int, error)
}

// WriteFrame writes m as one frame, in one write.
func WriteFrame(w io.Writer, m Message) error {
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

// ReadFrame reads one frame and decodes its message. io.EOF is a close
// between frames.
func ReadFrame[M any](r io.Reader) (*M, error) {
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
func serveCalls[Req, Resp, C, R any](ctx context.Context, rw io.ReadWriter, spec *LaneSpec[Req, Resp, C, R],
	handle func(context.Context, *Req) (*Resp, error),
) error {
	r := bufio.NewReader(rw)
	for {
		c, err := ReadFrame[C](r)
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		id, req := spec.Req(c)
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
		if err := WriteFrame(rw, any(spec.Reply(id, resp, st)).(Message)); err != nil {
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

// DecodeStatus is encodeStatus's error back.
func DecodeStatus(b []byte) error {
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
	case LanePreface(SpawnLane.Name):
		verb = SpawnLane.Name
	case LanePreface(RecordLane.Name):
		verb = RecordLane.Name
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
	if verb == SpawnLane.Name {
		go s.serveSpawn(ctx, cancel, sl, conn)
	} else {
		go func() {
			err := serveCalls(ctx, conn, &RecordLane, s.v.Record)
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
	err = serveCalls(ctx, fdConn(fd), &SpawnLane, s.v.Spawn)
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
