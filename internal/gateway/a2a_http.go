package gateway

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"github.com/nexus-broker/nexus-broker/internal/a2a"
	"github.com/nexus-broker/nexus-broker/internal/config"
	"github.com/nexus-broker/nexus-broker/internal/config/core"
)

// maxA2ABody bounds an A2A request body: one message of text.
const maxA2ABody = 1 << 20

// Default and largest ListTasks page.
const (
	defaultPageSize = 50
	maxPageSize     = 100
)

const errUnknownProfile = "unknown agent profile"

// profile is one agents: profile as served: its entry, the config its
// instances boot with, and its rendered card.
type profile struct {
	name   string
	entry  string
	path   string // the config file, resolved
	config []byte
	card   []byte
	etag   string // of card, its content's digest
}

// profileSet is every profile, swapped whole on a reload.
type profileSet struct{ byName map[string]*profile }

// buildProfiles reads every profile's config file and renders every card; a
// failure anywhere leaves nothing half-built.
// The card's base URL and security come from the boot configuration (both
// are boot-only), the profiles from cfg.
func buildProfiles(cfg *config.Config, boot *config.Config, base string) (*profileSet, error) {
	ps := &profileSet{byName: map[string]*profile{}}
	for name, a := range cfg.Agents {
		path, err := core.ExpandHome(strings.TrimSpace(a.Config))
		if err == nil {
			path, err = filepath.Abs(path)
		}
		if err != nil {
			return nil, fmt.Errorf("agents.%s.config: %w", name, err)
		}
		if st, err := os.Stat(path); err != nil {
			return nil, fmt.Errorf("agents.%s.config: %w (the nexus config instances of this profile boot with)", name, err)
		} else if !st.Mode().IsRegular() {
			return nil, fmt.Errorf("agents.%s.config: %s is not a regular file", name, path)
		}
		data, err := os.ReadFile(path)
		if err != nil {
			return nil, fmt.Errorf("agents.%s.config: %w", name, err)
		}
		card, err := json.Marshal(renderCard(name, a, base, boot.Auth))
		if err != nil {
			return nil, fmt.Errorf("agents.%s.card: %w", name, err)
		}
		sum := sha256.Sum256(card)
		ps.byName[name] = &profile{name: name, entry: a.Binary, path: path, config: data, card: card, etag: `"` + hex.EncodeToString(sum[:16]) + `"`}
	}
	return ps, nil
}

type cardJSON struct {
	Name                string           `json:"name"`
	Description         string           `json:"description"`
	Version             string           `json:"version"`
	SupportedInterfaces []cardInterface  `json:"supportedInterfaces"`
	Capabilities        cardCapabilities `json:"capabilities"`
	DefaultInputModes   []string         `json:"defaultInputModes"`
	DefaultOutputModes  []string         `json:"defaultOutputModes"`
	Skills              []cardSkill      `json:"skills"`
	Provider            *cardProvider    `json:"provider,omitempty"`
	DocumentationURL    string           `json:"documentationUrl,omitempty"`
	IconURL             string           `json:"iconUrl,omitempty"`
	SecuritySchemes     map[string]any   `json:"securitySchemes,omitempty"`
	SecurityRequirement []map[string]any `json:"securityRequirements,omitempty"`
}

type cardInterface struct {
	URL             string `json:"url"`
	ProtocolBinding string `json:"protocolBinding"`
	ProtocolVersion string `json:"protocolVersion"`
}

type cardCapabilities struct {
	Streaming         bool `json:"streaming"`
	PushNotifications bool `json:"pushNotifications"`
	ExtendedAgentCard bool `json:"extendedAgentCard"`
}

type cardSkill struct {
	ID          string   `json:"id"`
	Name        string   `json:"name"`
	Description string   `json:"description"`
	Tags        []string `json:"tags"`
	Examples    []string `json:"examples,omitempty"`
	InputModes  []string `json:"inputModes,omitempty"`
	OutputModes []string `json:"outputModes,omitempty"`
}

type cardProvider struct {
	Organization string `json:"organization"`
	URL          string `json:"url"`
}

// textModes is what the ingress accepts and produces: the IO envelope
// carries one string each way.
var textModes = []string{"text/plain"}

// orText is modes, or text/plain when the operator named none.
func orText(modes []string) []string {
	if len(modes) == 0 {
		return textModes
	}
	return modes
}

