package httpapi

import (
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/gateway"
)

// A claim's answer is on the wire, whole and with its length, before the
// handler returns: what the handler does after it (its log line) is off
// the claimant's path, and the bytes are the ones writeJSON writes.
func TestAnswerNowLeavesBeforeTheHandlerReturns(t *testing.T) {
	v := gateway.ClaimAnswer{LeaseID: "L", WSURL: "ws://b.test/lease/L", SessionID: "S"}
	read := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		answerNow(w, v)
		select {
		case <-read:
		case <-time.After(10 * time.Second):
			t.Error("the client did not get the answer while the handler was still running")
		}
	}))
	defer srv.Close()
	res, err := http.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(res.Body)
	close(read)
	res.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	want := httptest.NewRecorder()
	writeJSON(want, http.StatusOK, v)
	if res.StatusCode != http.StatusOK || string(body) != want.Body.String() || res.Header.Get("Content-Type") != "application/json" {
		t.Errorf("answer %d %q (%s), want 200 %q", res.StatusCode, body, res.Header.Get("Content-Type"), want.Body)
	}
	if res.ContentLength != int64(len(body)) || len(res.TransferEncoding) != 0 {
		t.Errorf("Content-Length %d, Transfer-Encoding %v; want %d and none", res.ContentLength, res.TransferEncoding, len(body))
	}
}
