package ingress

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/a2a"
	"github.com/nexus-broker/nexus-broker/internal/gateway/reply"
)

// The two A2A bindings over one ingress: JSON-RPC 2.0 at /agents/{name}/a2a
// and HTTP+JSON under /agents/{name}/a2a/v1. Streams are SSE on both.

// writeRPCFail answers a JSON-RPC request of id with e: on a stream as its
// one SSE event, since the client reads a stream's answer from SSE data
// lines only.
func writeRPCFail(w http.ResponseWriter, id json.RawMessage, stream bool, e *a2a.Error) {
	resp := a2a.RPCFail(id, e)
	if stream {
		data, _ := json.Marshal(resp)
		writeSSEOnce(w, data)
		return
	}
	reply.JSON(w, http.StatusOK, resp)
}

var pushMethods = map[string]bool{
	"CreateTaskPushNotificationConfig": true, "GetTaskPushNotificationConfig": true,
	"ListTaskPushNotificationConfigs": true, "DeleteTaskPushNotificationConfig": true,
}

// handleJSONRPC is POST /agents/{name}/a2a.
func (in *ingress) handleJSONRPC(w http.ResponseWriter, r *http.Request) {
	principal, p, ok := in.caller(w, r, rpcRoute)
	if !ok {
		return
	}
	body, aerr, _ := a2a.ReadBody(r)
	if aerr != nil {
		reply.JSON(w, http.StatusOK, a2a.RPCFail(nil, aerr))
		return
	}
	// The envelope's refusals are upstream's, in its order: not JSON, not
	// an envelope, the jsonrpc version, the method; and ours, an id that
	// is neither a string nor a number.
	req, sent, err := a2a.DecodeRPC(body)
	var bad *a2a.Error
	switch {
	case err != nil && !json.Valid(body):
		bad = a2a.ErrParse.With("Invalid JSON payload")
	case err != nil:
		bad = a2a.ErrInvalidRequest.With("malformed JSON-RPC envelope: %v", err)
	case req.JSONRPC != "2.0":
		bad = a2a.InvalidEnvelope("jsonrpc", "must be %q, got %q", "2.0", req.JSONRPC)
	case req.Method == "":
		bad = a2a.InvalidEnvelope("method", "must be a non-empty A2A operation name")
	case !a2a.ValidRPCID(req.ID):
		bad = a2a.InvalidEnvelope("id", "must be a string, a number or null")
	}
	if bad != nil {
		if err != nil || !a2a.ValidRPCID(req.ID) {
			req.ID = nil
		}
		reply.JSON(w, http.StatusOK, a2a.RPCFail(req.ID, bad))
		return
	}
	stream := req.Method == "SendStreamingMessage" || req.Method == "SubscribeToTask"
	fail := func(e *a2a.Error) { writeRPCFail(w, req.ID, stream, e) }
	if e := a2a.VersionOK(r); e != nil {
		fail(e)
		return
	}
	// params decodes the operation's parameters, refused as upstream's
	// codec refuses them.
	params := func(v any) bool {
		if len(req.Params) == 0 || string(bytes.TrimSpace(req.Params)) == "null" {
			fail(a2a.InvalidField("params", "%s requires a parameter object", req.Method))
			return false
		}
		if err := json.Unmarshal(req.Params, v); err != nil {
			fail(a2a.ErrInvalidParams.With("decode %s params: %v", req.Method, err))
			return false
		}
		return true
	}
	// taskParams is params for the operations naming a task by id.
	taskParams := func(tr *a2a.TaskRequest) bool {
		if !params(tr) {
			return false
		}
		if tr.ID == "" {
			fail(a2a.InvalidField("id", "task id is required"))
			return false
		}
		return true
	}
	switch req.Method {
	case "SendMessage", "SendStreamingMessage":
		sr := sent
		if sr == nil {
			sr = new(a2a.SendRequest)
			if !params(sr) {
				return
			}
		}
		t, s, aerr := in.send(principal, p, sr, stream)
		if aerr != nil {
			fail(aerr)
			return
		}
		if stream {
			sse(w, r, s, func() { in.unsubscribe(t, s) }, func(ev a2a.Event) []byte {
				data, _ := json.Marshal(a2a.RPCOK(req.ID, ev))
				return data
			})
			return
		}
		task := in.result(r, t, sr.Configuration)
		reply.JSON(w, http.StatusOK, a2a.RPCOK(req.ID, a2a.Event{Task: &task}))
	case "GetTask":
		var tr a2a.TaskRequest
		if !taskParams(&tr) {
			return
		}
		task, aerr := in.get(principal, p, &tr)
		if aerr != nil {
			fail(aerr)
			return
		}
		reply.JSON(w, http.StatusOK, a2a.RPCOK(req.ID, task))
	case "ListTasks":
		var lr a2a.ListRequest
		if !params(&lr) {
			return
		}
		out, missing, aerr := in.list(r.Context(), principal, p, &lr)
		if aerr != nil {
			fail(aerr)
			return
		}
		unanswered(w, missing)
		reply.JSON(w, http.StatusOK, a2a.RPCOK(req.ID, out))
	case "CancelTask":
		var tr a2a.TaskRequest
		if !taskParams(&tr) {
			return
		}
		task, aerr := in.cancel(principal, p.Name, tr.ID)
		if aerr != nil {
			fail(aerr)
			return
		}
		reply.JSON(w, http.StatusOK, a2a.RPCOK(req.ID, task))
	case "SubscribeToTask":
		var tr a2a.TaskRequest
		if !taskParams(&tr) {
			return
		}
		s, stop, aerr := in.subscribe(principal, p.Name, tr.ID)
		if aerr != nil {
			fail(aerr)
			return
		}
		sse(w, r, s, stop, func(ev a2a.Event) []byte {
			data, _ := json.Marshal(a2a.RPCOK(req.ID, ev))
			return data
		})
	case "GetExtendedAgentCard":
		fail(a2a.Unimplemented(req.Method))
	default:
		if pushMethods[req.Method] {
			fail(a2a.NoPush(req.Method))
			return
		}
		fail(a2a.ErrMethodNotFound.With("unknown A2A operation %q", req.Method))
	}
}

