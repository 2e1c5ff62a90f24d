package brokerframe

// IO payload types carried inside io frames (the flat union of nexus's
// nexus.io.broker plugin). Instance → client: output, stream.delta,
// stream.end, status, approval.request, hitl.request, cancel.complete.
// Client → instance: input, approval.response, hitl.response, cancel.
const (
	IOInput            = "input"
	IOOutput           = "output"
	IOStreamDelta      = "stream.delta"
	IOStreamEnd        = "stream.end"
	IOStatus           = "status"
	IOApprovalRequest  = "approval.request"
	IOApprovalResponse = "approval.response"
	IOHITLRequest      = "hitl.request"
	IOHITLResponse     = "hitl.response"
	IOCancel           = "cancel"
	IOCancelComplete   = "cancel.complete"
)

// Choice is one option of a hitl.request.
type Choice struct {
	ID    string `json:"id"`
	Label string `json:"label"`
}

// IO is the flat IO payload. Every field but Type is optional; which ones a
// payload carries depends on its Type.
type IO struct {
	Type         string   `json:"type"`
	TurnID       string   `json:"turn_id,omitempty"`
	Content      string   `json:"content,omitempty"`
	Role         string   `json:"role,omitempty"`
	FinishReason string   `json:"finish_reason,omitempty"`
	State        string   `json:"state,omitempty"`
	Detail       string   `json:"detail,omitempty"`
	PromptID     string   `json:"prompt_id,omitempty"`
	Description  string   `json:"description,omitempty"`
	ToolCall     string   `json:"tool_call,omitempty"`
	Risk         string   `json:"risk,omitempty"`
	Approved     *bool    `json:"approved,omitempty"`
	Always       *bool    `json:"always,omitempty"`
	RequestID    string   `json:"request_id,omitempty"`
	Prompt       string   `json:"prompt,omitempty"`
	Mode         string   `json:"mode,omitempty"`
	Choices      []Choice `json:"choices,omitempty"`
	ChoiceID     string   `json:"choice_id,omitempty"`
	FreeText     string   `json:"free_text,omitempty"`
	Resumable    *bool    `json:"resumable,omitempty"`
	Source       string   `json:"source,omitempty"`
}

// Turn states read from status payloads. StateIdle settles a turn; the
// others mark one in flight: the work states the wire contract names
// (thinking, working, streaming, tool, waiting) and those a stock nexus
// reports (tool_running, cancelling), so a turn is never reaped as idle for
// a name one side uses and the other does not. Anything else is unknown and
// ignored.
const (
	StateIdle        = "idle"
	StateThinking    = "thinking"
	StateWorking     = "working"
	StateStreaming   = "streaming"
	StateTool        = "tool"
	StateToolRunning = "tool_running"
	StateWaiting     = "waiting"
	StateCancelling  = "cancelling"
)

// IsWorkState reports whether state marks a turn in flight.
func IsWorkState(state string) bool {
	switch state {
	case StateThinking, StateWorking, StateStreaming, StateTool, StateToolRunning, StateWaiting, StateCancelling:
		return true
	}
	return false
}
