// Package brokerclient is a Go client of nexus-broker's HTTP and WebSocket
// API: claim, connect (with a ticket or a bearer, and ?from_seq= resume),
// reconnect with a fresh ticket, send input, read frames, release. The
// README's nexus-client command, the tests and the benchmarks all use it.
//
// Of the project it imports only pkg/brokerframe, so a client links none
// of the broker; it may import none of the gateway's layers
// (internal/gateway/layers_test.go checks it).
package brokerclient

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"

	"github.com/gorilla/websocket"

	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// Client talks to one broker.
type Client struct {
	// Base is the broker's http:// origin.
	Base string
	// Token, when set, is sent as Authorization: Bearer.
	Token string
	HTTP  *http.Client
}

// ClaimRequest is POST /claim's body.
type ClaimRequest struct {
	Config    string `json:"config"`
	SessionID string `json:"session_id,omitempty"`
	Binary    string `json:"binary,omitempty"`
}

// Claim is POST /claim's answer.
type Claim struct {
	LeaseID   string `json:"lease_id"`
	WSURL     string `json:"ws_url"`
	SessionID string `json:"session_id"`
	// SessionError says why the instance's session-id report was refused;
	// then SessionID is empty and the session cannot be resumed.
	SessionError string `json:"session_error,omitempty"`
	Ticket       string `json:"ticket,omitempty"`
}

// APIError is a non-2xx answer: its status and {"error":…} text.
type APIError struct {
	Status  int
	Message string
}

func (e *APIError) Error() string { return fmt.Sprintf("broker answered %d: %s", e.Status, e.Message) }

func (c *Client) httpClient() *http.Client {
	if c.HTTP != nil {
		return c.HTTP
	}
	return http.DefaultClient
}

// do sends a request and decodes a 2xx JSON answer into out.
func (c *Client) do(ctx context.Context, method, path string, body, out any) error {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, strings.TrimSuffix(c.Base, "/")+path, rd)
	if err != nil {
		return err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if c.Token != "" {
		req.Header.Set("Authorization", "Bearer "+c.Token)
	}
	resp, err := c.httpClient().Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode/100 != 2 {
		var e struct {
			Error string `json:"error"`
		}
		if json.Unmarshal(data, &e) != nil || e.Error == "" {
			e.Error = strings.TrimSpace(string(data))
		}
		return &APIError{Status: resp.StatusCode, Message: e.Error}
	}
	if out == nil {
		return nil
	}
	return json.Unmarshal(data, out)
}

