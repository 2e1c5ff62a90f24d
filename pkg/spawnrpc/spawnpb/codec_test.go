package spawnpb

import (
	"bytes"
	"strings"
	"testing"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
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

// TestEveryMessageMarshalsItself: the codec's vtprotobuf path covers every
// message of the file, so no RPC of the service reaches protobuf's
// reflection.
func TestEveryMessageMarshalsItself(t *testing.T) {
	for _, mt := range messageTypes(t) {
		if _, ok := mt.New().Interface().(vtMessage); !ok {
			t.Errorf("%s has no vtprotobuf marshalling (make proto)", mt.Descriptor().FullName())
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
		&SpawnFailure{Step: SpawnStep_SPAWN_STEP_JOURNAL},
		&VerifyRequest{LeaseId: "l", Secret: "s"},
		&VerifyResponse{Result: VerifyResult_VERIFY_RESULT_WRONG_SECRET},
		&TerminateRequest{LeaseId: "l", Reason: "idle", SkipGrace: true, NoWait: true},
		&TerminateResponse{Exit: &ExitEvent{LeaseId: "l", Pid: 7, ExitCode: -1, Signal: "SIGKILL", Terminated: true, LogPath: "/x", OutputTail: "é\n"}},
		&TerminateResponse{Exit: &ExitEvent{}},
		&ListResponse{Leases: []*Lease{{LeaseId: "a", Principal: "p", SessionId: "s", Entry: "e", Pid: 3, Adopted: true, CreatedUnixNano: 1 << 62}, {}}},
		&RecordRequest{LeaseId: "l", SessionId: "s"},
		&ReloadRequest{ConfigDigest: "d", RefuseBootOnly: true},
		&ReloadResponse{Applied: true, Error: "e", Changed: []string{"a", ""}, Binaries: []*Binary{{Name: "n", Label: &empty, Description: &label, ResolvedPath: "/bin/n"}}, BootOnly: []string{"b"}},
		&StatusResponse{Binaries: []*Binary{{Name: "n"}}, BrokerId: "b", Pid: 1, ConfigPath: "/c", ConfigDigest: "d", JournalError: "j"},
		&BindingRequest{SessionId: "s", Principal: "p"},
		&BindingResponse{Entry: "e", Ownership: Ownership_OWNERSHIP_OTHER},
		&SpawnCall{CallId: 1 << 40, Request: &SpawnRequest{LeaseId: "l-2", Entry: "nexus", Config: []byte("a: b\n"), Pool: "default"}},
		&SpawnReply{CallId: 3, Response: &SpawnResponse{Pid: 9, Verifier: []byte{1, 2}}},
		&SpawnReply{CallId: 4, Status: []byte{0x08, 0x0d, 0x12, 0x01, 'x'}},
		&RecordCall{CallId: 5, Request: &RecordRequest{LeaseId: "l", SessionId: "s", Principal: "p", HandOut: true}},
		&RecordReply{CallId: 6, Response: &RecordResponse{}},
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

// eachBadString calls f with a message of mt for every string field
// reachable from it (singular, optional or repeated, through its nested
// messages), that field holding invalid UTF-8.
func eachBadString(mt protoreflect.MessageType, f func(m proto.Message, field protoreflect.FieldDescriptor)) {
	var walk func(path []protoreflect.FieldDescriptor, md protoreflect.MessageDescriptor)
	walk = func(path []protoreflect.FieldDescriptor, md protoreflect.MessageDescriptor) {
		for i := range md.Fields().Len() {
			fd := md.Fields().Get(i)
			switch fd.Kind() {
			case protoreflect.MessageKind:
				walk(append(path[:len(path):len(path)], fd), fd.Message())
			case protoreflect.StringKind:
				m := mt.New()
				leaf := m
				for _, p := range path {
					if p.IsList() {
						leaf = leaf.Mutable(p).List().AppendMutable().Message()
					} else {
						leaf = leaf.Mutable(p).Message()
					}
				}
				bad := protoreflect.ValueOfString("ok\xff")
				if fd.IsList() {
					leaf.Mutable(fd).List().Append(protoreflect.ValueOfString("ok"))
					leaf.Mutable(fd).List().Append(bad)
				} else {
					leaf.Set(fd, bad)
				}
				f(m.Interface(), fd)
			}
		}
	}
	walk(nil, mt.Descriptor())
}

// TestEveryStringFieldIsChecked: a string field that is not UTF-8, in any
// message and at any depth, is refused by the codec as protobuf refuses
// it, and the refusal names the field.
func TestEveryStringFieldIsChecked(t *testing.T) {
	checked := 0
	for _, mt := range messageTypes(t) {
		eachBadString(mt, func(m proto.Message, fd protoreflect.FieldDescriptor) {
			checked++
			// MarshalVT, unlike proto.Marshal, writes what it is given.
			data, err := m.(vtMessage).MarshalVT()
			if err != nil {
				t.Fatal(err)
			}
			if proto.Unmarshal(data, mt.New().Interface()) == nil {
				t.Fatalf("%s: protobuf accepts %x", fd.FullName(), data)
			}
			err = Codec{}.Unmarshal(mem.BufferSlice{mem.SliceBuffer(data)}, mt.New().Interface())
			field := "spawnpb." + string(fd.ContainingMessage().Name()) + "." + string(fd.Name()) + ": "
			if err == nil || !strings.HasPrefix(err.Error(), field) {
				t.Errorf("%s holding invalid UTF-8 in %s: the codec says %v, want an error starting %q", mt.Descriptor().Name(), fd.FullName(), err, field)
			}
		})
	}
	if checked < 30 {
		t.Fatalf("only %d string fields found", checked)
	}
}

// wellFormed reports whether data is wire format that protobuf and the
// codec read alike as a message of md: every field number in range and
// every unknown field's tag in as few bytes as it needs, every varint
// within 64 bits, every group closed by its own number, every known field
// under its own wire type, no singular string field given twice; so,
// within each nested message. On anything else the codec is laxer
// (UnmarshalVT keeps a field number past 2^29-1 as unknown, and reads one
// past 2^32 modulo 2^32; drops a varint's bits past 64; does not match a
// group's end to its start; keeps an unknown field's tag as it came where
// protobuf writes it anew; and the codec checks the UTF-8 of a string's
// last value, the one decoded, where protobuf checks each) or stricter
// (UnmarshalVT refuses a known field under another wire type, which
// protobuf keeps as unknown).
func wellFormed(md protoreflect.MessageDescriptor, b []byte) bool {
	seen := map[protowire.Number]bool{}
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 || num > protowire.MaxValidNumber {
			return false
		}
		fd := md.Fields().ByNumber(num)
		if fd == nil && n != protowire.SizeTag(num) {
			return false
		}
		b = b[n:]
		n = protowire.ConsumeFieldValue(num, typ, b)
		if n < 0 {
			return false
		}
		switch {
		case fd == nil:
		case fd.Kind() == protoreflect.MessageKind:
			inner, _ := protowire.ConsumeBytes(b)
			if typ != protowire.BytesType || !wellFormed(fd.Message(), inner) {
				return false
			}
		case fd.Kind() == protoreflect.StringKind || fd.Kind() == protoreflect.BytesKind:
			if typ != protowire.BytesType || fd.Kind() == protoreflect.StringKind && !fd.IsList() && seen[num] {
				return false
			}
			seen[num] = true
		case typ != protowire.VarintType: // spawn.proto's scalars are all varints, none packed
			return false
		}
		b = b[n:]
	}
	return true
}

// FuzzCodecAgrees holds the codec's decoder to proto.Unmarshal on any
// bytes, as any message type of the file. On well-formed wire (wellFormed)
// it accepts what protobuf accepts and decodes the same message (unknown
// fields kept), refuses what protobuf refuses (invalid UTF-8 included),
// and writes back the bytes proto.Marshal writes. On any other input, what
// it accepts is still a message protobuf could have been sent: its known
// fields marshal with proto.Marshal (every string UTF-8) and read back
// the same, so a malformed encoding gives the gateway nothing a
// well-formed one does not.
func FuzzCodecAgrees(f *testing.F) {
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
	f.Add(uint8(0), []byte{0x0a, 0x02, 0xff, 0xfe})                                           // invalid UTF-8
	f.Add(uint8(0), []byte{0x0b, 0x0c})                                                       // a group where a string goes
	f.Add(uint8(0), []byte{0x08, 0x01, 0xf8, 0xff, 0x01})                                     // wrong wire type, unknown field
	f.Add(uint8(5), []byte{0x0a, 0x02, 0x08})                                                 // truncated nested message
	f.Add(uint8(0), []byte{0x8a, 0x80, 0x80, 0x80, 0x80, 0x02, 0x02, 0xff, 0xfe})             // field 2^32+1, read as 1
	f.Add(uint8(0), []byte{0x33, 0x3c})                                                       // a group ended by another number
	f.Add(uint8(0), []byte{0x30, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02}) // a varint past 64 bits
	f.Fuzz(func(t *testing.T, kind uint8, data []byte) {
		mt := types[int(kind)%len(types)]
		name := mt.Descriptor().FullName()
		want := mt.New().Interface()
		got := mt.New().Interface()
		wantErr := proto.Unmarshal(data, want)
		gotErr := Codec{}.Unmarshal(mem.BufferSlice{mem.SliceBuffer(data)}, got)
		if !wellFormed(mt.Descriptor(), data) {
			if gotErr != nil {
				return
			}
			clearUnknown(got.ProtoReflect())
			valid, err := proto.Marshal(got)
			if err != nil {
				t.Fatalf("%s %x: the codec decoded %v, which protobuf cannot write: %v", name, data, got, err)
			}
			back := mt.New().Interface()
			if err := proto.Unmarshal(valid, back); err != nil || !proto.Equal(back, got) {
				t.Fatalf("%s %x: the codec decoded %v, protobuf reads back %v (%v)", name, data, got, back, err)
			}
			return
		}
		if (wantErr == nil) != (gotErr == nil) {
			t.Fatalf("%s %x: protobuf says %v, the codec %v", name, data, wantErr, gotErr)
		}
		if wantErr != nil {
			return
		}
		if !proto.Equal(got, want) {
			t.Fatalf("%s %x: decoded %v, protobuf %v", name, data, got, want)
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
			t.Fatalf("%s %x: wrote %x, protobuf %x", name, data, out.Materialize(), ref)
		}
	})
}

// clearUnknown drops the unknown fields of m and of its nested messages.
func clearUnknown(m protoreflect.Message) {
	m.SetUnknown(nil)
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		switch {
		case fd.Kind() != protoreflect.MessageKind:
		case fd.IsList():
			for i := range v.List().Len() {
				clearUnknown(v.List().Get(i).Message())
			}
		default:
			clearUnknown(v.Message())
		}
		return true
	})
}