// renderCard is the operator's identity plus what the broker derives: the
// interfaces it serves, its capabilities, and the credential its auth:
// chain accepts.
func renderCard(name string, a *config.Agent, base string, authCfg *config.Auth) cardJSON {
	root := agentRoot(base, name) + "/a2a"
	c := cardJSON{
		Name: a.Card.Name, Description: a.Card.Description, Version: a.Card.Version,
		SupportedInterfaces: []cardInterface{
			{URL: root, ProtocolBinding: "JSONRPC", ProtocolVersion: a2a.ProtocolVersion},
			{URL: root + "/v1", ProtocolBinding: "HTTP+JSON", ProtocolVersion: a2a.ProtocolVersion},
		},
		Capabilities:       cardCapabilities{Streaming: true},
		DefaultInputModes:  orText(a.Card.DefaultInputModes),
		DefaultOutputModes: orText(a.Card.DefaultOutputModes),
		Skills:             []cardSkill{},
		DocumentationURL:   a.Card.DocumentationURL,
		IconURL:            a.Card.IconURL,
	}
	c.SecuritySchemes, c.SecurityRequirement = securityOf(authCfg)
	if p := a.Card.Provider; p != nil {
		c.Provider = &cardProvider{Organization: p.Organization, URL: p.URL}
	}
	for _, s := range a.Card.Skills {
		tags := s.Tags
		if tags == nil {
			tags = []string{}
		}
		c.Skills = append(c.Skills, cardSkill{ID: s.ID, Name: s.Name, Description: s.Description, Tags: tags, Examples: s.Examples,
			InputModes: s.InputModes, OutputModes: s.OutputModes})
	}
	return c
}

// securityOf derives the card's security from the auth: chain as upstream
// does: one bearer scheme per validator a client presents a credential to,
// named as the chain names it (its type, "jwks#2" for the second jwks), with
// upstream's description, and one requirement per scheme since any one
// validator suffices. proxy_headers takes no client credential and is not
// advertised; without auth: there is no security at all. (A requirement's
// scopes are an array, which the A2A clients read.)
func securityOf(a *config.Auth) (map[string]any, []map[string]any) {
	if a == nil {
		return nil, nil
	}
	schemes := map[string]any{}
	var reqs []map[string]any
	names := a.ValidatorNames()
	for i, v := range a.Validators {
		name := names[i]
		scheme := map[string]any{"scheme": "Bearer"}
		switch v.Type {
		case config.ValidatorStatic:
			scheme["description"] = "Shared bearer token issued out-of-band by the operator of this broker."
		case config.ValidatorJWKS:
			d := "OIDC JWT access token, verified against the issuer's published key set."
			if iss := strings.TrimSpace(v.Issuer); iss != "" {
				d += " Issuer: " + iss + "."
			}
			if aud := strings.Join(v.Audience, ", "); aud != "" {
				d += " Audience: " + aud + "."
			}
			scheme["description"], scheme["bearerFormat"] = d, "JWT"
		case config.ValidatorIntrospect:
			scheme["description"] = "Opaque bearer token, verified by RFC 7662 introspection at the issuer."
		default:
			continue
		}
		schemes[name] = map[string]any{"httpAuthSecurityScheme": scheme}
		reqs = append(reqs, map[string]any{"schemes": map[string]any{name: []string{}}})
	}
	if len(schemes) == 0 {
		return nil, nil
	}
	return schemes, reqs
}

// a2aBase is the origin cards advertise (agents: needs advertise_addr or
// an explicit listen host, so it is never empty).
func (g *Gateway) a2aBase() string { return g.origin("http", "https") }

// agentRoot is where a profile's routes live.
func agentRoot(base, name string) string { return base + "/agents/" + name }

// logA2ABoot states the ingress at boot in upstream's lines: the ingress,
// the task retention in force (the store is durable with a dir), and one
// line per profile naming its binary, its config and the URLs it publishes.
func (g *Gateway) logA2ABoot(ps *profileSet, dir string) {
	base := g.a2aBase()
	g.log.Info("a2a ingress enabled", "profiles", len(ps.byName), "base_url", base)
	t := g.boot.A2A.Tasks
	g.log.Info("a2a task retention", "state_dir", dir, "durable", dir != "", "ttl", t.TTL.D(), "max_per_context", t.MaxPerContext,
		"max_tasks", a2a.MaxTasks, "input_timeout", t.InputTimeout.D(), "max_store_bytes", t.MaxStoreBytes)
	for _, n := range ps.names() {
		p, root := ps.byName[n], agentRoot(base, n)
		g.log.Info("a2a agent profile", "name", n, "binary", p.entry, "config", p.path,
			"agent_card", root+"/.well-known/agent-card.json", "jsonrpc", root+"/a2a", "rest", root+"/a2a/v1")
	}
}

