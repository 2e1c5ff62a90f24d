package ingress

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"

	"github.com/nexus-broker/nexus-broker/internal/a2a"
	"github.com/nexus-broker/nexus-broker/internal/gateway"
	"github.com/nexus-broker/nexus-broker/internal/gateway/reply"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// Default and largest ListTasks page.
const (
	defaultPageSize = 50
	maxPageSize     = 100
)

const errUnknownProfile = "unknown agent profile"

// logBoot states the ingress at boot in upstream's lines: the ingress,
// the task retention in force (the store is durable with a dir), and one
// line per profile naming its binary, its config and the URLs it publishes.
// The base URL is never empty: agents: needs advertise_addr or an
// explicit listen host.
func (in *ingress) logBoot(ps *a2a.Profiles, dir string) {
	base := in.core.BaseURL()
	in.log.Info("a2a ingress enabled", "profiles", len(ps.ByName), "base_url", base)
	t := in.boot.A2A.Tasks
	in.log.Info("a2a task retention", "state_dir", dir, "durable", dir != "", "ttl", t.TTL.D(), "max_per_context", t.MaxPerContext,
		"max_tasks", a2a.MaxTasks, "input_timeout", t.InputTimeout.D(), "max_store_bytes", t.MaxStoreBytes)
	for _, n := range ps.Names() {
		p, root := ps.ByName[n], a2a.AgentRoot(base, n)
		in.log.Info("a2a agent profile", "name", n, "binary", p.Entry, "config", p.Path,
			"agent_card", root+"/.well-known/agent-card.json", "jsonrpc", root+"/a2a", "rest", root+"/a2a/v1")
	}
}

// --- routes ---------------------------------------------------------------

// restRoot is the pattern of every HTTP+JSON path no route names.
const restRoot = "/agents/{name}/a2a/v1/{rest...}"

func (in *ingress) routes(mux *http.ServeMux) {
	in.mux = mux
	mux.HandleFunc(restRoot, in.restUnmatched)
	mux.HandleFunc("GET /agents/{name}/.well-known/agent-card.json", in.handleCard)
	mux.HandleFunc("GET /agents/{name}", in.redirectCard)
	mux.HandleFunc("GET /agents/{name}/{$}", in.redirectCard)
	mux.HandleFunc("GET /agents/.well-known/agent-card.json", in.handleSoleCard)
	mux.HandleFunc("POST /agents/{name}/a2a", in.clustered(in.handleJSONRPC))
	mux.HandleFunc("POST /agents/{name}/a2a/v1/message:send", in.clustered(in.restSend))
	mux.HandleFunc("POST /agents/{name}/a2a/v1/message:stream", in.clustered(in.restStream))
	mux.HandleFunc("GET /agents/{name}/a2a/v1/tasks", in.restList)
	mux.HandleFunc("GET /agents/{name}/a2a/v1/tasks/{task}", in.clustered(in.restTask))
	mux.HandleFunc("POST /agents/{name}/a2a/v1/tasks/{task}", in.clustered(in.restTask))
	mux.HandleFunc("GET /agents/{name}/a2a/v1/tasks/{task}/pushNotificationConfigs", in.restPush)
	mux.HandleFunc("POST /agents/{name}/a2a/v1/tasks/{task}/pushNotificationConfigs", in.restPush)
	mux.HandleFunc("GET /agents/{name}/a2a/v1/tasks/{task}/pushNotificationConfigs/{config}", in.restPush)
	mux.HandleFunc("DELETE /agents/{name}/a2a/v1/tasks/{task}/pushNotificationConfigs/{config}", in.restPush)
	mux.HandleFunc("GET /agents/{name}/a2a/v1/extendedAgentCard", in.restExtendedCard)
}

// binding is the shape a route answers a refusal in.
type binding int

const (
	cardRoute binding = iota // the broker's {"error": "..."}
	rpcRoute                 // a JSON-RPC error
	restRoute                // a google.rpc.Status
)

