package spawnrpc

import (
	"testing"

	"google.golang.org/grpc"

	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// TestAttachedRunsOnceOnTheFirstWatch: spawnd's Booted hook runs when a
// gateway opens its exit stream, not on other streams, and only the first
// time; every stream still reaches its handler.
func TestAttachedRunsOnceOnTheFirstWatch(t *testing.T) {
	ran, handled := 0, 0
	intercept := onFirstWatch(func() { ran++ })
	call := func(method string) {
		t.Helper()
		err := intercept(nil, nil, &grpc.StreamServerInfo{FullMethod: method}, func(any, grpc.ServerStream) error {
			handled++
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	call("/plugin.GRPCStdio/StreamStdio")
	if ran != 0 {
		t.Fatal("the hook ran on the stdio stream")
	}
	call(spawnpb.Spawner_Watch_FullMethodName)
	if ran != 1 {
		t.Fatal("the hook did not run on the first Watch")
	}
	call(spawnpb.Spawner_Watch_FullMethodName)
	if ran != 1 {
		t.Fatalf("the hook ran %d times after two Watch streams", ran)
	}
	if handled != 3 {
		t.Fatalf("%d of 3 streams reached their handler", handled)
	}
	// Without a hook, Watch streams pass through.
	if err := onFirstWatch(nil)(nil, nil, &grpc.StreamServerInfo{FullMethod: spawnpb.Spawner_Watch_FullMethodName},
		func(any, grpc.ServerStream) error { return nil }); err != nil {
		t.Fatal(err)
	}
}