// Claim claims an instance.
func (c *Client) Claim(ctx context.Context, req ClaimRequest) (*Claim, error) {
	var out Claim
	if err := c.do(ctx, http.MethodPost, "/claim", req, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// Release releases a lease.
func (c *Client) Release(ctx context.Context, leaseID string) error {
	return c.do(ctx, http.MethodPost, "/release/"+url.PathEscape(leaseID), nil, nil)
}

// Ticket mints a fresh single-use WebSocket ticket for a lease the client's
// token owns (POST /ticket/{lease_id}); "" from a broker with no auth:
// block, whose lease sockets take none.
func (c *Client) Ticket(ctx context.Context, leaseID string) (string, error) {
	var out struct {
		Ticket string `json:"ticket"`
	}
	if err := c.do(ctx, http.MethodPost, "/ticket/"+url.PathEscape(leaseID), nil, &out); err != nil {
		return "", err
	}
	return out.Ticket, nil
}

// Reconnect opens a lease's socket again with a fresh ticket (the claim's
// burned on first use), replaying what followed fromSeq when it is set.
func (c *Client) Reconnect(ctx context.Context, claim *Claim, fromSeq *uint64) (*Conn, error) {
	ticket, err := c.Ticket(ctx, claim.LeaseID)
	if err != nil {
		return nil, err
	}
	return Dial(ctx, claim.WSURL, DialOptions{FromSeq: fromSeq, Ticket: ticket})
}

// Get decodes a GET route's JSON answer into out.
func (c *Client) Get(ctx context.Context, path string, out any) error {
	return c.do(ctx, http.MethodGet, path, nil, out)
}

// Conn is one client WebSocket to a lease.
type Conn struct {
	LeaseID string
	ws      *websocket.Conn
	// LastSeq is the highest seq read so far: what a reconnect resumes from.
	LastSeq uint64
}

// DialOptions tune Dial.
type DialOptions struct {
	// FromSeq, when non-nil, asks the broker to replay what followed it.
	FromSeq *uint64
	// Ticket, when set, is sent as ?ticket= and wins exclusively over Token.
	Ticket string
	// Token is sent as Authorization: Bearer on the handshake.
	Token string
}

// Dial opens ws_url. A refusal before the upgrade is an *APIError.
func Dial(ctx context.Context, wsURL string, o DialOptions) (*Conn, error) {
	u, err := url.Parse(wsURL)
	if err != nil {
		return nil, err
	}
	q := u.Query()
	if o.FromSeq != nil {
		q.Set("from_seq", strconv.FormatUint(*o.FromSeq, 10))
	}
	if o.Ticket != "" {
		q.Set("ticket", o.Ticket)
	}
	u.RawQuery = q.Encode()
	h := http.Header{}
	if o.Token != "" {
		h.Set("Authorization", "Bearer "+o.Token)
	}
	ws, resp, err := websocket.DefaultDialer.DialContext(ctx, u.String(), h)
	if err != nil {
		if resp != nil {
			defer resp.Body.Close()
			var e struct {
				Error string `json:"error"`
			}
			data, _ := io.ReadAll(resp.Body)
			_ = json.Unmarshal(data, &e)
			return nil, &APIError{Status: resp.StatusCode, Message: e.Error}
		}
		return nil, err
	}
	ws.SetReadLimit(64 << 20)
	leaseID := u.Path[strings.LastIndex(u.Path, "/")+1:]
	c := &Conn{LeaseID: leaseID, ws: ws}
	if o.FromSeq != nil {
		c.LastSeq = *o.FromSeq
	}
	return c, nil
}

// Send sends one IO payload (for example brokerframe.IO{Type: "input",
// Content: "hi"}) in an io frame.
func (c *Conn) Send(payload any) error {
	p, err := json.Marshal(payload)
	if err != nil {
		return err
	}
	data, err := brokerframe.Encode(brokerframe.Frame{LeaseID: c.LeaseID, Signal: brokerframe.SignalIO, Payload: p})
	if err != nil {
		return err
	}
	return c.ws.WriteMessage(websocket.TextMessage, data)
}

// WriteRaw sends one message as is.
func (c *Conn) WriteRaw(data []byte) error { return c.ws.WriteMessage(websocket.TextMessage, data) }

// Next reads the next frame, tracking LastSeq. A close from the broker is
// returned as *websocket.CloseError.
func (c *Conn) Next() (brokerframe.Frame, error) {
	_, data, err := c.ws.ReadMessage()
	if err != nil {
		return brokerframe.Frame{}, err
	}
	f, err := brokerframe.Decode(data)
	if err != nil {
		return f, err
	}
	if f.Seq > c.LastSeq {
		c.LastSeq = f.Seq
	}
	return f, nil
}

// Close closes the socket with a normal closure.
func (c *Conn) Close() error {
	_ = c.ws.WriteMessage(websocket.CloseMessage, websocket.FormatCloseMessage(websocket.CloseNormalClosure, ""))
	return c.ws.Close()
}

// Underlying exposes the WebSocket for tests that need raw control.
func (c *Conn) Underlying() *websocket.Conn { return c.ws }

// Answer reads frames until the turn settles (status idle after some
// output) and returns the streamed text.
func (c *Conn) Answer() (string, error) {
	var b strings.Builder
	for {
		f, err := c.Next()
		if err != nil {
			return b.String(), err
		}
		if f.Signal != brokerframe.SignalIO {
			continue
		}
		var p brokerframe.IO
		if json.Unmarshal(f.Payload, &p) != nil {
			continue
		}
		switch p.Type {
		case brokerframe.IOStreamDelta:
			b.WriteString(p.Content)
		case brokerframe.IOOutput:
			b.Reset()
			b.WriteString(p.Content)
		case brokerframe.IOStatus:
			if p.State == brokerframe.StateIdle && b.Len() > 0 {
				return b.String(), nil
			}
		}
	}
}

// Session is a lease's socket that survives a dropped connection: when a
// read or a write fails without the broker having closed the lease, it
// reconnects with a fresh ticket and ?from_seq=, so what the old socket
// missed is replayed (or announced by a stream-gap frame).
type Session struct {
	c     *Client
	claim *Claim

	mu     sync.Mutex
	conn   *Conn
	closed bool // Close was called: a failure is ours, not a drop
	// redial serializes reconnects, so a reader and a writer that both see
	// the drop make one new socket, not two that evict each other.
	redial sync.Mutex
}

// Open connects to a claimed lease with the claim's ticket (or the client's
// token), for a Session.
func (c *Client) Open(ctx context.Context, claim *Claim) (*Session, error) {
	conn, err := Dial(ctx, claim.WSURL, DialOptions{Ticket: claim.Ticket, Token: c.Token})
	if err != nil {
		return nil, err
	}
	return &Session{c: c, claim: claim, conn: conn}, nil
}

// Conn is the socket in use now.
func (s *Session) Conn() *Conn {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.conn
}

// replace swaps in a new socket for old after err, unless err is final (a
// close the broker sent, or our own Close) or another caller already did.
func (s *Session) replace(ctx context.Context, old *Conn, err error) (*Conn, error) {
	var closed *websocket.CloseError
	if errors.As(err, &closed) {
		return nil, err
	}
	s.redial.Lock()
	defer s.redial.Unlock()
	s.mu.Lock()
	cur, final := s.conn, s.closed
	s.mu.Unlock()
	switch {
	case final:
		return nil, err
	case cur != old:
		return cur, nil
	}
	from := old.LastSeq
	next, rerr := s.c.Reconnect(ctx, s.claim, &from)
	if rerr != nil {
		return nil, fmt.Errorf("%w (reconnecting: %v)", err, rerr)
	}
	_ = old.ws.Close()
	s.mu.Lock()
	s.conn = next
	s.mu.Unlock()
	return next, nil
}

// Send sends one IO payload, reconnecting and sending again if the socket
// dropped.
func (s *Session) Send(ctx context.Context, payload any) error {
	conn := s.Conn()
	err := conn.Send(payload)
	if err == nil {
		return nil
	}
	if conn, err = s.replace(ctx, conn, err); err != nil {
		return err
	}
	return conn.Send(payload)
}

// Next reads the next frame, reconnecting if the socket dropped. A close the
// broker sent (the lease closed, its instance crashed, a newer client took
// over) is final and returned as is.
func (s *Session) Next(ctx context.Context) (brokerframe.Frame, error) {
	for {
		conn := s.Conn()
		f, err := conn.Next()
		if err == nil {
			return f, nil
		}
		if _, err = s.replace(ctx, conn, err); err != nil {
			return f, err
		}
	}
}

// Close closes the current socket for good.
func (s *Session) Close() error {
	s.mu.Lock()
	s.closed = true
	conn := s.conn
	s.mu.Unlock()
	return conn.Close()
}
