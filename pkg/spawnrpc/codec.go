package spawnrpc

import (
	"errors"
	"unicode/utf8"

	"google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// Codec is the gRPC codec of both ends: spawnpb's messages go through
// vtprotobuf's generated code (spawnpb.Codec), and the health check's,
// the one RPC of another service that runs while all is idle (the
// gateway's probe, every second), through the few lines below. Anything else (go-plugin's services, on attach) goes through
// protobuf's reflection, whose code would otherwise stay resident in both
// processes (docs/performance.md).
type Codec struct{ spawnpb.Codec }

// healthField is the one field of both health messages: the request's
// service, the response's status.
const healthField protowire.Number = 1

var errHealthWire = errors.New("grpc.health.v1 message: invalid wire format")

// Marshal encodes v.
func (c Codec) Marshal(v any) (mem.BufferSlice, error) {
	var b []byte
	switch m := v.(type) {
	case *grpc_health_v1.HealthCheckRequest:
		if m.Service != "" {
			b = protowire.AppendString(protowire.AppendTag(b, healthField, protowire.BytesType), m.Service)
		}
	case *grpc_health_v1.HealthCheckResponse:
		if m.Status != 0 {
			b = protowire.AppendVarint(protowire.AppendTag(b, healthField, protowire.VarintType), uint64(int64(m.Status)))
		}
	default:
		return c.Codec.Marshal(v)
	}
	return mem.BufferSlice{mem.SliceBuffer(b)}, nil
}

// Unmarshal decodes data into v. Of a health message it keeps the one
// field and refuses what protobuf refuses; other fields, which neither
// side reads, are skipped.
func (c Codec) Unmarshal(data mem.BufferSlice, v any) error {
	req, isReq := v.(*grpc_health_v1.HealthCheckRequest)
	resp, isResp := v.(*grpc_health_v1.HealthCheckResponse)
	switch {
	case isReq:
		req.Service = ""
	case isResp:
		resp.Status = 0
	default:
		return c.Codec.Unmarshal(data, v)
	}
	buf := data.MaterializeToBuffer(mem.DefaultBufferPool())
	defer buf.Free()
	for b := buf.ReadOnlyData(); len(b) > 0; {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 || num > protowire.MaxValidNumber {
			return errHealthWire
		}
		b = b[n:]
		switch {
		case isReq && num == healthField && typ == protowire.BytesType:
			s, n := protowire.ConsumeBytes(b)
			if n < 0 || !utf8.Valid(s) {
				return errHealthWire
			}
			req.Service, b = string(s), b[n:]
		case isResp && num == healthField && typ == protowire.VarintType:
			x, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return errHealthWire
			}
			resp.Status, b = grpc_health_v1.HealthCheckResponse_ServingStatus(int32(x)), b[n:]
		default:
			if n = protowire.ConsumeFieldValue(num, typ, b); n < 0 {
				return errHealthWire
			}
			b = b[n:]
		}
	}
	return nil
}
