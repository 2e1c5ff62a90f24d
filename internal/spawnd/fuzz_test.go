package spawnd

import (
	"context"
	"encoding/json"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"

	"github.com/nexus-broker/nexus-broker/internal/config/core"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// shmDir is a fresh directory on tmpfs (/dev/shm where there is one), so
// that a fuzz target's fsyncs cost nothing; removed at cleanup.
func shmDir(t testing.TB) string {
	root := "/dev/shm"
	if st, err := os.Stat(root); err != nil || !st.IsDir() {
		root = ""
	}
	dir, err := os.MkdirTemp(root, "nexus-spawnd-fuzz-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	return dir
}

// quiet discards what the code under fuzzing logs without formatting it.
var quiet = slog.New(slog.DiscardHandler)

// maxFuzzInput bounds a fuzzed file or message: a few records of each
// kind, and more never reach a path a smaller input does not. Bounded, an
// execution (and the minimization of an input that found something new)
// stays cheap.
const maxFuzzInput = 4 << 10

// FuzzJournalReplay: any file, torn or not, replays without a panic to
// records each valid, compacts to a file that replays to the same live
// leases, and a second compaction changes nothing.
func FuzzJournalReplay(f *testing.F) {
	rec := testRecord("lease-a")
	for _, kind := range []recordKind{kindMinted, kindStarted, kindRecorded, kindEnded} {
		line, _ := json.Marshal(journalLine{kind, rec})
		line = append(line, '\n')
		f.Add(line)
		f.Add(append(line, line[:len(line)/2]...)) // torn
	}
	f.Add([]byte(`{"kind":"started","lease_id":"x","broker_id":"other","pid":1}` + "\n\n{"))
	dir := shmDir(f)
	path := filepath.Join(dir, journalFile)
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > maxFuzzInput {
			return
		}
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
		x, live, err := openJournal(dir, "b-test", quiet)
		if err != nil {
			t.Fatalf("a journal of nexus-spawnd's own was refused: %v", err)
		}
		for _, jl := range x.All() {
			if !jl.valid() || jl.Kind == kindEnded {
				t.Fatalf("replay kept %+v", jl)
			}
		}
		x.Close()
		first, _ := os.ReadFile(path)
		y, again, err := openJournal(dir, "b-test", quiet)
		if err != nil {
			t.Fatal(err)
		}
		y.Close()
		second, _ := os.ReadFile(path)
		if len(again) != len(live) || string(first) != string(second) {
			t.Fatalf("compaction is not stable: %d then %d live leases\n%q\n%q", len(live), len(again), first, second)
		}
	})
}

// FuzzSessionIndex: any file opens without a panic to bindings each valid,
// and its compaction replays to the same bindings.
func FuzzSessionIndex(f *testing.F) {
	f.Add([]byte(`{"session_id":"s-1","entry":"nexus"}` + "\n" + `{"session_id":"s-2","entry":"other"}` + "\n"))
	f.Add([]byte(`{"session_id":"../x","entry":"nexus"}` + "\n" + `{"session_id":"s`))
	dir := shmDir(f)
	path := filepath.Join(dir, indexFile)
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > maxFuzzInput {
			return
		}
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
		x := openSessionIndex(dir, 16, quiet)
		if x == nil {
			t.Fatal("an index of nexus-spawnd's own was turned off")
		}
		first := x.All()
		x.Close()
		if len(first) > 16 {
			t.Fatalf("%d bindings past the limit of 16", len(first))
		}
		y := openSessionIndex(dir, 16, quiet)
		second := y.All()
		y.Close()
		if !slices.Equal(first, second) {
			t.Fatalf("compaction changed the bindings: %v, then %v", first, second)
		}
	})
}

// verbDaemon is a real Daemon for the verb-handler target: state_dir on
// tmpfs, true(1) as "nexus" (an instance that exits at once), and "gone",
// whose binary is removed
// after the registry resolved it, so its exec fails after validation.
func verbDaemon(f *testing.F) *Daemon {
	dir := shmDir(f)
	gone := filepath.Join(dir, "gone-binary")
	if err := os.WriteFile(gone, []byte("#!/bin/sh\n"), 0o755); err != nil {
		f.Fatal(err)
	}
	cfgPath := filepath.Join(dir, "broker.yaml")
	yaml := "state_dir: " + filepath.Join(dir, "state") + "\nrelease_grace: 0s\nbinaries:\n  nexus:\n    path: true\n  gone:\n    path: " + gone + "\n"
	if err := os.WriteFile(cfgPath, []byte(yaml), 0o600); err != nil {
		f.Fatal(err)
	}
	cfg, err := core.Load(cfgPath)
	if err != nil {
		f.Fatal(err)
	}
	f.Setenv("TMPDIR", dir)
	d, err := New(cfgPath, cfg, quiet)
	if err != nil {
		f.Fatal(err)
	}
	if err := os.Remove(gone); err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
		defer cancel()
		if list, err := d.List(ctx, &spawnpb.ListRequest{}); err == nil {
			for _, l := range list.Leases {
				_, _ = d.Terminate(ctx, &spawnpb.TerminateRequest{LeaseId: l.LeaseId, SkipGrace: true})
			}
		}
		_ = d.Close()
	})
	return d
}

