// Package a2a is the broker's A2A 1.0 side that does not need a lease: the
// protocol's JSON shapes, the translation of an instance's IO payloads into
// task states and artifacts (Turn), the durable task store
// (<state_dir>/a2a-tasks.jsonl) and the conversation index
// (<state_dir>/a2a-contexts.jsonl). The gateway drives them.
//
// It imports nothing of the gateway (internal/gateway and below it), nor
// the layers over it (the A2A door, the HTTP face, the console,
// internal/brokerd), spawnd's client or its RPC
// (internal/gateway/layers_test.go checks it).
package a2a

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"
)

// ProtocolVersion is the A2A version served; an absent A2A-Version header
// means it.
const ProtocolVersion = "1.0"

// Task states, as A2A 1.0 spells them on the wire.
const (
	StateSubmitted     = "TASK_STATE_SUBMITTED"
	StateWorking       = "TASK_STATE_WORKING"
	StateInputRequired = "TASK_STATE_INPUT_REQUIRED"
	// StateAuthRequired is never reported by this broker; a ListTasks
	// filter may still name it.
	StateAuthRequired = "TASK_STATE_AUTH_REQUIRED"
	StateCompleted    = "TASK_STATE_COMPLETED"
	StateFailed       = "TASK_STATE_FAILED"
	StateCanceled     = "TASK_STATE_CANCELED"
	StateRejected     = "TASK_STATE_REJECTED"
)

// KnownState reports whether state is one A2A 1.0 defines.
func KnownState(state string) bool {
	switch state {
	case StateSubmitted, StateWorking, StateInputRequired, StateAuthRequired,
		StateCompleted, StateFailed, StateCanceled, StateRejected:
		return true
	}
	return false
}

// Message roles.
const (
	RoleUser  = "ROLE_USER"
	RoleAgent = "ROLE_AGENT"
)

// Terminal reports whether state ends a task.
func Terminal(state string) bool {
	switch state {
	case StateCompleted, StateFailed, StateCanceled, StateRejected:
		return true
	}
	return false
}

// Part is one message or artifact part. Exactly one of Text, Raw, URL and
// Data is set on the wire; the ingress only ever produces Text.
type Part struct {
	Text      *string         `json:"text,omitempty"`
	Raw       []byte          `json:"raw,omitempty"`
	URL       *string         `json:"url,omitempty"`
	Data      json.RawMessage `json:"data,omitempty"`
	Filename  string          `json:"filename,omitempty"`
	MediaType string          `json:"mediaType,omitempty"`
	Metadata  map[string]any  `json:"metadata,omitempty"`
	// Frag is where the store keeps a long text instead of Text; it never
	// reaches the wire (the store reconstructs Text on read).
	Frag *Manifest `json:"frag,omitempty"`
}

// TextPart is a text part.
func TextPart(s string) Part { return Part{Text: &s} }

// IsText reports whether p is a text part (and only that).
func (p Part) IsText() bool {
	return p.Text != nil && p.Raw == nil && p.URL == nil && len(p.Data) == 0
}

// kind names the part's first content member set, as errors name it.
func (p Part) kind() string {
	switch {
	case p.Text != nil:
		return "text"
	case p.Raw != nil:
		return "raw"
	case p.URL != nil:
		return "url"
	case len(p.Data) != 0:
		return "data"
	}
	return ""
}

// StateName is a task state without its TASK_STATE_ prefix, as messages
// and log lines name it.
func StateName(state string) string { return strings.TrimPrefix(state, "TASK_STATE_") }

// Message is an A2A message.
type Message struct {
	MessageID        string         `json:"messageId"`
	ContextID        string         `json:"contextId,omitempty"`
	TaskID           string         `json:"taskId,omitempty"`
	Role             string         `json:"role"`
	Parts            []Part         `json:"parts"`
	Metadata         map[string]any `json:"metadata,omitempty"`
	Extensions       []string       `json:"extensions,omitempty"`
	ReferenceTaskIDs []string       `json:"referenceTaskIds,omitempty"`
}

// Status is a task's status.
type Status struct {
	State     string     `json:"state"`
	Message   *Message   `json:"message,omitempty"`
	Timestamp *time.Time `json:"timestamp,omitempty"`
}

// Artifact is a task output.
type Artifact struct {
	ArtifactID  string         `json:"artifactId"`
	Name        string         `json:"name,omitempty"`
	Description string         `json:"description,omitempty"`
	Parts       []Part         `json:"parts"`
	Metadata    map[string]any `json:"metadata,omitempty"`
}

