// Package spawnpb is the gateway → spawnd RPC, generated from spawn.proto
// (`make proto`): protoc-gen-go's messages, protoc-gen-go-grpc's service,
// and vtprotobuf's MarshalVT/UnmarshalVT/SizeVT, which Codec uses so that no
// RPC of the service goes through protobuf's reflection.
//
// It imports nothing of the project (internal/gateway/layers_test.go
// checks that only pkg/spawnrpc, internal/spawnd and internal/spawnclient
// import it).
package spawnpb

import (
	"fmt"
	"unicode/utf8"

	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
)

// vtMessage is a message of this file.
type vtMessage interface {
	MarshalVT() ([]byte, error)
	UnmarshalVT([]byte) error
}

// Codec is a gRPC codec that marshals this file's messages with
// vtprotobuf's generated code and leaves any other message (go-plugin's
// services) to gRPC's protobuf codec.
type Codec struct{}

// Name is gRPC's protobuf codec's: the bytes on the wire are the same.
func (Codec) Name() string { return proto.Name }

// Marshal encodes v.
func (Codec) Marshal(v any) (mem.BufferSlice, error) {
	m, ok := v.(vtMessage)
	if !ok {
		return encoding.GetCodecV2(proto.Name).Marshal(v)
	}
	b, err := m.MarshalVT()
	if err != nil {
		return nil, err
	}
	return mem.BufferSlice{mem.SliceBuffer(b)}, nil
}

// Unmarshal decodes data into v, and refuses a string field that is not
// UTF-8 as protobuf's decoder does (UnmarshalVT accepts it): spawnd decodes
// every message the gateway sends with this.
func (Codec) Unmarshal(data mem.BufferSlice, v any) error {
	m, ok := v.(vtMessage)
	if !ok {
		return encoding.GetCodecV2(proto.Name).Unmarshal(data, v)
	}
	buf := data.MaterializeToBuffer(mem.DefaultBufferPool())
	defer buf.Free()
	if err := m.UnmarshalVT(buf.ReadOnlyData()); err != nil {
		return err
	}
	return checkUTF8(m)
}

// checkUTF8 refuses m if one of its string fields, nested messages'
// included, is not UTF-8, naming the field. It refuses a message it does
// not list, so one added to spawn.proto without its case here fails every
// test that sends it; TestEveryStringFieldIsChecked names a field a case
// misses.
func checkUTF8(m vtMessage) error {
	switch m := m.(type) {
	case *SpawnFailure, *SpawnResponse, *VerifyResponse, *ListRequest,
		*WatchRequest, *RecordResponse, *StatusRequest, *SpawnReply, *RecordReply:
		return nil
	case *SpawnCall:
		return checkUTF8(m.GetRequest())
	case *RecordCall:
		return checkUTF8(m.GetRequest())
	case *SpawnRequest:
		return stringsUTF8("SpawnRequest", "lease_id", m.GetLeaseId(), "entry", m.GetEntry(),
			"recall_session_id", m.GetRecallSessionId(), "principal", m.GetPrincipal(), "pool", m.GetPool())
	case *VerifyRequest:
		return stringsUTF8("VerifyRequest", "lease_id", m.GetLeaseId(), "secret", m.GetSecret())
	case *TerminateRequest:
		return stringsUTF8("TerminateRequest", "lease_id", m.GetLeaseId(), "reason", m.GetReason())
	case *TerminateResponse:
		return checkUTF8(m.GetExit())
	case *Lease:
		return stringsUTF8("Lease", "lease_id", m.GetLeaseId(), "principal", m.GetPrincipal(),
			"session_id", m.GetSessionId(), "entry", m.GetEntry(), "pool", m.GetPool())
	case *ListResponse:
		for _, l := range m.GetLeases() {
			if err := checkUTF8(l); err != nil {
				return err
			}
		}
		return nil
	case *ExitEvent:
		return stringsUTF8("ExitEvent", "lease_id", m.GetLeaseId(), "signal", m.GetSignal(),
			"log_path", m.GetLogPath(), "output_tail", m.GetOutputTail())
	case *RecordRequest:
		return stringsUTF8("RecordRequest", "lease_id", m.GetLeaseId(), "session_id", m.GetSessionId(), "principal", m.GetPrincipal())
	case *ReloadRequest:
		return stringsUTF8("ReloadRequest", "config_digest", m.GetConfigDigest())
	case *ReloadResponse:
		if err := stringsUTF8("ReloadResponse", "error", m.GetError()); err != nil {
			return err
		}
		if err := repeatedUTF8("ReloadResponse", "changed", m.GetChanged()); err != nil {
			return err
		}
		if err := repeatedUTF8("ReloadResponse", "boot_only", m.GetBootOnly()); err != nil {
			return err
		}
		return binariesUTF8(m.GetBinaries())
	case *Binary:
		return stringsUTF8("Binary", "name", m.GetName(), "label", m.GetLabel(),
			"description", m.GetDescription(), "resolved_path", m.GetResolvedPath())
	case *StatusResponse:
		if err := stringsUTF8("StatusResponse", "broker_id", m.GetBrokerId(),
			"config_path", m.GetConfigPath(), "config_digest", m.GetConfigDigest(),
			"journal_error", m.GetJournalError()); err != nil {
			return err
		}
		return binariesUTF8(m.GetBinaries())
	case *BindingRequest:
		return stringsUTF8("BindingRequest", "session_id", m.GetSessionId(), "principal", m.GetPrincipal())
	case *BindingResponse:
		return stringsUTF8("BindingResponse", "entry", m.GetEntry())
	}
	return fmt.Errorf("%T: spawnpb.Codec has no UTF-8 check for this message (add its case to checkUTF8)", m)
}

// errNotUTF8 is protobuf's refusal, naming the field.
func errNotUTF8(msg, field string) error {
	return fmt.Errorf("spawnpb.%s.%s: string field contains invalid UTF-8", msg, field)
}

// stringsUTF8 refuses the first of msg's fields, given as name, value
// pairs, whose value is not UTF-8.
func stringsUTF8(msg string, fields ...string) error {
	for i := 0; i+1 < len(fields); i += 2 {
		if !utf8.ValidString(fields[i+1]) {
			return errNotUTF8(msg, fields[i])
		}
	}
	return nil
}

// repeatedUTF8 refuses msg's repeated string field if one of its values
// is not UTF-8.
func repeatedUTF8(msg, field string, values []string) error {
	for _, v := range values {
		if !utf8.ValidString(v) {
			return errNotUTF8(msg, field)
		}
	}
	return nil
}

// binariesUTF8 refuses the first Binary with a field that is not UTF-8.
func binariesUTF8(bs []*Binary) error {
	for _, b := range bs {
		if err := checkUTF8(b); err != nil {
			return err
		}
	}
	return nil
}
