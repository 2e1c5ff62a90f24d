package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/getkin/kin-openapi/openapi3filter"
	"github.com/getkin/kin-openapi/routers"
	"github.com/getkin/kin-openapi/routers/legacy"
	"github.com/gorilla/websocket"

	"github.com/nexus-broker/nexus-broker/internal/httpapi"
)

// Every response a test receives from a broker it started, over HTTP or as
// a WebSocket handshake, is checked against the broker's openapi.json: an
// undescribed route, status, header or body fails the test that received
// it. Responses from other servers (a test's OIDC issuer, say) are not.

// apiDoc is the validated document, loaded once.
var apiDoc = sync.OnceValues(func() (*openapi3.T, error) {
	loader := openapi3.NewLoader()
	doc, err := loader.LoadFromData(httpapi.OpenAPI())
	if err != nil {
		return nil, fmt.Errorf("loading openapi.json: %w", err)
	}
	if err := doc.Validate(loader.Context); err != nil {
		return nil, fmt.Errorf("openapi.json is not a valid OpenAPI document: %w", err)
	}
	return doc, nil
})

// apiRouter is the document's router, built once.
var apiRouter = sync.OnceValues(func() (routers.Router, error) {
	doc, err := apiDoc()
	if err != nil {
		return nil, err
	}
	// Test brokers listen on ports of their own, not the servers entry's:
	// route on a copy without it (the shared document is left as loaded).
	routed := *doc
	routed.Servers = nil
	return legacy.NewRouter(&routed)
})

// checkSchema fails t when the JSON value does not match the document's
// components.schemas entry name.
func checkSchema(t testing.TB, name string, value []byte) {
	t.Helper()
	doc, err := apiDoc()
	if err != nil {
		t.Fatal(err)
	}
	ref := doc.Components.Schemas[name]
	if ref == nil {
		t.Fatalf("openapi.json has no schema %s", name)
	}
	var v any
	if err := json.Unmarshal(value, &v); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	if err := ref.Value.VisitJSON(v, openapi3.EnableJSONSchema2020()); err != nil {
		t.Errorf("a %s openapi.json does not describe: %v\n%s", name, err, value)
	}
}

func init() {
	// Pages and event streams are checked for their status and headers.
	openapi3filter.RegisterBodyDecoder("text/html", openapi3filter.PlainBodyDecoder)
	openapi3filter.RegisterBodyDecoder("text/event-stream", openapi3filter.PlainBodyDecoder)
	http.DefaultTransport = validating(http.DefaultTransport)
	websocket.DefaultDialer.NetDialContext = dialHandshakeChecked
}

// unchecked is an HTTP client whose responses are not checked: benchmarks
// time the broker, not the check (which costs more than some of the round
// trips they measure: ~0.4 ms of the client's CPU on a claim's answer), so
// every benchmark's client uses it, the upstream broker's as well.
// Initialised before init wraps the default transport.
var unchecked = &http.Client{Transport: http.DefaultTransport}

// brokerTests maps a broker's host:port to the test that started it.
var brokerTests sync.Map

// checkResponsesOf makes t the test answerable for every response from addr.
func checkResponsesOf(t testing.TB, addr string) {
	brokerTests.Store(addr, t)
	t.Cleanup(func() { brokerTests.CompareAndDelete(addr, t) })
}

// checkResponse fails the broker's test when the response to req is not
// what openapi.json describes. body nil means not read (a stream).
func checkResponse(req *http.Request, status int, header http.Header, body []byte) {
	v, ok := brokerTests.Load(req.URL.Host)
	if !ok {
		return
	}
	t := v.(testing.TB)
	router, err := apiRouter()
	if err != nil {
		t.Error(err)
		return
	}
	route, params, err := router.FindRoute(req)
	if err != nil {
		t.Errorf("%s %s answered %d on a route openapi.json does not describe: %v", req.Method, req.URL.Path, status, err)
		return
	}
	in := &openapi3filter.ResponseValidationInput{
		RequestValidationInput: &openapi3filter.RequestValidationInput{
			Request: req, PathParams: params, Route: route,
			Options: &openapi3filter.Options{AuthenticationFunc: openapi3filter.NoopAuthenticationFunc},
		},
		Status: status,
		Header: header,
		Options: &openapi3filter.Options{
			IncludeResponseStatus: true,
			ExcludeResponseBody:   body == nil,
			MultiError:            true,
		},
	}
	in.SetBodyBytes(body)
	if err := openapi3filter.ValidateResponse(context.Background(), in); err != nil {
		t.Errorf("%s %s answered %d, which openapi.json does not describe: %v\nbody: %s", req.Method, req.URL.Path, status, err, body)
	}
}

