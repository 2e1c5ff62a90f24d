package a2a

import (
	"cmp"
	"encoding/json"
	"strings"

	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// Step is what one instance payload does to the task it belongs to.
type Step int

// The steps a payload can produce. StepNone is most payloads: a delta being
// accumulated, a stream end, a payload of another turn, one with no A2A
// meaning.
const (
	StepNone          Step = iota
	StepWorking            // the task is (again) working: bound, or answered
	StepInputRequired      // the instance asks the client a question
	StepCompleted          // the turn settled with its answer
	StepCanceled           // the instance acknowledged a cancel
)

// Question is an open hitl.request.
type Question struct {
	RequestID string               `json:"request_id"`
	Prompt    string               `json:"prompt"`
	Mode      string               `json:"mode"`
	Choices   []brokerframe.Choice `json:"choices"`
}

// defaultQuestion stands in for a question that came with no prompt.
const defaultQuestion = "the agent is waiting for input"

// Text is the question as the client is asked it, in upstream's rendering:
// the prompt, then each option's id (what an answer echoes) and label.
func (q *Question) Text() string {
	out := q.Prompt
	if out == "" {
		out = defaultQuestion
	}
	if len(q.Choices) == 0 {
		return out
	}
	out += "\n\nAnswer with one of these option ids:"
	for _, c := range q.Choices {
		out += "\n  " + c.ID + " — " + cmp.Or(c.Label, c.ID)
	}
	return out
}

// Turn translates one task's instance payloads into A2A steps, as
// upstream's ingress maps them: the first payload carrying a turn_id binds
// the task to that turn and payloads naming another are ignored; a payload
// naming no turn (a stock instance's status never names one) is the task's.
// Any sign of life moves the task to WORKING once; deltas accumulate and an
// output replaces them; stream.end does not end the task, a status idle
// after the task worked does; hitl.request asks the client;
// cancel.complete cancels.
type Turn struct {
	id       string
	text     strings.Builder
	asking   *Question
	settled  bool
	working  bool
	canceled bool
}

// TurnID is the Nexus turn the task is bound to ("" before the first).
func (t *Turn) TurnID() string { return t.id }

// Answer is the text accumulated so far.
func (t *Turn) Answer() string { return t.text.String() }

// Question is the open question, nil when none.
func (t *Turn) Question() *Question { return t.asking }

// Apply feeds one io payload. Unknown or malformed payloads are StepNone,
// never a failure: the envelope is shared with every broker client.
func (t *Turn) Apply(payload json.RawMessage) Step {
	if t.settled {
		return StepNone
	}
	var p brokerframe.IO
	if json.Unmarshal(payload, &p) != nil {
		return StepNone
	}
	switch p.Type {
	case brokerframe.IOStreamDelta, brokerframe.IOOutput, brokerframe.IOStatus,
		brokerframe.IOHITLRequest, brokerframe.IOCancelComplete, brokerframe.IOStreamEnd:
	default:
		return StepNone
	}
	if p.TurnID != "" {
		if t.id == "" {
			t.id = p.TurnID
		} else if p.TurnID != t.id {
			return StepNone
		}
	}
	if p.Type == brokerframe.IOStatus {
		return t.status(p.State)
	}
	step := t.work()
	switch p.Type {
	case brokerframe.IOStreamDelta:
		t.text.WriteString(p.Content)
	case brokerframe.IOOutput:
		t.text.Reset()
		t.text.WriteString(p.Content)
	case brokerframe.IOHITLRequest:
		t.asking = &Question{RequestID: p.RequestID, Prompt: p.Prompt, Mode: p.Mode, Choices: p.Choices}
		return StepInputRequired
	case brokerframe.IOCancelComplete:
		t.settled, t.canceled = true, true
		return StepCanceled
	}
	return step
}

// work is a sign of life: StepWorking the first time, StepNone after.
func (t *Turn) work() Step {
	if t.working {
		return StepNone
	}
	t.working = true
	return StepWorking
}

// status maps a status payload. An idle settles a task that worked; one
// before any sign of life is the instance saying it is quiet, not a turn
// ending. A blank state says nothing.
func (t *Turn) status(state string) Step {
	switch {
	case state == "":
		return StepNone
	case state == brokerframe.StateIdle:
		if !t.working {
			return StepNone
		}
		t.settled = true
		return StepCompleted
	}
	step := t.work()
	if brokerframe.IsWorkState(state) && state != brokerframe.StateWaiting && t.asking != nil {
		t.asking = nil // answered: back to work
		return StepWorking
	}
	return step
}

// Reply builds the hitl.response payload for a client's answer to q: a
// text naming one of the choices (by id or label) is that choice, anything
// else is free text.
func Reply(q *Question, text string) brokerframe.IO {
	r := brokerframe.IO{Type: brokerframe.IOHITLResponse, RequestID: q.RequestID}
	trimmed := strings.TrimSpace(text)
	for _, c := range q.Choices {
		if trimmed == c.ID || strings.EqualFold(trimmed, c.Label) {
			r.ChoiceID = c.ID
			return r
		}
	}
	r.FreeText = text
	return r
}

// InputText joins a message's text parts with a blank line. A part that is
// not text is refused (ContentTypeNotSupportedError): the input payload is
// one string, so there is nowhere for it to go.
func InputText(m *Message) (string, *Error) {
	texts := make([]string, 0, len(m.Parts))
	for i, p := range m.Parts {
		if !p.IsText() {
			return "", ErrContentType.With("message.parts[%d] is a %s part; this agent accepts text parts only", i, p.kind())
		}
		if strings.TrimSpace(*p.Text) != "" { // a blank part adds nothing
			texts = append(texts, *p.Text)
		}
	}
	if len(texts) == 0 {
		return "", InvalidField("message.parts", "at least one part must carry non-empty text")
	}
	return strings.Join(texts, "\n\n"), nil
}
