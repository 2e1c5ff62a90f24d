package httpapi

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/gateway"
)

// handleClaim is POST /claim: authenticate, read the body within
// max_claim_body, and have the core claim (gateway.ClaimRequest).
func (a *api) handleClaim(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	p, ok := a.core.Authenticate(w, r)
	if !ok {
		a.core.CountClaim(start, &gateway.ClaimError{Outcome: gateway.OutcomeRejected})
		return
	}
	var resp *gateway.ClaimAnswer
	body, cerr := a.readClaim(r)
	if cerr == nil {
		resp, cerr = a.core.ClaimRequest(r, p, body)
	}
	a.core.CountClaim(start, cerr)
	if cerr != nil {
		if cerr.Outcome == gateway.OutcomeCancelled {
			msg := "claim abandoned by its client" // while its instance booted: upstream waits that out
			if cerr.Text == gateway.TextGoneWhileQueued {
				msg = "claim cancelled while queued for capacity"
			}
			a.log.Info(msg, "error", cerr.Text)
			return // nobody is listening
		}
		attrs := []any{"status", cerr.Status, "reason", cerr.Text}
		if cerr.Cause != "" {
			attrs = append(attrs, "error", cerr.Cause)
		}
		a.log.Warn("claim failed", attrs...)
		if cerr.Status == http.StatusTooManyRequests {
			a.core.Audit(r, p, cerr.Status, cerr.Text)
		}
		if cerr.RetryAfter > 0 {
			w.Header().Set("Retry-After", strconv.Itoa(cerr.RetryAfter))
		}
		writeError(w, cerr.Status, cerr.Text)
		return
	}
	took := time.Since(start)
	answerNow(w, resp)
	a.log.Info("claim ready", "lease_id", resp.LeaseID, "pid", resp.PID, "ws_url", resp.WSURL, "session_id", resp.SessionID,
		"principal_id", p.ID, "ticket_issued", resp.Ticket != "", "binary", resp.Binary, "duration", took)
}

// readClaim reads a claim's body whole, refusing one over max_claim_body.
func (a *api) readClaim(r *http.Request) ([]byte, *gateway.ClaimError) {
	body, err := io.ReadAll(http.MaxBytesReader(nil, r.Body, int64(a.core.Config().MaxClaimBody)))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			return nil, &gateway.ClaimError{Status: http.StatusRequestEntityTooLarge, Outcome: gateway.OutcomeRejected,
				Text: fmt.Sprintf("claim body exceeds max_claim_body (%d bytes); raise max_claim_body or send a smaller config", tooBig.Limit)}
		}
		return nil, &gateway.ClaimError{Status: http.StatusBadRequest, Outcome: gateway.OutcomeRejected, Text: gateway.TextInvalidClaimBody}
	}
	return body, nil
}

// answerNow writes a 200 JSON answer and puts it on the wire before the
// handler returns, so that what follows (the log line) is not on the
// claimant's path. The Content-Length is set first: a flush without it
// would switch the response to chunked encoding.
func answerNow(w http.ResponseWriter, v any) {
	body, err := json.Marshal(v)
	if err != nil {
		writeError(w, http.StatusInternalServerError, "encoding the answer")
		return
	}
	body = append(body, '\n') // as writeJSON's encoder ends it
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(body)
	if f, ok := w.(http.Flusher); ok {
		f.Flush()
	}
}
