package auth

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/config"
)

// The refusal texts of the wire contract.
const (
	TextRequired    = "authentication required"
	TextRejected    = "credential rejected"
	TextUnavailable = "credential validation unavailable"
	TextScope       = "insufficient scope"
)

// NotAdmin is the refusal of a route that needs auth.admin_scope.
var NotAdmin = &Refusal{http.StatusForbidden, TextScope, "no auth.admin_scope"}

// RetryAfter is the Retry-After, in seconds, of a 503 from a validator
// that could not find out.
const RetryAfter = "5"

// Refusal is why a request was not authenticated: its status, its wire
// text, and a reason for the audit log (never a token).
type Refusal struct {
	Status int
	Text   string
	Reason string
}

// Write answers the refusal in the broker's {"error":"…"} envelope.
func (r *Refusal) Write(w http.ResponseWriter) {
	// RFC 6750's challenge: the scheme on a 401, with invalid_token when a
	// credential was presented and refused, and insufficient_scope on a
	// 403. A 503 is not a challenge: re-authenticating would not help.
	switch {
	case r.Status == http.StatusServiceUnavailable:
		w.Header().Set("Retry-After", RetryAfter)
	case r.Status == http.StatusUnauthorized && r.Text == TextRequired:
		w.Header().Set("WWW-Authenticate", `Bearer realm="nexus-broker"`)
	case r.Status == http.StatusUnauthorized:
		w.Header().Set("WWW-Authenticate", `Bearer realm="nexus-broker", error="invalid_token"`)
	case r.Status == http.StatusForbidden && r.Text == TextScope:
		w.Header().Set("WWW-Authenticate", `Bearer realm="nexus-broker", error="insufficient_scope"`)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(r.Status)
	_ = json.NewEncoder(w).Encode(map[string]string{"error": r.Text})
}

// errUnavailable marks a validator that could not reach what it asks: a
// refusal, but not a statement about the token.
var errUnavailable = errors.New("validator unavailable")

// validator judges one credential. It returns the principal, or an error
// that is errNotPresented (nothing for it in the credential), wraps
// errUnavailable, or says why the credential was rejected.
type validator interface {
	validate(ctx context.Context, c *Credential) (Principal, error)
}

var errNotPresented = errors.New("no credential for this validator")

// link is one validator of the chain and the principal_prefix put before
// the ids it yields.
type link struct {
	validator
	prefix string
}

// Authenticator is the validator chain of an auth: block. A nil
// *Authenticator is a broker without one: every caller is anonymous and
// every caller is the operator.
type Authenticator struct {
	chain      []link
	adminScope string
	// headers are the proxy_headers principal headers: sending one is
	// presenting a credential, whoever sends it.
	headers []string
}

// New builds the chain of a validated auth: block, reading every <key>_env
// secret from the environment; nil gives nil. An error names the key.
func New(a *config.Auth, log *slog.Logger) (*Authenticator, error) {
	return newOn(a, log, clock{now: time.Now, after: time.After})
}

// clock is the time the validators read and wait on (tests drive it).
type clock struct {
	now   func() time.Time
	after func(time.Duration) <-chan time.Time
}

func newOn(a *config.Auth, log *slog.Logger, clk clock) (*Authenticator, error) {
	if a == nil {
		return nil, nil
	}
	au := &Authenticator{adminScope: *a.AdminScope}
	for i := range a.Validators {
		v := &a.Validators[i]
		var val validator
		var err error
		switch v.Type {
		case config.ValidatorStatic:
			val, err = newStatic(i, v)
		case config.ValidatorJWKS:
			val = newJWKS(v, log, clk)
		case config.ValidatorIntrospect:
			val, err = newIntrospect(i, v, log, clk)
		case config.ValidatorProxyHeaders:
			val = &proxyHeaders{cfg: v}
			au.headers = append(au.headers, v.PrincipalHeader)
		}
		if err != nil {
			au.Close()
			return nil, err
		}
		au.chain = append(au.chain, link{val, v.PrincipalPrefix})
	}
	return au, nil
}

// Close stops what the validators run in the background (a JWKS's
// scheduled refresh). Nil-safe.
func (a *Authenticator) Close() {
	if a == nil {
		return
	}
	for _, l := range a.chain {
		if c, ok := l.validator.(interface{ close() }); ok {
			c.close()
		}
	}
}

// Enabled reports whether an auth: block is in force.
func (a *Authenticator) Enabled() bool { return a != nil }

// IsAdmin reports whether p holds auth.admin_scope; without auth: every
// caller does.
func (a *Authenticator) IsAdmin(p Principal) bool {
	return a == nil || p.HasScope(a.adminScope)
}

// Authenticate verifies r's credential (never a ticket: see Tickets).
func (a *Authenticator) Authenticate(r *http.Request) (Principal, *Refusal) {
	if a == nil {
		return Principal{}, nil
	}
	c := Extract(r, false)
	return a.Verify(r.Context(), &c)
}

// Verify runs the chain over c: the first validator that accepts wins.
// Nothing presented is 401 authentication required; a validator that could
// not find out, with none accepting, is 503; anything else 401 credential
// rejected.
func (a *Authenticator) Verify(ctx context.Context, c *Credential) (Principal, *Refusal) {
	// On auth.proxy_listen the proxy's header is the credential, and the
	// only one: a bearer there was the proxy's to judge.
	presented := c.Authorization && !c.ViaProxySocket
	for _, h := range a.headers {
		presented = presented || c.Header.Get(h) != ""
	}
	if !presented {
		return Principal{}, &Refusal{http.StatusUnauthorized, TextRequired, "no credential"}
	}
	var unavailable, last error
	for _, l := range a.chain {
		if _, proxy := l.validator.(*proxyHeaders); c.ViaProxySocket && !proxy {
			continue
		}
		p, err := l.validate(ctx, c)
		switch {
		case err == nil:
			p.ID = l.prefix + p.ID
			return p, nil
		case errors.Is(err, errNotPresented):
		case errors.Is(err, errUnavailable):
			unavailable = err
		default:
			last = err
		}
	}
	if unavailable != nil {
		return Principal{}, &Refusal{http.StatusServiceUnavailable, TextUnavailable, unavailable.Error()}
	}
	reason := "no validator accepted the credential"
	if last != nil {
		reason = last.Error()
	}
	return Principal{}, &Refusal{http.StatusUnauthorized, TextRejected, reason}
}
