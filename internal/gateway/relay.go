package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/auth"
	"github.com/nexus-broker/nexus-broker/internal/cluster"
	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/wire"
)

// Cluster ops: what one broker asks the owner of a lease.
const (
	opRelease = "release"
	opTicket  = "ticket"
	opAttach  = "attach"
	opRead    = "read"
	opSend    = "send"
	opDetach  = "detach"
	opLeases  = "leases"
	opClaim   = "claim"
	opCount   = "count"
	opContext = "context"
	opHTTP    = "http"
	opSession = "session"
	opResume  = "resume"
)

// Owner loss, as the HTTP routes and relayed sockets say it.
const (
	errOwnerUnavailable = "lease owner unavailable"
	codeTryAgainLater   = 1013
)

// relayIdle is how long an owner keeps a relayed connection nobody reads:
// the entry broker that carried it is gone.
const relayIdle = 10 * time.Second

// payloadOverhead is what a relay message's envelope and JSON take beside
// the frames it carries.
const payloadOverhead = 4 << 10

// minRelayBatch is the fewest bytes of frames a relay request or answer
// gathers, however small the NATS server's max_payload: the transport
// chunks what one NATS message cannot hold.
const minRelayBatch = 64 << 10

// relayBudget is how many bytes of frames one relay request or answer
// gathers: what one NATS message holds, or minRelayBatch. A single frame
// larger than it goes alone.
func (g *Gateway) relayBudget() int {
	return max(int(g.rt.node.MaxPayload())-payloadOverhead, minRelayBatch)
}

// relayBatch bounds the client messages read ahead and sent in one request.
const relayBatch = 64

// leaseCall is every owner-addressed request: the lease, and the caller's
// principal as the entry broker authenticated it.
type leaseCall struct {
	Lease     string         `json:"lease"`
	Principal auth.Principal `json:"principal"`
}

// httpAnswer is an owner's answer to a forwarded HTTP route.
type httpAnswer struct {
	Status int             `json:"status"`
	Body   json.RawMessage `json:"body"`
}

func answer(status int, v any) (httpAnswer, error) {
	raw, err := json.Marshal(v)
	return httpAnswer{Status: status, Body: raw}, err
}

// remoteOwner is the broker owning lease id when that is not this one.
func (g *Gateway) remoteOwner(id string) string {
	if g.rt == nil {
		return ""
	}
	if o := cluster.Owner(id); o != "" && o != g.rt.node.ID() {
		return o
	}
	return ""
}

// ownerDown answers 503 for a lease whose owner was heard and then
// stopped heartbeating. It reports false otherwise: the owner looks
// reachable, or has not been heard yet (membership may not have
// converged), and is asked directly.
func (g *Gateway) ownerDown(w http.ResponseWriter, owner string) bool {
	if g.rt.node.Known(owner) && !g.rt.node.Reachable(owner) {
		writeError(w, http.StatusServiceUnavailable, errOwnerUnavailable)
		return true
	}
	return false
}

// ownerFailed answers for a request the lease's owner did not answer: NATS
// saying nobody subscribes to the subjects of a broker never heard from is
// an ordinary unknown lease; anything else is 503.
func (g *Gateway) ownerFailed(w http.ResponseWriter, id, owner, op string, err error) {
	if errors.Is(err, cluster.ErrNoResponders) && !g.rt.node.Known(owner) {
		writeUnknownLease(w)
		return
	}
	g.log.Warn("cluster: the lease's owner did not answer", "lease_id", id, "owner", owner, "op", op, "error", err)
	writeError(w, http.StatusServiceUnavailable, errOwnerUnavailable)
}