type validatingTransport struct{ base http.RoundTripper }

// validating wraps an HTTP transport in the openapi.json check.
func validating(base http.RoundTripper) http.RoundTripper { return validatingTransport{base} }

func (v validatingTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := v.base.RoundTrip(req)
	if err != nil {
		return resp, err
	}
	if _, ours := brokerTests.Load(req.URL.Host); !ours {
		return resp, nil
	}
	if strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		checkResponse(req, resp.StatusCode, resp.Header, nil)
		return resp, nil
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		return nil, err
	}
	resp.Body = io.NopCloser(bytes.NewReader(body))
	checkResponse(req, resp.StatusCode, resp.Header, body)
	return resp, nil
}

// dialHandshakeChecked is the WebSocket dialer's connection: it keeps the
// handshake's request and response bytes and checks the response once it
// is whole (or the dialer gives up on it).
func dialHandshakeChecked(ctx context.Context, network, addr string) (net.Conn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	return &handshakeConn{Conn: c, host: addr}, nil
}

type handshakeConn struct {
	net.Conn
	host string

	mu       sync.Mutex
	done     bool
	req, rsp bytes.Buffer
}

func (c *handshakeConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	if !c.done {
		c.req.Write(p)
	}
	c.mu.Unlock()
	return c.Conn.Write(p)
}

func (c *handshakeConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.mu.Lock()
	if !c.done {
		c.rsp.Write(p[:n])
		c.check(err != nil)
	}
	c.mu.Unlock()
	return n, err
}

func (c *handshakeConn) Close() error {
	c.mu.Lock()
	if !c.done {
		c.check(true)
	}
	c.mu.Unlock()
	return c.Conn.Close()
}

// check validates the handshake's response when it is complete, or when
// no more of it will come (ended).
func (c *handshakeConn) check(ended bool) {
	raw := c.rsp.Bytes()
	head := bytes.Index(raw, []byte("\r\n\r\n"))
	if head < 0 {
		c.done = ended
		return
	}
	resp, err := http.ReadResponse(bufio.NewReader(bytes.NewReader(raw)), nil)
	if err != nil {
		c.done = true
		return
	}
	var body []byte
	if resp.StatusCode != http.StatusSwitchingProtocols {
		body = raw[head+4:]
		if n, err := strconv.Atoi(resp.Header.Get("Content-Length")); err == nil && len(body) < n && !ended {
			return
		}
	}
	c.done = true
	req, err := http.ReadRequest(bufio.NewReader(bytes.NewReader(c.req.Bytes())))
	if err != nil {
		return
	}
	req.URL.Host = c.host
	checkResponse(req, resp.StatusCode, resp.Header, body)
}

// handleRE finds the gateway's route registrations in its source.
var handleRE = regexp.MustCompile(`mux\.HandleFunc\("(?:([A-Z]+) )?(/[^"]*)"`)

// servedRoutes lists the routes the gateway registers, "METHOD /path" (a
// route without a method as "ANY /path"), wildcards {x...} written {x}, the
// end anchor {$} dropped.
func servedRoutes(t *testing.T) []string {
	files, err := filepath.Glob("../gateway/*.go")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range handleRE.FindAllStringSubmatch(string(src), -1) {
			method := m[1]
			if method == "" {
				method = "ANY"
			}
			out = append(out, method+" "+strings.NewReplacer("...}", "}", "{$}", "").Replace(m[2]))
		}
	}
	if len(out) == 0 {
		t.Fatal("found no route registrations in the gateway's source")
	}
	return out
}

// TestOpenAPIDocument: GET /openapi.json serves the embedded document, a
// valid OpenAPI 3.1 description of every route the gateway registers.
func TestOpenAPIDocument(t *testing.T) {
	if _, err := apiRouter(); err != nil {
		t.Fatal(err)
	}
	b := startBroker(t, Options{})
	status, body := b.get("/openapi.json")
	if status != http.StatusOK || body != string(httpapi.OpenAPI()) {
		t.Fatalf("GET /openapi.json = %d, %.200s; want 200 and the embedded document", status, body)
	}
	doc, err := openapi3.NewLoader().LoadFromData([]byte(body))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(doc.OpenAPI, "3.1.") {
		t.Errorf("openapi = %q, want 3.1.x", doc.OpenAPI)
	}
	for _, route := range servedRoutes(t) {
		method, path, _ := strings.Cut(route, " ")
		item := doc.Paths.Value(path)
		switch {
		case item == nil:
			t.Errorf("openapi.json does not describe the path of %s", route)
		case method == "ANY" && len(item.Operations()) == 0, method != "ANY" && item.GetOperation(method) == nil:
			t.Errorf("openapi.json does not describe %s", route)
		}
	}
}