func writeSSEOnce(w http.ResponseWriter, data []byte) {
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(append(append([]byte("data: "), data...), '\n', '\n'))
}

// result is SendMessage's answer: at once with returnImmediately, else when
// the task is terminal or waits for input (or the client gives up).
func (in *ingress) result(r *http.Request, t *liveTask, cfg *a2a.SendConfig) a2a.Task {
	var task a2a.Task
	if cfg != nil && cfg.ReturnImmediately {
		in.mu.Lock()
		task = t.rec.Task.Clone()
		in.mu.Unlock()
	} else {
		task = in.wait(r.Context(), t)
	}
	if cfg != nil {
		a2a.TrimTask(&task, cfg.HistoryLength, true)
	}
	return task
}

// --- HTTP+JSON --------------------------------------------------------------

func writeRESTError(w http.ResponseWriter, e *a2a.Error) {
	reply.JSON(w, e.HTTPStatus, map[string]any{"error": map[string]any{
		"code": e.HTTPStatus, "status": e.Status, "message": e.Message, "details": a2a.ErrorDetails(e),
	}})
}

// restBegin is the common start of every HTTP+JSON route.
func (in *ingress) restBegin(w http.ResponseWriter, r *http.Request) (string, *a2a.Profile, bool) {
	principal, p, ok := in.caller(w, r, restRoute)
	if !ok {
		return "", nil, false
	}
	if e := a2a.VersionOK(r); e != nil {
		writeRESTError(w, e)
		return "", nil, false
	}
	return principal, p, true
}

func (in *ingress) restSendRequest(w http.ResponseWriter, r *http.Request) (*a2a.SendRequest, bool) {
	body, aerr, tooBig := a2a.ReadBody(r)
	if tooBig {
		reply.Error(w, http.StatusRequestEntityTooLarge, aerr.Message)
		return nil, false
	}
	if aerr != nil {
		writeRESTError(w, aerr)
		return nil, false
	}
	var sr a2a.SendRequest
	if err := json.Unmarshal(body, &sr); err != nil {
		writeRESTError(w, a2a.ErrParse.With("request is not a SendMessageRequest: %v", err))
		return nil, false
	}
	return &sr, true
}

// restSendBegin opens message:send and message:stream: caller, version and
// a bounded SendMessageRequest body.
func (in *ingress) restSendBegin(w http.ResponseWriter, r *http.Request) (string, *a2a.Profile, *a2a.SendRequest, bool) {
	principal, p, ok := in.restBegin(w, r)
	if !ok {
		return "", nil, nil, false
	}
	sr, ok := in.restSendRequest(w, r)
	return principal, p, sr, ok
}

func (in *ingress) restSend(w http.ResponseWriter, r *http.Request) {
	principal, p, sr, ok := in.restSendBegin(w, r)
	if !ok {
		return
	}
	t, _, aerr := in.send(principal, p, sr, false)
	if aerr != nil {
		writeRESTError(w, aerr)
		return
	}
	task := in.result(r, t, sr.Configuration)
	reply.JSON(w, http.StatusOK, a2a.Event{Task: &task})
}

func (in *ingress) restStream(w http.ResponseWriter, r *http.Request) {
	principal, p, sr, ok := in.restSendBegin(w, r)
	if !ok {
		return
	}
	t, s, aerr := in.send(principal, p, sr, true)
	if aerr != nil {
		writeRESTError(w, aerr)
		return
	}
	sse(w, r, s, func() { in.unsubscribe(t, s) }, a2a.RESTFrame)
}

