package router

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/a2a"
	"github.com/nexus-broker/nexus-broker/internal/auth"
	"github.com/nexus-broker/nexus-broker/internal/cluster"
	"github.com/nexus-broker/nexus-broker/internal/gateway"
)

// An A2A conversation lives on the broker whose context index holds it
// (the ingress's doc says how a request finds it). This is the router's
// part: finding the broker an id names or the peer that holds it (answers
// reused for at most contextCacheFor), carrying a request there whole (or
// a stream event by event, stream.go) as the caller's principal, and
// asking every broker for its share of a ListTasks.

const contextCacheFor = time.Second

type contextAnswer struct {
	Mine bool `json:"mine"`
}

// httpCall is an HTTP request another broker carried, with the principal
// it authenticated.
type httpCall struct {
	Principal auth.Principal  `json:"principal"`
	Method    string          `json:"method"`
	Path      string          `json:"path"`
	Query     string          `json:"query,omitempty"`
	Header    http.Header     `json:"header,omitempty"`
	Body      json.RawMessage `json:"body,omitempty"`
}

type httpReply struct {
	Status int         `json:"status"`
	Header http.Header `json:"header,omitempty"`
	Body   []byte      `json:"body,omitempty"`
}

// forwardedHeaders are the request headers an A2A handler reads.
var forwardedHeaders = []string{"Content-Type", "Accept", "A2A-Version"}

// CarryA2A has owner answer an A2A request as p: whole, or (stream) event
// by event. refuse answers for an owner that does not answer.
func (rt *Router) CarryA2A(w http.ResponseWriter, r *http.Request, owner string, p auth.Principal, body []byte, stream bool, refuse func(http.ResponseWriter)) {
	call := httpCall{Principal: p, Method: r.Method, Path: r.URL.Path, Query: r.URL.RawQuery, Header: http.Header{}, Body: body}
	for _, k := range forwardedHeaders {
		if v := r.Header.Values(k); len(v) > 0 {
			call.Header[k] = v
		}
	}
	if stream {
		rt.carryStream(w, r, owner, call, refuse)
		return
	}
	var rep httpReply
	if err := rt.node.CallFor(r.Context(), rt.carriedTimeout(), owner, opHTTP, call, &rep); err != nil {
		rt.log.Warn("cluster: the conversation's broker did not answer", "owner", owner, "error", err)
		refuse(w)
		return
	}
	for k, v := range rep.Header {
		w.Header()[k] = v
	}
	w.WriteHeader(rep.Status)
	_, _ = w.Write(rep.Body)
}

// carriedTimeout bounds an A2A request carried whole to another broker: a
// SendMessage may wait for its instance to boot and its turn to end.
func (rt *Router) carriedTimeout() time.Duration {
	cfg := rt.core.Config()
	return cfg.ReadyTimeout.D() + cfg.MaxTurnDuration.D() + 30*time.Second
}

// A2AOwner is the broker that answers what q names when this one does not
// hold it, "" for this one; unsure when nobody can answer now. An id a
// broker minted names it: that broker answers, and while it cannot, nobody
// does; a task id naming a broker never heard from is the uniform
// not-found, answered here (a context id naming one is refused: the broker
// may be down since before this one started). Any other id is looked up
// on the peers.
func (rt *Router) A2AOwner(ctx context.Context, q gateway.A2AQuery) (string, bool) {
	n := rt.node
	id := q.Context
	if id == "" {
		id = q.Task
	}
	switch o := cluster.Owner(id); {
	case o == n.ID():
		return "", false
	case o != "" && n.Reachable(o):
		return o, false
	case o != "" && q.Task != "" && !n.Remembered(o):
		return "", false
	case o != "":
		return "", true
	}
	return rt.contextOwner(ctx, q)
}

// queryKey is the cache key of what q asks about, in its caller's scope.
func queryKey(q gateway.A2AQuery) string {
	if q.Task != "" {
		return q.Principal + "\x00" + q.Profile + "\x00task\x00" + q.Task
	}
	return q.Principal + "\x00" + q.Profile + "\x00" + q.Context
}

