package httpapi

import (
	"io"
	"net/http"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/envdur"
	"github.com/nexus-broker/nexus-broker/internal/gateway"
)

// HTTP bounds. A request body must arrive within bodyReadTimeout of its
// headers, and a keep-alive connection between requests is closed after
// idleTimeout. Neither reaches an upgraded WebSocket (the upgrade hijacks
// the connection and the core's sockets run their own liveness), and there
// is no write timeout: a claim may rightly take queue_wait_timeout +
// ready_timeout to answer. Only tests shorten them, through
// TestHTTPTimeoutsEnv.
var (
	bodyReadTimeout = 30 * time.Second
	idleTimeout     = 60 * time.Second
)

// TestHTTPTimeoutsEnv overrides the two HTTP bounds ("body,idle", Go
// durations). It exists for tests only and is not a configuration key.
const TestHTTPTimeoutsEnv = "NEXUS_BROKER_TEST_HTTP_TIMEOUTS"

func init() { envdur.Override(TestHTTPTimeoutsEnv, &bodyReadTimeout, &idleTimeout) }

// Server is the broker's http.Server for h: headers within 10 s, bodies
// within bodyReadTimeout, idle keep-alives closed after idleTimeout. A
// request's context carries its connection (gateway.ConnContext, for
// gateway.StreamConn). Serve it on gateway.Listener.
func Server(h http.Handler) *http.Server {
	return &http.Server{Handler: boundBody(h), ReadHeaderTimeout: 10 * time.Second, IdleTimeout: idleTimeout,
		ConnContext: gateway.ConnContext}
}

// boundBody gives a request with a body bodyReadTimeout to deliver it. The
// deadline is lifted once the body has been read, so the handler's own
// waits (a claim's queue and boot) are never cut short, and net/http's
// watch for a vanished client is not mistaken for one.
func boundBody(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ContentLength != 0 {
			rc := http.NewResponseController(w)
			if rc.SetReadDeadline(time.Now().Add(bodyReadTimeout)) == nil {
				r.Body = &deadlineBody{ReadCloser: r.Body, rc: rc}
			}
		}
		h.ServeHTTP(w, r)
	})
}

// deadlineBody lifts the read deadline when its body ends.
type deadlineBody struct {
	io.ReadCloser
	rc   *http.ResponseController
	done bool
}

func (b *deadlineBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err == io.EOF && !b.done {
		b.done = true
		_ = b.rc.SetReadDeadline(time.Time{})
	}
	return n, err
}
