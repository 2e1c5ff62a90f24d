package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/a2a"
	"github.com/nexus-broker/nexus-broker/internal/auth"
	"github.com/nexus-broker/nexus-broker/internal/cluster"
)

// An A2A conversation lives on the broker whose context index holds it:
// its session is on that broker's host, and its tasks are in that
// broker's store. In cluster mode every task id, and every context id a
// broker mints, names that broker the way a lease id does (newID), so a
// request about one is sent to the broker it names without a lookup; any
// other id (a contextId the client chose, an id minted before cluster
// mode) is found by asking the peers (answers reused for at most
// contextCacheFor). The owner answers a stream event by event
// (a2a_stream.go), anything else whole. A conversation no broker holds
// starts here, and so belongs to this broker, but only once every peer
// has said it is not theirs: while one does not answer, or the broker an
// id names does not, the request is refused with a2aOwnerUnavailable,
// never started here as a second conversation. A task no broker holds is
// the uniform not-found, answered here. ListTasks gathers every broker's.

const contextCacheFor = time.Second

// a2aOwnerUnavailable is owner loss as the A2A bindings say it, with the
// lease routes' text: JSON-RPC's implementation-defined server error
// (-32000, which a stock client reads as a server error) and, over
// HTTP+JSON, 503 UNAVAILABLE with the same SERVER_ERROR reason.
var a2aOwnerUnavailable = &a2a.Error{Code: -32000, HTTPStatus: http.StatusServiceUnavailable, Status: "UNAVAILABLE",
	Reason: "SERVER_ERROR", Message: errOwnerUnavailable}

// newID mints a task id, or a context id for a message without one: in
// cluster mode it names this broker as a lease id does (crypto/rand does
// not fail), else it is an A2A UUID as in single-broker mode.
func (in *ingress) newID() string {
	if rt := in.g.rt; rt != nil {
		id, _ := cluster.NewLeaseID(rt.node.ID())
		return id
	}
	return a2a.NewID()
}

// contextCall asks a peer whether it holds a conversation (Context) or a
// task (Task), in the caller's scope.
type contextCall struct {
	Principal string `json:"principal"`
	Profile   string `json:"profile"`
	Context   string `json:"context,omitempty"`
	Task      string `json:"task,omitempty"`
}

func (c contextCall) key() string {
	if c.Task != "" {
		return convKey{c.Principal, c.Profile, "task\x00" + c.Task}.String()
	}
	return convKey{c.Principal, c.Profile, c.Context}.String()
}

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

type forwardedKey struct{}

// forwardedPrincipal is the principal of a request another broker
// authenticated and carried here (never set from the network).
func forwardedPrincipal(ctx context.Context) (auth.Principal, bool) {
	p, ok := ctx.Value(forwardedKey{}).(auth.Principal)
	return p, ok
}

// holds reports whether this broker's conversations include the context.
func (in *ingress) holds(principal, profile, context string) bool {
	key := convKey{principal, profile, context}
	in.mu.Lock()
	c := in.convs[key]
	in.mu.Unlock()
	if c != nil {
		return true
	}
	_, ok := in.contexts.Get(key.String())
	return ok
}

// holdsCall reports whether this broker holds what c asks about.
func (in *ingress) holdsCall(c contextCall) bool {
	if c.Task != "" {
		_, ok := in.store.Get(c.Principal, c.Profile, c.Task)
		return ok
	}
	return in.holds(c.Principal, c.Profile, c.Context)
}

// a2aTarget is what an A2A request is about, as far as finding the broker
// that answers it goes.
type a2aTarget struct {
	context, task string // the conversation, else the task, it names
	stream        bool   // answered as a stream of events
	rpc           bool   // a JSON-RPC request, of id rpcID
	rpcID         json.RawMessage
}

// refuse answers e as the request's binding does: a JSON-RPC error (a
// stream's as its one event), else an HTTP+JSON one.
func (t a2aTarget) refuse(w http.ResponseWriter, e *a2a.Error) {
	if t.rpc {
		writeRPCFail(w, t.rpcID, t.stream, e)
		return
	}
	writeRESTError(w, e)
}