// caller authenticates the request (the same guard as /claim, the card
// included) and resolves its profile, answering the refusal itself when
// either fails. Without an auth: block every caller is the anonymous
// principal. An unknown profile is a 404 in the binding's own shape (so an
// A2A client can parse it) and a WARN naming the name asked for, as
// upstream answers and logs it.
func (in *ingress) caller(w http.ResponseWriter, r *http.Request, b binding) (string, *a2a.Profile, bool) {
	who, ok := in.core.Authenticate(w, r)
	if !ok {
		return "", nil, false
	}
	if b != cardRoute {
		w.Header().Set("A2A-Version", a2a.ProtocolVersion) // on every binding's answer, as upstream's
	}
	name := r.PathValue("name")
	p := in.profiles.Load().ByName[name]
	if p == nil {
		in.log.Warn("a2a request for an unknown agent profile", "route", r.Pattern, "profile", name, "path", r.URL.Path)
		e := a2a.ErrMethodNotFound.With("%s: no A2A agent is mounted at %s", errUnknownProfile, r.URL.Path)
		switch b {
		case rpcRoute:
			reply.JSON(w, http.StatusNotFound, a2a.RPCFail(nil, e))
		case restRoute:
			writeRESTError(w, e)
		default:
			reply.Error(w, http.StatusNotFound, errUnknownProfile)
		}
		return "", nil, false
	}
	return who.ID, p, true
}

// handleCard serves a card (GET and HEAD) with upstream's validators: an
// ETag of its content and a five-minute max-age, a matching If-None-Match
// answering 304.
func (in *ingress) handleCard(w http.ResponseWriter, r *http.Request) {
	_, p, ok := in.caller(w, r, cardRoute)
	if !ok {
		return
	}
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("ETag", p.ETag)
	h.Set("Cache-Control", "public, max-age=300")
	if m := r.Header.Get("If-None-Match"); m != "" && a2a.ETagMatches(m, p.ETag) {
		w.WriteHeader(http.StatusNotModified)
		return
	}
	_, _ = w.Write(p.Card)
}

// redirectCard sends a profile's URL, with or without its trailing slash,
// to the profile's card.
func (in *ingress) redirectCard(w http.ResponseWriter, r *http.Request) {
	if _, _, ok := in.caller(w, r, cardRoute); ok {
		http.Redirect(w, r, "/agents/"+r.PathValue("name")+"/.well-known/agent-card.json", http.StatusPermanentRedirect)
	}
}

// handleSoleCard is where a client resolving the well-known name against a
// profile URL without its trailing slash looks (/agents/support resolves
// to /agents/.well-known/agent-card.json, as the JS SDK's createFromUrl
// does): the card when one profile is mounted. With several, that request
// cannot say which, so the 404 names them and the URL form that works.
func (in *ingress) handleSoleCard(w http.ResponseWriter, r *http.Request) {
	names := in.profiles.Load().Names()
	if len(names) != 1 {
		if _, ok := in.core.Authenticate(w, r); ok {
			reply.Error(w, http.StatusNotFound, fmt.Sprintf("%s: this broker mounts %d agent profiles (%s); resolve the card against a profile URL with its trailing slash, /agents/<name>/",
				errUnknownProfile, len(names), strings.Join(names, ", ")))
		}
		return
	}
	r.SetPathValue("name", names[0])
	in.handleCard(w, r)
}

// send starts (or answers) a task. With stream the returned stream carries
// its events from its snapshot on.
func (in *ingress) send(principal string, p *a2a.Profile, req *a2a.SendRequest, stream bool) (*liveTask, *a2a.Stream, *a2a.Error) {
	text, aerr := a2a.CheckSend(req)
	if aerr != nil {
		return nil, nil, aerr
	}
	if req.Message.TaskID != "" {
		t, aerr := in.answer(principal, p.Name, req.Message, text)
		if aerr != nil {
			return nil, nil, aerr
		}
		var s *a2a.Stream
		if stream {
			in.mu.Lock()
			s = in.subscribeLocked(t)
			in.mu.Unlock()
		}
		return t, s, nil
	}
	if aerr := in.refuseOversize(nil, brokerframe.IO{Type: brokerframe.IOInput, Content: text}); aerr != nil {
		return nil, nil, aerr
	}
	t, s := in.submit(principal, p.Name, req.Message, text, stream)
	return t, s, nil
}

