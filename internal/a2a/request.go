package a2a

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
)

// The checks both bindings make of a request before the door acts on it,
// and the shapes of what they answer.

// MaxBody bounds an A2A request body: one message of text.
const MaxBody = 1 << 20

// VersionOK: an absent A2A-Version means 1.0; anything else but 1.0 is
// refused.
func VersionOK(r *http.Request) *Error {
	v := strings.TrimSpace(r.Header.Get("A2A-Version"))
	if v == "" || v == ProtocolVersion {
		return nil
	}
	return ErrVersionUnsupported.With("A2A-Version %q is not supported; this agent speaks A2A %s", v, ProtocolVersion)
}

// ReadBody reads a bounded request body, into a buffer of its announced
// length when it has one.
func ReadBody(r *http.Request) ([]byte, *Error, bool) {
	rd := http.MaxBytesReader(nil, r.Body, MaxBody)
	var body []byte
	var err error
	if n := r.ContentLength; n > 0 && n <= MaxBody {
		body = make([]byte, n)
		_, err = io.ReadFull(rd, body)
	} else {
		body, err = io.ReadAll(rd)
	}
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			return nil, ErrInvalidRequest.With("request body exceeds %d bytes; send a shorter message", tooBig.Limit), true
		}
		return nil, ErrParse.With("reading the request body: %v", err), false
	}
	return body, nil, false
}

// CheckSend validates a SendMessageRequest and returns its input text.
func CheckSend(req *SendRequest) (string, *Error) {
	m := req.Message
	switch {
	case m == nil:
		return "", InvalidField("message", "message is required")
	case m.MessageID == "":
		return "", InvalidField("message.messageId", "message id is required")
	case m.Role != RoleUser && m.Role != RoleAgent:
		return "", InvalidField("message.role", "role must be %s or %s, got %q", RoleUser, RoleAgent, m.Role)
	case len(m.Parts) == 0:
		return "", InvalidField("message.parts", "at least one part is required")
	case m.Role != RoleUser:
		return "", InvalidField("message.role", "an inbound message must carry %s, got %q", RoleUser, m.Role)
	}
	if c := req.Configuration; c != nil {
		if bad := NonNegative(c.HistoryLength, "configuration.historyLength"); bad != nil {
			return "", bad
		}
		if len(c.PushConfig) > 0 && string(c.PushConfig) != "null" {
			return "", NoPush("")
		}
		if modes := c.AcceptedOutputModes; len(modes) > 0 && !acceptsText(modes) {
			return "", ErrContentType.With("this agent produces %s; the request accepts only %s", TextModes[0], strings.Join(modes, ", "))
		}
	}
	return InputText(m)
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

// TrimTask applies historyLength and, for lists, includeArtifacts.
func TrimTask(t *Task, historyLength *int, artifacts bool) {
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

// NonNegative refuses a negative historyLength as upstream's codec does.
func NonNegative(n *int, field string) *Error {
	if n != nil && *n < 0 {
		return InvalidField(field, "must not be negative, got %d", *n)
	}
	return nil
}

// QueryInt reads query parameter name's integer value s; "" is 0.
func QueryInt(s, name string) (int, *Error) {
	if s == "" {
		return 0, nil
	}
	var n int
	if err := json.Unmarshal([]byte(s), &n); err != nil {
		return 0, InvalidField(name, "must be an integer, got %q", s)
	}
	return n, nil
}

// RESTFrame is ev as the HTTP+JSON binding's SSE data line carries it.
func RESTFrame(ev Event) []byte {
	data, _ := json.Marshal(ev)
	return data
}