// targetOf reads an A2A request's target: from the JSON-RPC method and
// params, the HTTP+JSON path, or a message's contextId (else taskId).
func targetOf(r *http.Request, body []byte) a2aTarget {
	if seg := r.PathValue("task"); seg != "" {
		id, verb, _ := strings.Cut(seg, ":")
		return a2aTarget{task: id, stream: verb == "subscribe"}
	}
	params, stream := json.RawMessage(body), strings.HasSuffix(r.URL.Path, ":stream")
	if strings.HasSuffix(r.URL.Path, "/a2a") {
		var req a2a.RPCRequest
		if json.Unmarshal(body, &req) != nil {
			return a2aTarget{}
		}
		rpc := a2aTarget{rpc: true, rpcID: req.ID}
		switch req.Method {
		case "GetTask", "CancelTask", "SubscribeToTask":
			var tr a2a.TaskRequest
			_ = json.Unmarshal(req.Params, &tr)
			rpc.task, rpc.stream = tr.ID, req.Method == "SubscribeToTask"
			return rpc
		case "SendMessage", "SendStreamingMessage":
			return sendTarget(rpc, req.Params, req.Method == "SendStreamingMessage")
		default:
			return a2aTarget{}
		}
	}
	return sendTarget(a2aTarget{}, params, stream)
}

// sendTarget completes t from a SendMessage request's params: its
// message's contextId, else its taskId.
func sendTarget(t a2aTarget, params json.RawMessage, stream bool) a2aTarget {
	var sr a2a.SendRequest
	if json.Unmarshal(params, &sr) != nil || sr.Message == nil {
		return a2aTarget{}
	}
	t.stream = stream
	if sr.Message.ContextID != "" {
		t.context = sr.Message.ContextID
	} else {
		t.task = sr.Message.TaskID
	}
	return t
}

// clustered serves an A2A route here unless (cluster mode) it is about a
// conversation or a task another broker holds: then that broker answers
// it, as the caller's principal.
func (in *ingress) clustered(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		g := in.g
		if _, carried := forwardedPrincipal(r.Context()); g.rt == nil || carried {
			h(w, r)
			return
		}
		body, err := io.ReadAll(http.MaxBytesReader(nil, r.Body, a2a.MaxBody))
		r.Body = io.NopCloser(io.MultiReader(bytes.NewReader(body), r.Body))
		target := targetOf(r, body)
		if err != nil || target.context == "" && target.task == "" {
			h(w, r)
			return
		}
		who, ref := g.auth.Authenticate(r)
		c := contextCall{Principal: who.ID, Profile: r.PathValue("name"), Context: target.context, Task: target.task}
		if ref != nil || in.profiles.Load().ByName[c.Profile] == nil || in.holdsCall(c) {
			h(w, r) // a refusal is answered (and audited) by the handler
			return
		}
		owner, aerr := in.ownerOf(r.Context(), c)
		if aerr != nil {
			target.refuse(w, aerr)
			return
		}
		if owner == "" {
			h(w, r)
			return
		}
		call := httpCall{Principal: who, Method: r.Method, Path: r.URL.Path, Query: r.URL.RawQuery, Header: http.Header{}, Body: body}
		for _, k := range forwardedHeaders {
			if v := r.Header.Values(k); len(v) > 0 {
				call.Header[k] = v
			}
		}
		if target.stream {
			g.carryStream(w, r, owner, call, target)
			return
		}
		var rep httpReply
		if err := g.rt.node.CallFor(r.Context(), g.carriedTimeout(), owner, opHTTP, call, &rep); err != nil {
			g.log.Warn("cluster: the conversation's broker did not answer", "owner", owner, "error", err)
			target.refuse(w, a2aOwnerUnavailable)
			return
		}
		for k, v := range rep.Header {
			w.Header()[k] = v
		}
		w.WriteHeader(rep.Status)
		_, _ = w.Write(rep.Body)
	}
}

// carriedTimeout bounds an A2A request carried whole to another broker: a
// SendMessage may wait for its instance to boot and its turn to end.
func (g *Gateway) carriedTimeout() time.Duration {
	cfg := g.cfg.Load()
	return cfg.ReadyTimeout.D() + cfg.MaxTurnDuration.D() + 30*time.Second
}

// ownerOf is the broker that answers what c names when this one does not
// hold it, "" for this one. An id a broker minted names it: that broker
// answers, and while it cannot, nobody does; a task id naming a broker
// never heard from is the uniform not-found, answered here (a context id
// naming one is refused: the broker may be down since before this one
// started). Any other id is looked up on the peers.
func (in *ingress) ownerOf(ctx context.Context, c contextCall) (string, *a2a.Error) {
	n := in.g.rt.node
	id := c.Context
	if id == "" {
		id = c.Task
	}
	switch o := cluster.Owner(id); {
	case o == n.ID():
		return "", nil
	case o != "" && n.Reachable(o):
		return o, nil
	case o != "" && c.Task != "" && !n.Known(o):
		return "", nil
	case o != "":
		return "", a2aOwnerUnavailable
	}
	owner, unsure := in.g.contextOwner(ctx, c)
	if unsure {
		return "", a2aOwnerUnavailable
	}
	return owner, nil
}