// forward sends an HTTP route's request to the lease's owner and writes
// its answer.
func (g *Gateway) forward(w http.ResponseWriter, r *http.Request, owner, op string, p auth.Principal) {
	if g.ownerDown(w, owner) {
		return
	}
	var a httpAnswer
	if err := g.rt.node.Call(r.Context(), owner, op, leaseCall{Lease: r.PathValue("lease_id"), Principal: p}, &a); err != nil {
		g.ownerFailed(w, r.PathValue("lease_id"), owner, op, err)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(a.Status)
	_, _ = w.Write(append(a.Body, '\n'))
}

// ownerAnswer is a lease route as its owner answers it: status and body.
type ownerAnswer func(r *http.Request, id string, p auth.Principal) (int, any)

// ownerRoute serves a lease route here when this broker owns the lease (or
// in single-broker mode), else forwards it to the owner as op.
func (g *Gateway) ownerRoute(op string, local ownerAnswer) func(http.ResponseWriter, *http.Request, auth.Principal) {
	return func(w http.ResponseWriter, r *http.Request, p auth.Principal) {
		id := r.PathValue("lease_id")
		if owner := g.remoteOwner(id); owner != "" {
			g.forward(w, r, owner, op, p)
			return
		}
		st, v := local(r, id, p)
		writeJSON(w, st, v)
	}
}

// forwarded stands for a request another broker carried, for the audit
// line: the route, and the broker it came through as the peer.
func forwarded(method, path, from string) *http.Request {
	return &http.Request{Method: method, URL: &url.URL{Path: path}, RemoteAddr: "broker " + from}
}

// registerClusterOps is what this broker answers as an owner.
func (g *Gateway) registerClusterOps(n *cluster.Node) {
	for op, route := range map[string]ownerAnswer{opRelease: g.release, opTicket: g.ticket} {
		n.Handle(op, func(_ context.Context, from string, body json.RawMessage) (any, error) {
			var c leaseCall
			if err := json.Unmarshal(body, &c); err != nil {
				return nil, err
			}
			st, v := route(forwarded(http.MethodPost, "/"+op+"/"+c.Lease, from), c.Lease, c.Principal)
			return answer(st, v)
		})
	}
	n.Handle(opLeases, func(_ context.Context, _ string, body json.RawMessage) (any, error) {
		var c leaseCall
		if err := json.Unmarshal(body, &c); err != nil {
			return nil, err
		}
		return g.localLeases(c.Principal), nil
	})
	// Each deadline is read per request, so a SIGHUP's ready_timeout,
	// session_report_grace, queue_wait_timeout or max_turn_duration applies.
	n.HandleFor(opClaim, g.offerTimeout, g.takeOffer)
	n.HandleFor(opResume, g.resumeTimeout, g.takeResume)
	n.Handle(opSession, g.answerSession)
	n.Handle(opCount, func(_ context.Context, _ string, body json.RawMessage) (any, error) {
		var c countCall
		err := json.Unmarshal(body, &c)
		return countAnswer{Leases: g.localCount(c.Principal)}, err
	})
	n.Handle(opContext, g.answerContext)
	n.HandleFor(opHTTP, g.carriedTimeout, g.serveCarried)
	n.Handle(opStreamOpen, g.openStream)
	n.Handle(opStreamRead, g.readStream)
	n.Handle(opStreamClose, g.closeStream)
	n.Handle(opTasks, g.answerTasks)
	n.Handle(opAttach, g.relayAttach)
	n.Handle(opRead, g.relayRead)
	n.Handle(opSend, g.relaySend)
	n.Handle(opDetach, g.relayDetach)
}

// --- the owner's side of a relayed WebSocket ----------------------------------

func (g *Gateway) relayClient(w http.ResponseWriter, r *http.Request, owner, id string) {
	a := attachCall{leaseCall: leaseCall{Lease: id}, FromSeq: -1}
	if g.auth.Enabled() {
		if c := auth.Extract(r, true); c.Ticket != "" {
			a.Ticket = c.Ticket
		} else {
			p, ok := g.Authenticate(w, r)
			if !ok {
				return
			}
			a.Principal = p
		}
	}
	if v := r.URL.Query().Get("from_seq"); v != "" {
		if n, err := strconv.ParseUint(v, 10, 63); err == nil {
			a.FromSeq = int64(n)
		}
	}
	if g.ownerDown(w, owner) {
		return
	}
	var ans attachAnswer
	if err := g.rt.node.Call(r.Context(), owner, opAttach, a, &ans); err != nil {
		g.ownerFailed(w, id, owner, opAttach, err)
		return
	}
	if ans.Status != http.StatusOK {
		writeError(w, ans.Status, ans.Error)
		return
	}
	conn, err := wire.Upgrader.Upgrade(w, r, nil)
	if err != nil {
		g.logAcceptFailed("client", r, err)
		g.detachRelay(owner, id, ans.Conn)
		return
	}
	g.log.Info("client connected; relaying to the lease's owner", "lease_id", id, "owner", owner)
	go g.serveRelay(wire.NewConn(conn, g.log, "client", id), owner, id, ans)
}

// serveRelay pumps one relayed socket until either side ends it: reads
// from the owner's stream log with the client's cursor on this goroutine,
// client messages sent one at a time on another.
func (g *Gateway) serveRelay(ws *wire.Conn, owner, id string, ans attachAnswer) {
	ctx, cancel := context.WithCancel(g.ctx)
	defer cancel()
	var once sync.Once
	end := func(code int, reason string, graceful bool) {
		once.Do(func() {
			if graceful {
				ws.CloseGraceful(code, reason)
			} else {
				ws.CloseNow(code, reason)
			}
		})
		cancel()
	}
	lost := func(op string, err error) {
		if ctx.Err() == nil {
			g.log.Warn("cluster: lost the lease's owner while relaying; closing the client", "lease_id", id, "owner", owner, "op", op, "error", err)
			end(codeTryAgainLater, errOwnerUnavailable, false)
		}
	}
	// The client's messages are read ahead into a bounded queue (when it is
	// full the client's socket is not read: backpressure) and sent in
	// order, as many as one NATS message holds per request (base64 in its
	// JSON); one larger than that goes alone, chunked by the transport.
	budget := g.relayBudget() * 3 / 4
	msgs := make(chan []byte, relayBatch)
	go func() {
		defer close(msgs)
		for {
			data, err := ws.Read()
			if err != nil {
				return
			}
			select {
			case msgs <- data:
			case <-ctx.Done():
				return
			}
		}
	}()
	go func() {
		defer cancel()
		send := func(call relayCall) bool {
			var out relayAnswer
			if err := g.rt.node.Call(ctx, owner, opSend, call, &out); err != nil {
				lost(opSend, err)
				return false
			}
			if out.Close != nil {
				g.endRelayed(ws, out.Close, &once, cancel)
				return false
			}
			return true
		}
		var next []byte
		for {
			data := next
			if data == nil {
				var ok bool
				if data, ok = <-msgs; !ok {
					return
				}
			}
			next = nil
			batch, size := [][]byte{data}, len(data)
		fill:
			for len(batch) < relayBatch {
				select {
				case d, ok := <-msgs:
					if !ok {
						break fill
					}
					if size+len(d) > budget {
						next = d
						break fill
					}
					batch, size = append(batch, d), size+len(d)
				default:
					break fill
				}
			}
			if !send(relayCall{Lease: id, Conn: ans.Conn, Msgs: batch}) {
				return
			}
		}
	}()
	after := ans.After
	for ctx.Err() == nil {
		var out relayAnswer
		if err := g.rt.node.Call(ctx, owner, opRead, relayCall{Lease: id, Conn: ans.Conn, After: after}, &out); err != nil {
			lost(opRead, err)
			break
		}
		for _, f := range out.Frames {
			if ws.Write(f) != nil {
				cancel()
			}
		}
		if len(out.Frames) > 0 {
			after = out.Last
		}
		if out.Close != nil {
			g.endRelayed(ws, out.Close, &once, cancel)
			break
		}
	}
	g.detachRelay(owner, id, ans.Conn)
	ws.Finish()
	g.log.Info("client disconnected", "lease_id", id, "owner", owner)
}

// endRelayed closes the client as the owner said.
func (g *Gateway) endRelayed(ws *wire.Conn, c *closeReq, once *sync.Once, cancel context.CancelFunc) {
	once.Do(func() {
		if c.Code == wire.CodeSuperseded {
			ws.CloseNow(c.Code, c.Reason)
		} else {
			ws.CloseGraceful(c.Code, c.Reason)
		}
	})
	cancel()
}

// detachRelay tells the owner the client is gone (best effort: an owner
// that does not hear it drops the connection after relayIdle).
func (g *Gateway) detachRelay(owner, id, conn string) {
	ctx, cancel := context.WithTimeout(context.Background(), cluster.CallTimeout)
	defer cancel()
	_ = g.rt.node.Call(ctx, owner, opDetach, relayCall{Lease: id, Conn: conn}, nil)
}
