package spawnrpc

import (
	"bytes"
	"testing"

	"google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
)

// healthMessage is a fresh health message: the response if kind, else
// the request.
func healthMessage(kind bool) proto.Message {
	if kind {
		return &grpc_health_v1.HealthCheckResponse{}
	}
	return &grpc_health_v1.HealthCheckRequest{}
}

// FuzzHealthCodecAgrees: the codec reads a health message's field as
// protobuf does and refuses what it refuses, and writes the bytes protobuf
// writes.
func FuzzHealthCodecAgrees(f *testing.F) {
	for _, m := range []proto.Message{
		&grpc_health_v1.HealthCheckRequest{Service: "plugin"},
		&grpc_health_v1.HealthCheckResponse{Status: grpc_health_v1.HealthCheckResponse_SERVING},
	} {
		data, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(false, data)
		f.Add(true, data)
	}
	f.Add(false, []byte{0x0a, 0x01, 0xff})                  // invalid UTF-8
	f.Add(true, []byte{0x08, 0xff, 0xff, 0xff, 0xff, 0x0f}) // a negative status
	f.Add(true, []byte{0x12, 0x00, 0x08, 0x02})             // an unknown field first
	f.Fuzz(func(t *testing.T, kind bool, data []byte) {
		want, got := healthMessage(kind), healthMessage(kind)
		wantErr := proto.Unmarshal(data, want)
		gotErr := Codec{}.Unmarshal(mem.BufferSlice{mem.SliceBuffer(data)}, got)
		if (wantErr == nil) != (gotErr == nil) {
			t.Fatalf("%T %x: protobuf says %v, the codec %v", want, data, wantErr, gotErr)
		}
		if wantErr != nil {
			return
		}
		// The codec skips unknown fields where protobuf keeps them.
		want.ProtoReflect().SetUnknown(nil)
		if !proto.Equal(got, want) {
			t.Fatalf("%x: decoded %v, protobuf %v", data, got, want)
		}
		out, err := Codec{}.Marshal(got)
		if err != nil {
			t.Fatal(err)
		}
		ref, err := proto.Marshal(want)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(out.Materialize(), ref) {
			t.Fatalf("wrote %x, protobuf %x", out.Materialize(), ref)
		}
	})
}
