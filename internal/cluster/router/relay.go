package router

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/auth"
	"github.com/nexus-broker/nexus-broker/internal/cluster"
	"github.com/nexus-broker/nexus-broker/internal/gateway"
	"github.com/nexus-broker/nexus-broker/internal/gateway/reply"
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

// codeTryAgainLater closes a relayed client whose owner was lost.
const codeTryAgainLater = 1013

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
func (rt *Router) relayBudget() int {
	return max(int(rt.node.MaxPayload())-payloadOverhead, minRelayBatch)
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

// ownerDown answers 503 for a lease whose owner was heard and then
// stopped heartbeating. It reports false otherwise: the owner looks
// reachable, or has not been heard yet (membership may not have
// converged), and is asked directly.
func (rt *Router) ownerDown(w http.ResponseWriter, owner string) bool {
	if rt.node.Known(owner) && !rt.node.Reachable(owner) {
		reply.Error(w, http.StatusServiceUnavailable, gateway.TextOwnerUnavailable)
		return true
	}
	return false
}

// ownerFailed answers for a request the lease's owner did not answer: NATS
// saying nobody subscribes to the subjects of a broker neither heard since
// boot nor in the membership record is an ordinary unknown lease; anything
// else is 503.
func (rt *Router) ownerFailed(w http.ResponseWriter, id, owner, op string, err error) {
	if errors.Is(err, cluster.ErrNoResponders) && !rt.node.Remembered(owner) {
		reply.Error(w, http.StatusNotFound, gateway.TextUnknownLease)
		return
	}
	rt.log.Warn("cluster: the lease's owner did not answer", "lease_id", id, "owner", owner, "op", op, "error", err)
	reply.Error(w, http.StatusServiceUnavailable, gateway.TextOwnerUnavailable)
}

// ForwardLease sends an HTTP lease route's request to the lease's owner
// and writes its answer.
func (rt *Router) ForwardLease(w http.ResponseWriter, r *http.Request, owner, op string, p auth.Principal) {
	if rt.ownerDown(w, owner) {
		return
	}
	var a httpAnswer
	if err := rt.node.Call(r.Context(), owner, op, leaseCall{Lease: r.PathValue("lease_id"), Principal: p}, &a); err != nil {
		rt.ownerFailed(w, r.PathValue("lease_id"), owner, op, err)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(a.Status)
	_, _ = w.Write(append(a.Body, '\n'))
}

// registerOps is what this broker answers as an owner.
func (rt *Router) registerOps() {
	n := rt.node
	for op, route := range map[string]func(*http.Request, string, auth.Principal) (int, any){opRelease: rt.core.Release, opTicket: rt.core.Ticket} {
		n.Handle(op, func(_ context.Context, from string, body json.RawMessage) (any, error) {
			var c leaseCall
			if err := json.Unmarshal(body, &c); err != nil {
				return nil, err
			}
			return answer(route(gateway.Forwarded(http.MethodPost, "/"+op+"/"+c.Lease, from), c.Lease, c.Principal))
		})
	}
	n.Handle(opLeases, func(_ context.Context, _ string, body json.RawMessage) (any, error) {
		var c leaseCall
		if err := json.Unmarshal(body, &c); err != nil {
			return nil, err
		}
		return rt.core.LocalLeases(c.Principal), nil
	})
	// Each deadline is read per request, so a SIGHUP's ready_timeout,
	// session_report_grace, queue_wait_timeout or max_turn_duration applies.
	n.HandleFor(opClaim, rt.acceptWait, rt.takeOffer)
	n.HandleFor(opClaimed, rt.offerTimeout, rt.answerClaimed)
	n.HandleFor(opResume, rt.resumeTimeout, rt.takeResume)
	n.Handle(opSession, rt.answerSession)
	n.Handle(opCount, func(_ context.Context, _ string, body json.RawMessage) (any, error) {
		var c countCall
		err := json.Unmarshal(body, &c)
		return countAnswer{Leases: rt.core.LocalCount(c.Principal)}, err
	})
	n.Handle(opContext, rt.answerContext)
	n.HandleFor(opHTTP, rt.carriedTimeout, rt.serveCarried)
	n.Handle(opStreamOpen, rt.openStream)
	n.Handle(opStreamRead, rt.readStream)
	n.Handle(opStreamClose, rt.closeStream)
	n.Handle(opTasks, rt.answerTasks)
	n.Handle(opAttach, rt.relayAttach)
	n.Handle(opRead, rt.relayRead)
	n.Handle(opSend, rt.relaySend)
	n.Handle(opDetach, rt.relayDetach)
}

// --- the entry broker's side ----------------------------------------------------

// RelayClient serves WS /lease/{id} for a lease another broker owns: the
// credential is checked there (a ticket is redeemed where it was minted),
// and the socket is relayed through NATS.
func (rt *Router) RelayClient(w http.ResponseWriter, r *http.Request, owner, id string) {
	a := attachCall{leaseCall: leaseCall{Lease: id}, FromSeq: -1}
	if rt.core.AuthEnabled() {
		if c := auth.Extract(r, true); c.Ticket != "" {
			a.Ticket = c.Ticket
		} else {
			p, ok := rt.core.Authenticate(w, r)
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
	if rt.ownerDown(w, owner) {
		return
	}
	var ans attachAnswer
	if err := rt.node.Call(r.Context(), owner, opAttach, a, &ans); err != nil {
		rt.ownerFailed(w, id, owner, opAttach, err)
		return
	}
	if ans.Status != http.StatusOK {
		reply.Error(w, ans.Status, ans.Error)
		return
	}
	ws, ok := rt.core.UpgradeClient(w, r, id)
	if !ok {
		rt.detachRelay(owner, id, ans.Conn)
		return
	}
	rt.log.Info("client connected; relaying to the lease's owner", "lease_id", id, "owner", owner)
	go rt.serveRelay(ws, owner, id, ans)
}

// serveRelay pumps one relayed socket until either side ends it: reads
// from the owner's stream log with the client's cursor on this goroutine,
// client messages sent one at a time on another.
func (rt *Router) serveRelay(ws *gateway.ClientSocket, owner, id string, ans attachAnswer) {
	ctx, cancel := context.WithCancel(rt.core.Context())
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
			rt.log.Warn("cluster: lost the lease's owner while relaying; closing the client", "lease_id", id, "owner", owner, "op", op, "error", err)
			end(codeTryAgainLater, gateway.TextOwnerUnavailable, false)
		}
	}
	// The client's messages are read ahead into a bounded queue (when it is
	// full the client's socket is not read: backpressure) and sent in
	// order, as many as one NATS message holds per request (base64 in its
	// JSON); one larger than that goes alone, chunked by the transport.
	budget := rt.relayBudget() * 3 / 4
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
			if err := rt.node.Call(ctx, owner, opSend, call, &out); err != nil {
				lost(opSend, err)
				return false
			}
			if out.Close != nil {
				endRelayed(ws, out.Close, &once, cancel)
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
		if err := rt.node.Call(ctx, owner, opRead, relayCall{Lease: id, Conn: ans.Conn, After: after}, &out); err != nil {
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
			endRelayed(ws, out.Close, &once, cancel)
			break
		}
	}
	rt.detachRelay(owner, id, ans.Conn)
	ws.Finish()
	rt.log.Info("client disconnected", "lease_id", id, "owner", owner)
}

// endRelayed closes the client as the owner said.
func endRelayed(ws *gateway.ClientSocket, c *gateway.CloseReq, once *sync.Once, cancel context.CancelFunc) {
	once.Do(func() {
		if c.Code == gateway.CodeSuperseded {
			ws.CloseNow(c.Code, c.Reason)
		} else {
			ws.CloseGraceful(c.Code, c.Reason)
		}
	})
	cancel()
}

// detachRelay tells the owner the client is gone (best effort: an owner
// that does not hear it drops the connection after relayIdle).
func (rt *Router) detachRelay(owner, id, conn string) {
	ctx, cancel := context.WithTimeout(context.Background(), cluster.CallTimeout)
	defer cancel()
	_ = rt.node.Call(ctx, owner, opDetach, relayCall{Lease: id, Conn: conn}, nil)
}
