package spawnrpc

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
)

// FuzzReadEndpoint: any spawnd.json is an error or an Endpoint with a pid,
// a network and an address, which writeEndpoint writes back to the same
// Endpoint.
func FuzzReadEndpoint(f *testing.F) {
	good, _ := json.Marshal(Endpoint{Protocol: "grpc", ProtocolVersion: ProtocolVersion, Network: "unix", Addr: "/run/x/plugin1", Pid: 42})
	f.Add(good)
	f.Add([]byte(`{"pid":-1,"network":"unix","addr":"a"}`))
	f.Add([]byte(`{"pid":1e99,"network":"unix","addr":"a","pid":2}`))
	f.Add([]byte(`{"pid":1`))
	// On tmpfs where there is one: the write-back's fsyncs cost nothing.
	dir, err := os.MkdirTemp("/dev/shm", "spawnrpc-fuzz-")
	if err != nil {
		dir = f.TempDir()
	} else {
		f.Cleanup(func() { _ = os.RemoveAll(dir) })
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		// A spawnd.json is a few hundred bytes; a bound keeps executions
		// (and minimizations) cheap.
		if len(data) > 4<<10 {
			return
		}
		if err := os.WriteFile(filepath.Join(dir, EndpointFile), data, 0o640); err != nil {
			t.Fatal(err)
		}
		ep, err := ReadEndpoint(dir)
		if err != nil {
			return
		}
		if ep.Pid <= 0 || ep.Network == "" || ep.Addr == "" {
			t.Fatalf("ReadEndpoint accepted %+v from %q", ep, data)
		}
		if err := writeEndpoint(dir, ep, -1); err != nil {
			t.Fatal(err)
		}
		again, err := ReadEndpoint(dir)
		if err != nil || again != ep {
			t.Fatalf("written back, %+v reads as %+v, %v", ep, again, err)
		}
	})
}