// Task is an A2A task.
type Task struct {
	ID        string         `json:"id"`
	ContextID string         `json:"contextId"`
	Status    Status         `json:"status"`
	Artifacts []Artifact     `json:"artifacts,omitempty"`
	History   []Message      `json:"history,omitempty"`
	Metadata  map[string]any `json:"metadata,omitempty"`
}

// Clone copies t so that nothing done to the copy's fields, slices or
// parts reaches t. What is shared is never changed once built: texts, raw
// bytes, data and metadata maps.
func (t *Task) Clone() Task {
	c := *t
	c.Status.Message = t.Status.Message.clone()
	if t.History != nil {
		c.History = make([]Message, len(t.History))
		for i := range t.History {
			c.History[i] = *t.History[i].clone()
		}
	}
	if t.Artifacts != nil {
		c.Artifacts = make([]Artifact, len(t.Artifacts))
		for i, a := range t.Artifacts {
			a.Parts = slices.Clone(a.Parts)
			c.Artifacts[i] = a
		}
	}
	return c
}

func (m *Message) clone() *Message {
	if m == nil {
		return nil
	}
	c := *m
	c.Parts = slices.Clone(m.Parts)
	return &c
}

// StatusUpdate is a streamed TaskStatusUpdateEvent.
type StatusUpdate struct {
	TaskID    string `json:"taskId"`
	ContextID string `json:"contextId"`
	Status    Status `json:"status"`
}

// ArtifactUpdate is a streamed TaskArtifactUpdateEvent.
type ArtifactUpdate struct {
	TaskID    string   `json:"taskId"`
	ContextID string   `json:"contextId"`
	Artifact  Artifact `json:"artifact"`
	Append    bool     `json:"append,omitempty"`
	LastChunk bool     `json:"lastChunk,omitempty"`
}

// Event is one StreamResponse: exactly one field set.
type Event struct {
	Task           *Task           `json:"task,omitempty"`
	Message        *Message        `json:"message,omitempty"`
	StatusUpdate   *StatusUpdate   `json:"statusUpdate,omitempty"`
	ArtifactUpdate *ArtifactUpdate `json:"artifactUpdate,omitempty"`
}

// Final reports whether e ends a stream: a status update to a terminal
// state, or INPUT_REQUIRED (the turn waits on the client).
func (e Event) Final() bool {
	switch {
	case e.StatusUpdate != nil:
		return Terminal(e.StatusUpdate.Status.State) || e.StatusUpdate.Status.State == StateInputRequired
	case e.Task != nil:
		return Terminal(e.Task.Status.State) || e.Task.Status.State == StateInputRequired
	}
	return false
}

// SendConfig is SendMessageRequest.configuration.
type SendConfig struct {
	AcceptedOutputModes []string        `json:"acceptedOutputModes,omitempty"`
	ReturnImmediately   bool            `json:"returnImmediately,omitempty"`
	HistoryLength       *int            `json:"historyLength,omitempty"`
	PushConfig          json.RawMessage `json:"taskPushNotificationConfig,omitempty"`
}

// SendRequest is SendMessageRequest.
type SendRequest struct {
	Tenant        string         `json:"tenant,omitempty"`
	Configuration *SendConfig    `json:"configuration,omitempty"`
	Message       *Message       `json:"message"`
	Metadata      map[string]any `json:"metadata,omitempty"`
}

// TaskRequest is GetTaskRequest, CancelTaskRequest and
// SubscribeToTaskRequest.
type TaskRequest struct {
	Tenant        string         `json:"tenant,omitempty"`
	ID            string         `json:"id"`
	HistoryLength *int           `json:"historyLength,omitempty"`
	Metadata      map[string]any `json:"metadata,omitempty"`
}

// ListRequest is ListTasksRequest.
type ListRequest struct {
	Tenant               string     `json:"tenant,omitempty"`
	ContextID            string     `json:"contextId,omitempty"`
	Status               string     `json:"status,omitempty"`
	PageSize             int        `json:"pageSize,omitempty"`
	PageToken            string     `json:"pageToken,omitempty"`
	HistoryLength        *int       `json:"historyLength,omitempty"`
	StatusTimestampAfter *time.Time `json:"statusTimestampAfter,omitempty"`
	IncludeArtifacts     bool       `json:"includeArtifacts,omitempty"`
}

// ListResponse is ListTasksResponse.
type ListResponse struct {
	Tasks         []Task `json:"tasks"`
	TotalSize     int    `json:"totalSize"`
	PageSize      int    `json:"pageSize"`
	NextPageToken string `json:"nextPageToken"`
}