// contextOwner is the peer holding the conversation or task, "" for none;
// unsure when no peer that answered holds it but some did not answer. Only
// a sure answer is reused.
func (rt *Router) contextOwner(ctx context.Context, q gateway.A2AQuery) (owner string, unsure bool) {
	key := queryKey(q)
	if owner, ok := rt.ctxCache.get(key); ok {
		return owner, false
	}
	missing := askPeers(rt, ctx, opContext, q, func(peer string, a contextAnswer) {
		if a.Mine {
			owner = peer
		}
	})
	if owner == "" && len(missing) > 0 {
		return "", true
	}
	rt.ctxCache.put(key, owner)
	return owner, false
}

// answerContext is the owner's side of contextOwner.
func (rt *Router) answerContext(_ context.Context, _ string, body json.RawMessage) (any, error) {
	var q gateway.A2AQuery
	if err := json.Unmarshal(body, &q); err != nil {
		return nil, err
	}
	return contextAnswer{Mine: rt.core.HoldsA2A(q)}, nil
}

// serveCarried answers an HTTP request another broker carried, through this
// broker's own routes, as its principal.
func (rt *Router) serveCarried(ctx context.Context, from string, body json.RawMessage) (any, error) {
	req, err := carriedRequest(ctx, from, body)
	if err != nil {
		return nil, err
	}
	mux := rt.core.CarriedHandler()
	if mux == nil {
		return nil, errors.New("not serving yet")
	}
	rec := &bufferedResponse{header: http.Header{}}
	mux.ServeHTTP(rec, req)
	if rec.status == 0 {
		rec.status = http.StatusOK
	}
	return httpReply{Status: rec.status, Header: rec.header, Body: rec.body.Bytes()}, nil
}

// carriedRequest rebuilds an HTTP request another broker carried here, as
// the principal it authenticated.
func carriedRequest(ctx context.Context, from string, body json.RawMessage) (*http.Request, error) {
	var c httpCall
	if err := json.Unmarshal(body, &c); err != nil {
		return nil, err
	}
	req, err := http.NewRequestWithContext(gateway.Carried(ctx, c.Principal), c.Method, c.Path, bytes.NewReader(c.Body))
	if err != nil {
		return nil, err
	}
	req.URL.RawQuery = c.Query
	req.Header = c.Header
	req.RemoteAddr = "broker " + from
	return req, nil
}

// bufferedResponse keeps a response whole for the broker that carried the
// request.
type bufferedResponse struct {
	header http.Header
	status int
	body   bytes.Buffer
}

func (b *bufferedResponse) Header() http.Header { return b.header }
func (b *bufferedResponse) WriteHeader(status int) {
	if b.status == 0 {
		b.status = status
	}
}
func (b *bufferedResponse) Write(p []byte) (int, error) {
	b.WriteHeader(http.StatusOK)
	return b.body.Write(p)
}
func (b *bufferedResponse) Flush() {}

// --- ListTasks over every broker ----------------------------------------

const opTasks = "tasks"

type tasksAnswer struct {
	Tasks []a2a.Task `json:"tasks"`
	Total int        `json:"total"`
}

// GatherTasks asks every peer for its share of a ListTasks (a page of
// off..off+size needs no more than each broker's first off+size, q.Limit)
// and hands each to got; it returns the peers that did not answer.
func (rt *Router) GatherTasks(ctx context.Context, q gateway.TaskQuery, got func([]a2a.Task, int)) []string {
	return askPeers(rt, ctx, opTasks, q, func(_ string, a tasksAnswer) { got(a.Tasks, a.Total) })
}

// answerTasks is a peer's side of GatherTasks.
func (rt *Router) answerTasks(_ context.Context, _ string, body json.RawMessage) (any, error) {
	var q gateway.TaskQuery
	if err := json.Unmarshal(body, &q); err != nil {
		return nil, err
	}
	ts, total := rt.core.A2ATasks(q)
	return tasksAnswer{Tasks: ts, Total: total}, nil
}
