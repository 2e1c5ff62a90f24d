package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/auth"
)

// An A2A conversation lives on the broker whose context index holds it:
// its session is on that broker's host. A message for a conversation this
// broker does not hold is answered by the broker that does, found by
// asking the peers (answers reused for at most contextCacheFor); one no
// broker holds starts here, and so belongs to this broker.

const contextCacheFor = time.Second

type contextCall struct {
	Principal string `json:"principal"`
	Profile   string `json:"profile"`
	Context   string `json:"context"`
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

// messageContext is the contextId of a JSON-RPC or REST message request.
func messageContext(body []byte) string {
	var m struct {
		Params struct {
			Message struct {
				ContextID string `json:"contextId"`
			} `json:"message"`
		} `json:"params"`
		Message struct {
			ContextID string `json:"contextId"`
		} `json:"message"`
	}
	if json.Unmarshal(body, &m) != nil {
		return ""
	}
	if m.Params.Message.ContextID != "" {
		return m.Params.Message.ContextID
	}
	return m.Message.ContextID
}

// clustered serves an A2A message route here unless (cluster mode) its
// contextId names a conversation another broker holds.
func (in *ingress) clustered(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		g := in.g
		if _, carried := forwardedPrincipal(r.Context()); g.node == nil || carried {
			h(w, r)
			return
		}
		body, err := io.ReadAll(http.MaxBytesReader(nil, r.Body, maxA2ABody))
		r.Body = io.NopCloser(io.MultiReader(bytes.NewReader(body), r.Body))
		ctxID := messageContext(body)
		if err != nil || ctxID == "" {
			h(w, r)
			return
		}
		who, ref := g.auth.Authenticate(r)
		profile := r.PathValue("name")
		if ref != nil || in.holds(who.ID, profile, ctxID) {
			h(w, r) // a refusal is answered (and audited) by the handler
			return
		}
		owner := g.contextOwner(r.Context(), contextCall{Principal: who.ID, Profile: profile, Context: ctxID})
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
		cfg := g.cfg.Load()
		var rep httpReply
		if err := g.node.CallFor(r.Context(), cfg.ReadyTimeout.D()+cfg.MaxTurnDuration.D()+30*time.Second, owner, opHTTP, call, &rep); err != nil {
			g.log.Warn("cluster: the conversation's broker did not answer", "owner", owner, "error", err)
			writeError(w, http.StatusServiceUnavailable, errOwnerUnavailable)
			return
		}
		for k, v := range rep.Header {
			w.Header()[k] = v
		}
		w.WriteHeader(rep.Status)
		_, _ = w.Write(rep.Body)
	}
}

// contextOwner is the peer holding the conversation, "" for none.
func (g *Gateway) contextOwner(ctx context.Context, c contextCall) string {
	key := convKey{c.Principal, c.Profile, c.Context}.String()
	if owner, ok := g.ctxCache.get(key); ok {
		return owner
	}
	owner := ""
	askPeers(g, ctx, opContext, c, func(peer string, a contextAnswer) {
		if a.Mine {
			owner = peer
		}
	})
	g.ctxCache.put(key, owner)
	return owner
}

// answerContext is the owner's side of contextOwner.
func (g *Gateway) answerContext(_ context.Context, _ string, body json.RawMessage) (any, error) {
	var c contextCall
	if err := json.Unmarshal(body, &c); err != nil {
		return nil, err
	}
	return contextAnswer{Mine: g.a2a != nil && g.a2a.holds(c.Principal, c.Profile, c.Context)}, nil
}

// serveCarried answers an HTTP request another broker carried, through this
// broker's own routes, as its principal.
func (g *Gateway) serveCarried(ctx context.Context, from string, body json.RawMessage) (any, error) {
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

// bufferedResponse keeps a response whole for the broker that carried the
// request (a stream arrives there at once, when it ends).
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