// Error is an A2A error: its JSON-RPC code, its HTTP+JSON status and
// gRPC-style status name, and its ErrorInfo reason.
type Error struct {
	Code       int
	HTTPStatus int
	Status     string
	Reason     string
	Message    string
	// Metadata is the ErrorInfo's metadata, when the error has any.
	Metadata map[string]string
	// Violations are the request fields an InvalidParams error names (a
	// google.rpc.BadRequest detail).
	Violations []FieldViolation
}

// FieldViolation is one request field that failed validation, and why.
type FieldViolation struct {
	Field       string `json:"field"`
	Description string `json:"description"`
}

// InvalidField is upstream's InvalidParamsError for one field: the
// standard message, the field and why in a BadRequest detail.
func InvalidField(field, format string, args ...any) *Error {
	return violation(ErrInvalidParams.With("Invalid parameters"), field, fmt.Sprintf(format, args...))
}

// InvalidEnvelope is upstream's InvalidRequestError for one field of a
// JSON-RPC envelope.
func InvalidEnvelope(field, format string, args ...any) *Error {
	return violation(ErrInvalidRequest.With("Request payload validation error"), field, fmt.Sprintf(format, args...))
}

func violation(e *Error, field, why string) *Error {
	e.Violations = []FieldViolation{{Field: field, Description: why}}
	return e
}

func (e *Error) Error() string { return e.Message }

// With returns a copy of e carrying msg.
func (e *Error) With(format string, args ...any) *Error {
	c := *e
	c.Message = fmt.Sprintf(format, args...)
	return &c
}

// TaskNotFound is ErrTaskNotFound for id, its ErrorInfo naming the task as
// upstream's does.
func TaskNotFound(id string) *Error { return ErrTaskNotFound.WithMeta("taskId", id) }

// WithMeta returns a copy of e whose ErrorInfo metadata also carries the
// key, value pairs kv.
func (e *Error) WithMeta(kv ...string) *Error {
	c := *e
	c.Metadata = make(map[string]string, len(e.Metadata)+len(kv)/2)
	maps.Copy(c.Metadata, e.Metadata)
	for i := 0; i+1 < len(kv); i += 2 {
		c.Metadata[kv[i]] = kv[i+1]
	}
	return &c
}

// The A2A errors the ingress answers, with A2A 1.0's codes.
var (
	ErrParse              = &Error{-32700, 400, "INVALID_ARGUMENT", "PARSE_ERROR", "parse error", nil, nil}
	ErrInvalidRequest     = &Error{-32600, 400, "INVALID_ARGUMENT", "INVALID_REQUEST", "invalid request", nil, nil}
	ErrMethodNotFound     = &Error{-32601, 404, "NOT_FOUND", "METHOD_NOT_FOUND", "method not found", nil, nil}
	ErrInvalidParams      = &Error{-32602, 400, "INVALID_ARGUMENT", "INVALID_PARAMS", "invalid params", nil, nil}
	ErrInternal           = &Error{-32603, 500, "INTERNAL", "INTERNAL_ERROR", "internal error", nil, nil}
	ErrTaskNotFound       = &Error{-32001, 404, "NOT_FOUND", "TASK_NOT_FOUND", "Task not found", nil, nil}
	ErrTaskNotCancelable  = &Error{-32002, 400, "FAILED_PRECONDITION", "TASK_NOT_CANCELABLE", "task cannot be canceled", nil, nil}
	ErrPushNotSupported   = &Error{-32003, 400, "FAILED_PRECONDITION", "PUSH_NOTIFICATION_NOT_SUPPORTED", "push notifications are not supported", nil, nil}
	ErrUnsupportedOp      = &Error{-32004, 400, "FAILED_PRECONDITION", "UNSUPPORTED_OPERATION", "this operation is not supported", nil, nil}
	ErrContentType        = &Error{-32005, 400, "INVALID_ARGUMENT", "CONTENT_TYPE_NOT_SUPPORTED", "incompatible content types", nil, nil}
	ErrExtendedCard       = &Error{-32007, 400, "FAILED_PRECONDITION", "EXTENDED_AGENT_CARD_NOT_CONFIGURED", "extended agent card not configured", nil, nil}
	ErrVersionUnsupported = &Error{-32009, 400, "FAILED_PRECONDITION", "VERSION_NOT_SUPPORTED", "this version is not supported", nil, nil}
)

// AsError returns err as an *Error, ErrInternal for anything else.
func AsError(err error) *Error {
	var e *Error
	if errors.As(err, &e) {
		return e
	}
	return ErrInternal.With("%s", err.Error())
}