// FuzzVerbs: the wire bytes of a Spawn, Record (a hand-out included),
// Terminate or Binding request (any fields, in any order, repeated or
// unknown) reach a real Daemon; every answer is a response or a refusal of
// the codes the verb table names, a lease Spawn answered is in the
// journal, and the Daemon keeps answering.
func FuzzVerbs(f *testing.F) {
	d := verbDaemon(f)
	seed := func(v uint8, m any) {
		data, err := spawnpb.Codec{}.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(v, data.Materialize())
	}
	// decode reads a request as nexus-spawnd's gRPC server does, with the
	// wire codec it registers (spawnpb.Codec).
	decode := func(data []byte, req any) bool {
		return spawnpb.Codec{}.Unmarshal(mem.BufferSlice{mem.SliceBuffer(data)}, req) == nil
	}
	seed(0, &spawnpb.SpawnRequest{LeaseId: "l-1", Entry: "nexus", Config: []byte("a: 1\n"), Principal: "p"})
	seed(0, &spawnpb.SpawnRequest{LeaseId: "l-2", Entry: "gone", RecallSessionId: "s-1", ListenPort: 8080})
	seed(1, &spawnpb.RecordRequest{LeaseId: "l-1", SessionId: "s-1"})
	// A warm lease and its hand-outs: with a session, without, anonymous.
	seed(0, &spawnpb.SpawnRequest{LeaseId: "l-3", Entry: "nexus", Config: []byte("a: 1\n"), Pool: "default"})
	seed(1, &spawnpb.RecordRequest{LeaseId: "l-3", SessionId: "s-3", Principal: "p", HandOut: true})
	seed(1, &spawnpb.RecordRequest{LeaseId: "l-3", HandOut: true})
	seed(2, &spawnpb.TerminateRequest{LeaseId: "l-1", Reason: "manual release", SkipGrace: true, NoWait: true})
	seed(3, &spawnpb.BindingRequest{SessionId: "s-1"})
	known := []codes.Code{codes.InvalidArgument, codes.NotFound, codes.AlreadyExists, codes.FailedPrecondition,
		codes.PermissionDenied, codes.ResourceExhausted, codes.Internal, codes.DeadlineExceeded}
	f.Fuzz(func(t *testing.T, v uint8, data []byte) {
		if len(data) > maxFuzzInput {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		var err error
		switch v % 4 {
		case 0:
			var req spawnpb.SpawnRequest
			if !decode(data, &req) {
				return
			}
			if _, err = d.Spawn(ctx, &req); err == nil {
				// Live (not yet exited), it must be journaled.
				d.mu.Lock()
				_, live := d.leases[req.GetLeaseId()]
				_, journaled := d.journal.Get(req.GetLeaseId())
				d.mu.Unlock()
				if live && !journaled {
					t.Fatalf("Spawn answered lease %q, which the journal does not hold", req.GetLeaseId())
				}
			}
		case 1:
			var req spawnpb.RecordRequest
			if !decode(data, &req) {
				return
			}
			_, err = d.Record(ctx, &req)
		case 2:
			var req spawnpb.TerminateRequest
			if !decode(data, &req) {
				return
			}
			req.NoWait = true // a wait is the escalation's time, not the handler's
			_, err = d.Terminate(ctx, &req)
		case 3:
			var req spawnpb.BindingRequest
			if !decode(data, &req) {
				return
			}
			_, err = d.Binding(ctx, &req)
		}
		if err != nil && !slices.Contains(known, status.Code(err)) {
			t.Fatalf("verb %d answered %v", v%4, err)
		}
		if _, err := d.Status(ctx, &spawnpb.StatusRequest{}); err != nil {
			t.Fatalf("Status after verb %d: %v", v%4, err)
		}
	})
}