func (in *ingress) restList(w http.ResponseWriter, r *http.Request) {
	principal, p, ok := in.restBegin(w, r)
	if !ok {
		return
	}
	q := r.URL.Query()
	lr := a2a.ListRequest{ContextID: q.Get("contextId"), Status: q.Get("status"), PageToken: q.Get("pageToken")}
	var bad *a2a.Error
	lr.PageSize, bad = a2a.QueryInt(q.Get("pageSize"), "pageSize")
	if bad == nil && q.Has("historyLength") {
		var n int
		n, bad = a2a.QueryInt(q.Get("historyLength"), "historyLength")
		lr.HistoryLength = &n
	}
	if v := q.Get("includeArtifacts"); bad == nil && v != "" {
		var err error
		if lr.IncludeArtifacts, err = strconv.ParseBool(v); err != nil {
			bad = a2a.InvalidField("includeArtifacts", "must be true or false, got %q", v)
		}
	}
	if v := q.Get("statusTimestampAfter"); bad == nil && v != "" {
		ts, err := time.Parse(time.RFC3339Nano, v)
		if err != nil {
			bad = a2a.InvalidField("statusTimestampAfter", "must be an ISO 8601 timestamp, got %q", v)
		}
		lr.StatusTimestampAfter = &ts
	}
	if bad != nil {
		writeRESTError(w, bad)
		return
	}
	out, missing, aerr := in.list(r.Context(), principal, p, &lr)
	if aerr != nil {
		writeRESTError(w, aerr)
		return
	}
	unanswered(w, missing)
	reply.JSON(w, http.StatusOK, out)
}

// restTask is tasks/{id} (GET), tasks/{id}:cancel (POST) and
// tasks/{id}:subscribe (GET or POST).
func (in *ingress) restTask(w http.ResponseWriter, r *http.Request) {
	principal, p, ok := in.restBegin(w, r)
	if !ok {
		return
	}
	seg := r.PathValue("task")
	id, verb, _ := strings.Cut(seg, ":")
	switch {
	case verb == "" && r.Method == http.MethodGet:
		tr := a2a.TaskRequest{ID: id}
		if r.URL.Query().Has("historyLength") {
			n, bad := a2a.QueryInt(r.URL.Query().Get("historyLength"), "historyLength")
			if bad != nil {
				writeRESTError(w, bad)
				return
			}
			tr.HistoryLength = &n
		}
		task, aerr := in.get(principal, p, &tr)
		if aerr != nil {
			writeRESTError(w, aerr)
			return
		}
		reply.JSON(w, http.StatusOK, task)
	case verb == "cancel" && r.Method == http.MethodPost:
		task, aerr := in.cancel(principal, p.Name, id)
		if aerr != nil {
			writeRESTError(w, aerr)
			return
		}
		reply.JSON(w, http.StatusOK, task)
	case verb == "subscribe":
		s, stop, aerr := in.subscribe(principal, p.Name, id)
		if aerr != nil {
			writeRESTError(w, aerr)
			return
		}
		sse(w, r, s, stop, a2a.RESTFrame)
	case verb == "":
		restMiss(w, r, http.MethodGet)
	case verb == "cancel":
		restMiss(w, r, http.MethodPost)
	default:
		restMiss(w, r, "")
	}
}

// restUnmatched is every other path under an HTTP+JSON root: one some
// operation is at under other methods, or none.
func (in *ingress) restUnmatched(w http.ResponseWriter, r *http.Request) {
	if _, _, ok := in.restBegin(w, r); !ok {
		return
	}
	var allow []string
	mux := in.mux
	for _, m := range []string{http.MethodGet, http.MethodPost, http.MethodDelete} {
		probe := r.Clone(r.Context())
		probe.Method = m
		if _, pat := mux.Handler(probe); pat != "" && pat != restRoot {
			allow = append(allow, m)
		}
	}
	restMiss(w, r, strings.Join(allow, ", "))
}

// restMiss answers a request no operation takes, as upstream does: a path
// an operation is at under allow's methods is a 405 naming them, any other
// a 404 MethodNotFound.
func restMiss(w http.ResponseWriter, r *http.Request, allow string) {
	if allow == "" {
		writeRESTError(w, a2a.ErrMethodNotFound.With("no A2A operation is mounted at %s", r.URL.Path))
		return
	}
	w.Header().Set("Allow", allow+", OPTIONS")
	reply.JSON(w, http.StatusMethodNotAllowed, map[string]any{"error": map[string]any{
		"code": http.StatusMethodNotAllowed, "status": "METHOD_NOT_ALLOWED", "message": fmt.Sprintf("%s is not allowed on %s", r.Method, r.URL.Path),
	}})
}

// restPush answers the push-notification routes, naming the operation the
// route is.
func (in *ingress) restPush(w http.ResponseWriter, r *http.Request) {
	if _, _, ok := in.restBegin(w, r); !ok {
		return
	}
	op := "CreateTaskPushNotificationConfig"
	switch {
	case r.Method == http.MethodDelete:
		op = "DeleteTaskPushNotificationConfig"
	case r.PathValue("config") != "":
		op = "GetTaskPushNotificationConfig"
	case r.Method == http.MethodGet:
		op = "ListTaskPushNotificationConfigs"
	}
	writeRESTError(w, a2a.NoPush(op))
}

func (in *ingress) restExtendedCard(w http.ResponseWriter, r *http.Request) {
	if _, _, ok := in.restBegin(w, r); !ok {
		return
	}
	writeRESTError(w, a2a.Unimplemented("GetExtendedAgentCard"))
}