// contextOwner is the peer holding the conversation or task, "" for none;
// unsure when no peer that answered holds it but some did not answer. Only
// a sure answer is reused.
func (g *Gateway) contextOwner(ctx context.Context, c contextCall) (owner string, unsure bool) {
	key := c.key()
	if owner, ok := g.rt.ctxCache.get(key); ok {
		return owner, false
	}
	missing := askPeers(g, ctx, opContext, c, func(peer string, a contextAnswer) {
		if a.Mine {
			owner = peer
		}
	})
	if owner == "" && len(missing) > 0 {
		return "", true
	}
	g.rt.ctxCache.put(key, owner)
	return owner, false
}

// answerContext is the owner's side of contextOwner.
func (g *Gateway) answerContext(_ context.Context, _ string, body json.RawMessage) (any, error) {
	var c contextCall
	if err := json.Unmarshal(body, &c); err != nil {
		return nil, err
	}
	return contextAnswer{Mine: g.a2a != nil && g.a2a.holdsCall(c)}, nil
}

// serveCarried answers an HTTP request another broker carried, through this
// broker's own routes, as its principal.
func (g *Gateway) serveCarried(ctx context.Context, from string, body json.RawMessage) (any, error) {
	req, err := g.carriedRequest(ctx, from, body)
	if err != nil {
		return nil, err
	}
	mux := g.mux.Load()
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
func (g *Gateway) carriedRequest(ctx context.Context, from string, body json.RawMessage) (*http.Request, error) {
	var c httpCall
	if err := json.Unmarshal(body, &c); err != nil {
		return nil, err
	}
	req, err := http.NewRequestWithContext(context.WithValue(ctx, forwardedKey{}, c.Principal), c.Method, c.Path, bytes.NewReader(c.Body))
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

// headerUnanswered names the brokers a ListTasks answer could not include:
// a header, since the A2A list's shape has no room for it.
const headerUnanswered = "Nexus-Unreachable-Brokers"

type tasksCall struct {
	Principal string          `json:"principal"`
	Profile   string          `json:"profile"`
	Req       a2a.ListRequest `json:"req"`
	Limit     int             `json:"limit"`
}

type tasksAnswer struct {
	Tasks []a2a.Task `json:"tasks"`
	Total int        `json:"total"`
}

// gatherTasks adds every peer's share of a ListTasks to this broker's
// (mine, of total), newest change first, and names the peers that did not
// answer. A page of off..off+size needs no more than each broker's first
// off+size (c.Limit).
func (in *ingress) gatherTasks(ctx context.Context, c tasksCall, mine []a2a.Task, total int) ([]a2a.Task, int, []string) {
	local := len(mine)
	missing := askPeers(in.g, ctx, opTasks, c, func(_ string, a tasksAnswer) {
		mine, total = append(mine, a.Tasks...), total+a.Total
	})
	if len(mine) > local {
		slices.SortStableFunc(mine, func(a, b a2a.Task) int {
			return -compareTime(a.Status.Timestamp, b.Status.Timestamp)
		})
	}
	if len(missing) > 0 {
		in.g.log.Warn("ListTasks answered without the brokers that did not answer", "unreachable_brokers", strings.Join(missing, ","))
	}
	return mine, total, missing
}

// compareTime orders timestamps, a missing one first.
func compareTime(a, b *time.Time) int {
	switch {
	case a == nil && b == nil:
		return 0
	case a == nil:
		return -1
	case b == nil:
		return 1
	}
	return a.Compare(*b)
}

// answerTasks is a peer's side of gatherTasks.
func (g *Gateway) answerTasks(_ context.Context, _ string, body json.RawMessage) (any, error) {
	var c tasksCall
	if err := json.Unmarshal(body, &c); err != nil {
		return nil, err
	}
	if g.a2a == nil {
		return tasksAnswer{Tasks: []a2a.Task{}}, nil
	}
	ts, total := g.a2a.matching(c.Principal, c.Profile, &c.Req, c.Limit)
	return tasksAnswer{Tasks: ts, Total: total}, nil
}

// unanswered names, in a ListTasks answer, the brokers it lacks.
func unanswered(w http.ResponseWriter, missing []string) {
	if len(missing) > 0 {
		w.Header().Set(headerUnanswered, strings.Join(missing, ","))
	}
}
