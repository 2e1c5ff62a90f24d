package spawnrpc

import (
	"bytes"
	"encoding/binary"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// The lanes' calls, end to end, are tested with the gateway's end in
// internal/spawnclient (lane_test.go).

// FuzzLaneFrame: spawnd's reading of a Spawn lane refuses what is not one
// frame of a SpawnCall, never panics, and what it accepts writes back the
// same.
func FuzzLaneFrame(f *testing.F) {
	ok, _ := (&spawnpb.SpawnCall{CallId: 7, Request: &spawnpb.SpawnRequest{LeaseId: "l", Entry: "nexus", Config: []byte("core: {}\n")}}).MarshalVT()
	f.Add(binary.BigEndian.AppendUint32(nil, uint32(len(ok))), ok)
	f.Add([]byte{0, 0, 0, 3}, []byte{0x0a, 0xff, 0x01})
	f.Add([]byte{0xff, 0xff, 0xff, 0xff}, []byte{})
	f.Fuzz(func(t *testing.T, head, body []byte) {
		c, err := ReadFrame[spawnpb.SpawnCall](bytes.NewReader(append(head, body...)))
		if err != nil {
			return
		}
		var out bytes.Buffer
		if err := WriteFrame(&out, c); err != nil {
			t.Fatal(err)
		}
		again, err := ReadFrame[spawnpb.SpawnCall](&out)
		if err != nil || !proto.Equal(c, again) {
			t.Fatalf("a frame read back as %v, %v; want %v", again, err, c)
		}
	})
}