// list is ListTasks: newest change first, paged by offset. In cluster
// mode it is every broker's that answered; the others are returned.
func (in *ingress) list(ctx context.Context, principal string, p *a2a.Profile, req *a2a.ListRequest) (*a2a.ListResponse, []string, *a2a.Error) {
	size := req.PageSize
	switch {
	case size == 0:
		size = defaultPageSize
	case size < 0 || size > maxPageSize:
		return nil, nil, a2a.InvalidField("pageSize", "must be between 1 and %d, got %d", maxPageSize, size)
	}
	if req.Status != "" && !a2a.KnownState(req.Status) {
		return nil, nil, a2a.InvalidField("status", "unknown task state %q", req.Status)
	}
	if bad := a2a.NonNegative(req.HistoryLength, "historyLength"); bad != nil {
		return nil, nil, bad
	}
	off := 0
	if req.PageToken != "" {
		n, err := strconv.Atoi(req.PageToken)
		if err != nil || n < 0 {
			return nil, nil, a2a.InvalidField("pageToken", "must be a nextPageToken returned by a previous ListTasks call")
		}
		off = n
	}
	ts, total := in.matching(principal, p.Name, req, off+size)
	ts, total, missing := in.gatherTasks(ctx, gateway.TaskQuery{Principal: principal, Profile: p.Name, Req: *req, Limit: off + size}, ts, total)
	out := &a2a.ListResponse{Tasks: []a2a.Task{}, TotalSize: total, PageSize: size}
	for i := off; i < len(ts) && i < off+size; i++ {
		out.Tasks = append(out.Tasks, ts[i])
	}
	if off+size < total {
		out.NextPageToken = strconv.Itoa(off + size)
	}
	return out, missing, nil
}

// matching is the first limit of principal's tasks on profile that req
// selects, newest change first, trimmed as req asks, and how many it
// selects in all.
func (in *ingress) matching(principal, profile string, req *a2a.ListRequest, limit int) ([]a2a.Task, int) {
	rs := in.store.List(principal, profile, func(r *a2a.Record) bool {
		t := r.Task
		return (req.ContextID == "" || t.ContextID == req.ContextID) &&
			(req.Status == "" || t.Status.State == req.Status) &&
			(req.StatusTimestampAfter == nil || t.Status.Timestamp == nil || t.Status.Timestamp.After(*req.StatusTimestampAfter))
	})
	out := make([]a2a.Task, 0, min(len(rs), limit))
	for _, r := range rs[:min(len(rs), limit)] {
		t := r.Task
		a2a.TrimTask(&t, req.HistoryLength, req.IncludeArtifacts)
		out = append(out, t)
	}
	return out, len(rs)
}

// matchingQuery is matching for another broker's ListTasks.
func (in *ingress) matchingQuery(q gateway.TaskQuery) ([]a2a.Task, int) {
	return in.matching(q.Principal, q.Profile, &q.Req, q.Limit)
}

// get is GetTask, from the record.
func (in *ingress) get(principal string, p *a2a.Profile, req *a2a.TaskRequest) (*a2a.Task, *a2a.Error) {
	if bad := a2a.NonNegative(req.HistoryLength, "historyLength"); bad != nil {
		return nil, bad
	}
	r, ok := in.store.Get(principal, p.Name, req.ID)
	if !ok {
		return nil, a2a.TaskNotFound(req.ID)
	}
	a2a.TrimTask(&r.Task, req.HistoryLength, true)
	return &r.Task, nil
}

// --- SSE ------------------------------------------------------------------

// sse serves a task's stream (see a2a.Stream) until it ends or the client
// goes away, then stop detaches it; frame renders one event's data line.
func sse(w http.ResponseWriter, r *http.Request, s *a2a.Stream, stop func(), frame func(a2a.Event) []byte) {
	defer stop()
	streamTo(w, r, s, frame)
}

// streamTo serves s over the connection r came on, measuring its send
// room as the core's sockets do.
func streamTo(w http.ResponseWriter, r *http.Request, s *a2a.Stream, frame func(a2a.Event) []byte) {
	conn, room := gateway.StreamConn(r)
	s.Serve(w, r, frame, conn, room)
}
