package ingress

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/a2a"
	"github.com/nexus-broker/nexus-broker/internal/gateway"
)

// An A2A conversation lives on the broker whose context index holds it:
// its session is on that broker's host, and its tasks are in that
// broker's store. In cluster mode every task id, and every context id a
// broker mints, names that broker the way a lease id does (newID), so a
// request about one is sent to the broker it names without a lookup; any
// other id (a contextId the client chose, an id minted before cluster
// mode) is found by asking the peers (answers reused for at most
// contextCacheFor, in internal/cluster/router). The owner answers a
// stream event by event, anything else whole (the router carries both). A conversation no broker holds
// starts here, and so belongs to this broker, but only once every peer
// has said it is not theirs: while one does not answer, or the broker an
// id names does not, the request is refused with a2aOwnerUnavailable,
// never started here as a second conversation. A task no broker holds is
// the uniform not-found, answered here. ListTasks gathers every broker's.

// a2aOwnerUnavailable is owner loss as the A2A bindings say it, with the
// lease routes' text: JSON-RPC's implementation-defined server error
// (-32000, which a stock client reads as a server error) and, over
// HTTP+JSON, 503 UNAVAILABLE with the same SERVER_ERROR reason.
var a2aOwnerUnavailable = &a2a.Error{Code: -32000, HTTPStatus: http.StatusServiceUnavailable, Status: "UNAVAILABLE",
	Reason: "SERVER_ERROR", Message: gateway.TextOwnerUnavailable}

// newID mints a task id, or a context id for a message without one: in
// cluster mode it names this broker as a lease id does (crypto/rand does
// not fail), else it is an A2A UUID as in single-broker mode.
func (in *ingress) newID() string {
	if rt := in.peers(); rt != nil {
		id, _ := rt.NewLeaseID()
		return id
	}
	return a2a.NewID()
}

// peers is the cluster router, nil in single-broker mode.
func (in *ingress) peers() Peers {
	if rt := in.core.Cluster(); rt != nil {
		return rt
	}
	return nil
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
func (in *ingress) holdsCall(c gateway.A2AQuery) bool {
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
		rt := in.peers()
		if rt == nil || gateway.IsCarried(r) {
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
		who, ref := in.core.Identify(r)
		c := gateway.A2AQuery{Principal: who.ID, Profile: r.PathValue("name"), Context: target.context, Task: target.task}
		if ref != nil || in.profiles.Load().ByName[c.Profile] == nil || in.holdsCall(c) {
			h(w, r) // a refusal is answered (and audited) by the handler
			return
		}
		owner, unsure := rt.A2AOwner(r.Context(), c)
		if unsure {
			target.refuse(w, a2aOwnerUnavailable)
			return
		}
		if owner == "" {
			h(w, r)
			return
		}
		rt.CarryA2A(w, r, owner, who, body, target.stream, func(w http.ResponseWriter) { target.refuse(w, a2aOwnerUnavailable) })
	}
}

// --- ListTasks over every broker ----------------------------------------

// headerUnanswered names the brokers a ListTasks answer could not include:
// a header, since the A2A list's shape has no room for it.
const headerUnanswered = "Nexus-Unreachable-Brokers"

// gatherTasks adds every peer's share of a ListTasks to this broker's
// (mine, of total), newest change first, and names the peers that did not
// answer. A page of off..off+size needs no more than each broker's first
// off+size (c.Limit).
func (in *ingress) gatherTasks(ctx context.Context, c gateway.TaskQuery, mine []a2a.Task, total int) ([]a2a.Task, int, []string) {
	rt := in.peers()
	if rt == nil {
		return mine, total, nil
	}
	local := len(mine)
	missing := rt.GatherTasks(ctx, c, func(ts []a2a.Task, n int) {
		mine, total = append(mine, ts...), total+n
	})
	if len(mine) > local {
		slices.SortStableFunc(mine, func(a, b a2a.Task) int {
			return -compareTime(a.Status.Timestamp, b.Status.Timestamp)
		})
	}
	if len(missing) > 0 {
		in.log.Warn("ListTasks answered without the brokers that did not answer", "unreachable_brokers", strings.Join(missing, ","))
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

// unanswered names, in a ListTasks answer, the brokers it lacks.
func unanswered(w http.ResponseWriter, missing []string) {
	if len(missing) > 0 {
		w.Header().Set(headerUnanswered, strings.Join(missing, ","))
	}
}