// --- routes ---------------------------------------------------------------

// restRoot is the pattern of every HTTP+JSON path no route names.
const restRoot = "/agents/{name}/a2a/v1/{rest...}"

func (in *ingress) routes(mux *http.ServeMux) {
	mux.HandleFunc(restRoot, in.restUnmatched)
	mux.HandleFunc("GET /agents/{name}/.well-known/agent-card.json", in.handleCard)
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
func (in *ingress) caller(w http.ResponseWriter, r *http.Request, b binding) (string, *profile, bool) {
	who, ok := in.g.Authenticate(w, r)
	if !ok {
		return "", nil, false
	}
	if b != cardRoute {
		w.Header().Set("A2A-Version", a2a.ProtocolVersion) // on every binding's answer, as upstream's
	}
	name := r.PathValue("name")
	p := in.profiles.Load().byName[name]
	if p == nil {
		in.g.log.Warn("a2a request for an unknown agent profile", "route", r.Pattern, "profile", name, "path", r.URL.Path)
		e := a2a.ErrMethodNotFound.With("%s: no A2A agent is mounted at %s", errUnknownProfile, r.URL.Path)
		switch b {
		case rpcRoute:
			writeJSON(w, http.StatusNotFound, rpcFail(nil, e))
		case restRoute:
			writeRESTError(w, e)
		default:
			writeError(w, http.StatusNotFound, errUnknownProfile)
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
	h.Set("ETag", p.etag)
	h.Set("Cache-Control", "public, max-age=300")
	if m := r.Header.Get("If-None-Match"); m != "" && etagMatches(m, p.etag) {
		w.WriteHeader(http.StatusNotModified)
		return
	}
	_, _ = w.Write(p.card)
}

// etagMatches is If-None-Match against one strong validator: a list, "*",
// and weak forms compared weakly.
func etagMatches(header, etag string) bool {
	for c := range strings.SplitSeq(header, ",") {
		c = strings.TrimPrefix(strings.TrimSpace(c), "W/")
		if c == "*" || c == etag {
			return true
		}
	}
	return false
}

// versionOK: an absent A2A-Version means 1.0; anything else but 1.0 is
// refused.
func versionOK(r *http.Request) *a2a.Error {
	v := strings.TrimSpace(r.Header.Get("A2A-Version"))
	if v == "" || v == a2a.ProtocolVersion {
		return nil
	}
	return a2a.ErrVersionUnsupported.With("A2A-Version %q is not supported; this agent speaks A2A %s", v, a2a.ProtocolVersion)
}

// readBody reads a bounded request body, into a buffer of its announced
// length when it has one.
func readBody(r *http.Request) ([]byte, *a2a.Error, bool) {
	rd := http.MaxBytesReader(nil, r.Body, maxA2ABody)
	var body []byte
	var err error
	if n := r.ContentLength; n > 0 && n <= maxA2ABody {
		body = make([]byte, n)
		_, err = io.ReadFull(rd, body)
	} else {
		body, err = io.ReadAll(rd)
	}
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			return nil, a2a.ErrInvalidRequest.With("request body exceeds %d bytes; send a shorter message", tooBig.Limit), true
		}
		return nil, a2a.ErrParse.With("reading the request body: %v", err), false
	}
	return body, nil, false
}

// checkSend validates a SendMessageRequest and returns its input text.
func checkSend(req *a2a.SendRequest) (string, *a2a.Error) {
	m := req.Message
	switch {
	case m == nil:
		return "", a2a.InvalidField("message", "message is required")
	case m.MessageID == "":
		return "", a2a.InvalidField("message.messageId", "message id is required")
	case m.Role != a2a.RoleUser && m.Role != a2a.RoleAgent:
		return "", a2a.InvalidField("message.role", "role must be %s or %s, got %q", a2a.RoleUser, a2a.RoleAgent, m.Role)
	case len(m.Parts) == 0:
		return "", a2a.InvalidField("message.parts", "at least one part is required")
	case m.Role != a2a.RoleUser:
		return "", a2a.InvalidField("message.role", "an inbound message must carry %s, got %q", a2a.RoleUser, m.Role)
	}
	if c := req.Configuration; c != nil {
		if bad := nonNegative(c.HistoryLength, "configuration.historyLength"); bad != nil {
			return "", bad
		}
		if len(c.PushConfig) > 0 && string(c.PushConfig) != "null" {
			return "", a2a.ErrPushNotSupported.With("this broker does not deliver push notifications; the agent card declares capabilities.pushNotifications as false")
		}
		if modes := c.AcceptedOutputModes; len(modes) > 0 && !acceptsText(modes) {
			return "", a2a.ErrContentType.With("this agent produces %s; the request accepts only %s", textModes[0], strings.Join(modes, ", "))
		}
	}
	return a2a.InputText(m)
}

// acceptsText reports whether acceptedOutputModes admit the text/plain
// every answer is.
func acceptsText(modes []string) bool {
	for _, m := range modes {
		switch strings.ToLower(strings.TrimSpace(m)) {
		case "text/plain", "text/*", "*/*", "text":
			return true
		}
	}
	return false
}

// send starts (or answers) a task. With stream the returned stream carries
// its events from its snapshot on.
func (in *ingress) send(principal string, p *profile, req *a2a.SendRequest, stream bool) (*liveTask, *sseStream, *a2a.Error) {
	text, aerr := checkSend(req)
	if aerr != nil {
		return nil, nil, aerr
	}
	if req.Message.TaskID != "" {
		t, aerr := in.answer(principal, p.name, req.Message, text)
		if aerr != nil {
			return nil, nil, aerr
		}
		var s *sseStream
		if stream {
			in.mu.Lock()
			s = in.subscribeLocked(t)
			in.mu.Unlock()
		}
		return t, s, nil
	}
	t, s := in.submit(principal, p.name, req.Message, text, stream)
	return t, s, nil
}

// trimTask applies historyLength and, for lists, includeArtifacts.
func trimTask(t *a2a.Task, historyLength *int, artifacts bool) {
	if historyLength != nil {
		n := max(*historyLength, 0)
		if len(t.History) > n {
			t.History = t.History[len(t.History)-n:]
		}
		if n == 0 {
			t.History = nil
		}
	}
	if !artifacts {
		t.Artifacts = nil
	}
}

// list is ListTasks: newest change first, paged by offset. In cluster
// mode it is every broker's that answered; the others are returned.
func (in *ingress) list(ctx context.Context, principal string, p *profile, req *a2a.ListRequest) (*a2a.ListResponse, []string, *a2a.Error) {
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
	if bad := nonNegative(req.HistoryLength, "historyLength"); bad != nil {
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
	ts, total := in.matching(principal, p.name, req, off+size)
	var missing []string
	if in.g.rt != nil {
		ts, total, missing = in.gatherTasks(ctx, tasksCall{Principal: principal, Profile: p.name, Req: *req, Limit: off + size}, ts, total)
	}
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
		trimTask(&t, req.HistoryLength, req.IncludeArtifacts)
		out = append(out, t)
	}
	return out, len(rs)
}

// nonNegative refuses a negative historyLength as upstream's codec does.
func nonNegative(n *int, field string) *a2a.Error {
	if n != nil && *n < 0 {
		return a2a.InvalidField(field, "must not be negative, got %d", *n)
	}
	return nil
}

// get is GetTask, from the record.
func (in *ingress) get(principal string, p *profile, req *a2a.TaskRequest) (*a2a.Task, *a2a.Error) {
	if bad := nonNegative(req.HistoryLength, "historyLength"); bad != nil {
		return nil, bad
	}
	r, ok := in.store.Get(principal, p.name, req.ID)
	if !ok {
		return nil, a2a.TaskNotFound(req.ID)
	}
	trimTask(&r.Task, req.HistoryLength, true)
	return &r.Task, nil
}

// --- SSE ------------------------------------------------------------------

// sse serves a task's stream (see sseStream) until it ends or the client
// goes away, then stop detaches it; frame renders one event's data line.
func sse(w http.ResponseWriter, r *http.Request, s *sseStream, stop func(), frame func(a2a.Event) []byte) {
	defer stop()
	s.serve(w, r, frame)
}

// sortedProfileNames is for logs.
func (ps *profileSet) names() []string {
	out := make([]string, 0, len(ps.byName))
	for n := range ps.byName {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}
