package a2a

import (
	"bytes"
	"encoding/json"
)

// The JSON-RPC 2.0 envelope of the A2A door's /agents/{name}/a2a binding.

const (
	errorInfoType  = "type.googleapis.com/google.rpc.ErrorInfo"
	badRequestType = "type.googleapis.com/google.rpc.BadRequest"
	a2aDomain      = "a2a-protocol.org"
	// notImplemented is the detail GetExtendedAgentCard carries with its
	// UnsupportedOperationError.
	notImplemented = "OPERATION_NOT_IMPLEMENTED"
	// textNoPush is why a push-notification request is refused.
	textNoPush = "this broker does not deliver push notifications; the agent card declares capabilities.pushNotifications as false"
)

// ErrorDetails renders an error's google.rpc details: its ErrorInfo, with
// the error's metadata when it has any, and the fields an InvalidParams
// error names as a BadRequest.
func ErrorDetails(e *Error) []map[string]any {
	d := map[string]any{"@type": errorInfoType, "reason": e.Reason, "domain": a2aDomain}
	if len(e.Metadata) > 0 {
		d["metadata"] = e.Metadata
	}
	if len(e.Violations) > 0 {
		return []map[string]any{d, {"@type": badRequestType, "fieldViolations": e.Violations}}
	}
	return []map[string]any{d}
}

// Unimplemented is the answer of an operation this ingress does not offer
// (the extended card), in upstream's words: its ErrorInfo names the
// operation, and its detail says not yet rather than never.
func Unimplemented(op string) *Error {
	return ErrUnsupportedOp.With("operation %q is not yet implemented by this broker's A2A ingress", op).
		WithMeta("operation", op, "detail", notImplemented)
}

// NoPush is the answer of a push-notification operation (op) or of a send
// asking for push notifications (op ""): PushNotificationNotSupportedError,
// which a client's errors.Is recognises, since the card declares no push.
func NoPush(op string) *Error {
	if op == "" {
		return ErrPushNotSupported.With(textNoPush)
	}
	return ErrPushNotSupported.With("operation %q refused: %s", op, textNoPush).WithMeta("operation", op)
}

// RPCRequest is a JSON-RPC 2.0 request's envelope.
type RPCRequest struct {
	JSONRPC string          `json:"jsonrpc"`
	Method  string          `json:"method"`
	Params  json.RawMessage `json:"params"`
	ID      json.RawMessage `json:"id"`
}

// sendRPC is a send's request (SendMessage, SendStreamingMessage) decoded
// with its params in one pass: the path to a turn's input is the hot one,
// and the two passes of RPCRequest scan its params twice.
type sendRPC struct {
	JSONRPC string          `json:"jsonrpc"`
	Method  string          `json:"method"`
	Params  *SendRequest    `json:"params"`
	ID      json.RawMessage `json:"id"`
}

// DecodeRPC decodes a JSON-RPC request. A send whose params are a
// SendMessageRequest comes back whole, its params in sent; anything else
// (another method, params that do not decode as a send's, a body that is
// not JSON) takes the two passes, the envelope here and the params by
// method, so every error reads as before. The one difference: a body naming
// params twice gets the two merged where the two passes keep the last
// (JSON leaves duplicate names undefined).
func DecodeRPC(body []byte) (req RPCRequest, sent *SendRequest, err error) {
	if bytes.Contains(body, []byte("Send")) {
		var one sendRPC
		if json.Unmarshal(body, &one) == nil && one.Params != nil && (one.Method == "SendMessage" || one.Method == "SendStreamingMessage") {
			return RPCRequest{JSONRPC: one.JSONRPC, Method: one.Method, ID: one.ID}, one.Params, nil
		}
	}
	err = json.Unmarshal(body, &req)
	return req, nil, err
}

// RPCError is a JSON-RPC error object.
type RPCError struct {
	Code    int              `json:"code"`
	Message string           `json:"message"`
	Data    []map[string]any `json:"data,omitempty"`
}

// RPCResponse is a JSON-RPC response.
type RPCResponse struct {
	JSONRPC string          `json:"jsonrpc"`
	ID      json.RawMessage `json:"id"`
	Result  any             `json:"result,omitempty"`
	Error   *RPCError       `json:"error,omitempty"`
}

// RPCFail is the response of id failing with e.
func RPCFail(id json.RawMessage, e *Error) RPCResponse {
	if id == nil {
		id = json.RawMessage("null")
	}
	return RPCResponse{JSONRPC: "2.0", ID: id, Error: &RPCError{Code: e.Code, Message: e.Message, Data: ErrorDetails(e)}}
}

// RPCOK is the response of id answering v.
func RPCOK(id json.RawMessage, v any) RPCResponse {
	return RPCResponse{JSONRPC: "2.0", ID: id, Result: v}
}

// ValidRPCID says whether id is a JSON-RPC id (a string, a number, null)
// or absent.
func ValidRPCID(id json.RawMessage) bool {
	if len(id) == 0 {
		return true // a notification; answered anyway
	}
	switch id[0] {
	case '"', '-', '0', '1', '2', '3', '4', '5', '6', '7', '8', '9', 'n':
		return true
	}
	return false
}
