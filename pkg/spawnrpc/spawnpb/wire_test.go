package spawnpb

import (
	"bytes"
	"testing"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/known/emptypb"
)

// messageTypes are every message type of spawn.proto, nested ones included.
func messageTypes(t testing.TB) []protoreflect.MessageType {
	t.Helper()
	var out []protoreflect.MessageType
	var walk func(protoreflect.MessageDescriptors)
	walk = func(ms protoreflect.MessageDescriptors) {
		for i := range ms.Len() {
			mt, err := protoregistry.GlobalTypes.FindMessageByName(ms.Get(i).FullName())
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, mt)
			walk(ms.Get(i).Messages())
		}
	}
	walk(File_pkg_spawnrpc_spawnpb_spawn_proto.Messages())
	return out
}

// TestEveryMessageMarshalsItself: the codec's fast path covers every
// message of the file, so no RPC of the service reaches protobuf's
// reflection.
func TestEveryMessageMarshalsItself(t *testing.T) {
	for _, mt := range messageTypes(t) {
		if _, ok := mt.New().Interface().(wireMessage); !ok {
			t.Errorf("%s has no generated wire marshalling", mt.Descriptor().FullName())
		}
	}
}

// samples are messages with every kind of field set, including the
// shapes that differ between an absent and an empty value.
func samples() []proto.Message {
	empty := ""
	label := "Label"
	return []proto.Message{
		&SpawnRequest{LeaseId: "l-1", Entry: "nexus", Config: []byte("engine:\n  name: x\n"), RecallSessionId: "s-1", Principal: "alice", ListenPort: 8080},
		&SpawnResponse{Pid: 4242, CreatedUnixNano: -1},
		&SpawnFailure{Step: SpawnStep_SPAWN_STEP_EXEC},
		&VerifyResponse{Result: VerifyResult_VERIFY_RESULT_WRONG_SECRET},
		&TerminateRequest{LeaseId: "l", Reason: "idle", SkipGrace: true, NoWait: true},
		&TerminateResponse{Exit: &ExitEvent{LeaseId: "l", Pid: 7, ExitCode: -1, Signal: "SIGKILL", Terminated: true, LogPath: "/x", OutputTail: "é\n"}},
		&TerminateResponse{Exit: &ExitEvent{}},
		&ListResponse{Leases: []*Lease{{LeaseId: "a", Adopted: true, CreatedUnixNano: 1 << 62}, {}}},
		&ReloadResponse{Applied: true, Changed: []string{"a", ""}, Binaries: []*Binary{{Name: "n", Label: &empty, Description: &label, ResolvedPath: "/bin/n"}}, BootOnly: []string{"b"}},
		&StatusResponse{Binaries: []*Binary{{Name: "n"}}, BrokerId: "b", Pid: 1, ConfigPath: "/c", ConfigDigest: "d"},
	}
}

// TestCodecRoundTrip: what the codec writes is what protobuf writes, and
// reads back equal; a message of another file goes to protobuf.
func TestCodecRoundTrip(t *testing.T) {
	for _, m := range append(samples(), &emptypb.Empty{}) {
		data, err := Codec{}.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		want, err := proto.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		if got := data.Materialize(); !bytes.Equal(got, want) {
			t.Errorf("%T: codec wrote %x, protobuf %x", m, got, want)
		}
		back := m.ProtoReflect().Type().New().Interface()
		if err := (Codec{}).Unmarshal(mem.BufferSlice{mem.SliceBuffer(want)}, back); err != nil {
			t.Fatalf("%T: %v", m, err)
		}
		if !proto.Equal(back, m) {
			t.Errorf("%T: read back %v, want %v", m, back, m)
		}
	}
}

// FuzzWireAgrees: for any bytes and any message type of the file, the
// generated code decodes what proto.Unmarshal decodes (the same fields,
// unknown ones kept), refuses what it refuses, and writes back the bytes
// proto.Marshal writes.
func FuzzWireAgrees(f *testing.F) {
	types := messageTypes(f)
	for _, m := range samples() {
		data, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		for i, mt := range types {
			if mt.Descriptor() == m.ProtoReflect().Descriptor() {
				f.Add(uint8(i), data)
				f.Add(uint8(i), append(data, data...))
			}
		}
	}
	f.Add(uint8(0), []byte{0x0a, 0x02, 0xff, 0xfe})       // invalid UTF-8
	f.Add(uint8(0), []byte{0x0b, 0x0c})                   // a group where a string goes
	f.Add(uint8(0), []byte{0x08, 0x01, 0xf8, 0xff, 0x01}) // wrong wire type, unknown field
	f.Add(uint8(5), []byte{0x0a, 0x02, 0x08})             // truncated nested message
	f.Fuzz(func(t *testing.T, kind uint8, data []byte) {
		mt := types[int(kind)%len(types)]
		want := mt.New().Interface()
		got := mt.New().Interface()
		wantErr := proto.Unmarshal(data, want)
		gotErr := got.(wireMessage).unmarshalWire(data)
		if (wantErr == nil) != (gotErr == nil) {
			t.Fatalf("%s: protobuf says %v, generated code %v", mt.Descriptor().FullName(), wantErr, gotErr)
		}
		if wantErr != nil {
			return
		}
		if !proto.Equal(got, want) {
			t.Fatalf("%s: decoded %v, protobuf %v", mt.Descriptor().FullName(), got, want)
		}
		w := got.(wireMessage)
		out := w.appendWire(nil)
		if len(out) != w.sizeWire() {
			t.Fatalf("%s: size %d, wrote %d bytes", mt.Descriptor().FullName(), w.sizeWire(), len(out))
		}
		ref, err := proto.Marshal(want)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(out, ref) {
			t.Fatalf("%s: wrote %x, protobuf %x", mt.Descriptor().FullName(), out, ref)
		}
	})
}
