package spawnclient

import (
	"context"
	"fmt"
	"path/filepath"
	"time"

	"google.golang.org/grpc/status"

	"github.com/nexus-broker/nexus-broker/internal/atomicfile"
	"github.com/nexus-broker/nexus-broker/internal/config/core"
	gwspawner "github.com/nexus-broker/nexus-broker/internal/gateway/spawner"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// The gateway's spawner.Spawner is implemented by Client itself: each verb
// goes to Spawner() and its messages are translated here, the one place
// the gateway side meets spawnpb.
var _ gwspawner.Spawner = (*Client)(nil)

// callError is err in the gateway's words; nil stays nil.
func callError(err error) error {
	if err == nil {
		return nil
	}
	st := status.Convert(err)
	e := &gwspawner.Error{Code: gwspawner.Code(st.Code().String()), Message: st.Message(), Text: err.Error()}
	for _, d := range st.Details() {
		if f, ok := d.(*spawnpb.SpawnFailure); ok {
			e.Step = spawnStep(f.GetStep())
		}
	}
	return e
}

func spawnStep(s spawnpb.SpawnStep) gwspawner.Step {
	switch s {
	case spawnpb.SpawnStep_SPAWN_STEP_TEMP_CONFIG:
		return gwspawner.StepTempConfig
	case spawnpb.SpawnStep_SPAWN_STEP_EXEC:
		return gwspawner.StepExec
	case spawnpb.SpawnStep_SPAWN_STEP_UID:
		return gwspawner.StepUID
	case spawnpb.SpawnStep_SPAWN_STEP_HOME:
		return gwspawner.StepHome
	case spawnpb.SpawnStep_SPAWN_STEP_JOURNAL:
		return gwspawner.StepJournal
	}
	return gwspawner.StepUnspecified
}

func binaries(bs []*spawnpb.Binary) []gwspawner.Binary {
	out := make([]gwspawner.Binary, len(bs))
	for i, b := range bs {
		out[i] = gwspawner.Binary{Name: b.Name, Label: b.Label, Description: b.Description, ResolvedPath: b.ResolvedPath}
	}
	return out
}

// Status implements spawner.Spawner.
func (c *Client) Status(ctx context.Context) (gwspawner.Status, error) {
	st, err := c.spawner.Status(ctx, &spawnpb.StatusRequest{})
	if err != nil {
		return gwspawner.Status{}, callError(err)
	}
	return gwspawner.Status{Binaries: binaries(st.Binaries), BrokerID: st.BrokerId}, nil
}

// List implements spawner.Spawner.
func (c *Client) List(ctx context.Context) ([]gwspawner.Held, error) {
	list, err := c.spawner.List(ctx, &spawnpb.ListRequest{})
	if err != nil {
		return nil, callError(err)
	}
	out := make([]gwspawner.Held, len(list.Leases))
	for i, l := range list.Leases {
		out[i] = gwspawner.Held{LeaseID: l.LeaseId, Principal: l.Principal, SessionID: l.SessionId, Entry: l.Entry,
			Pool: l.Pool, Pid: l.Pid, Created: time.Unix(0, l.CreatedUnixNano), Verifier: l.Verifier}
	}
	return out, nil
}

// Spawn implements spawner.Spawner.
func (c *Client) Spawn(ctx context.Context, r gwspawner.SpawnRequest) (gwspawner.Spawned, error) {
	res, err := c.spawner.Spawn(ctx, &spawnpb.SpawnRequest{
		LeaseId: r.LeaseID, Entry: r.Entry, Config: r.Config, RecallSessionId: r.RecallSession,
		Principal: r.Principal, ListenPort: r.ListenPort, Pool: r.Pool,
	})
	if err != nil {
		return gwspawner.Spawned{}, callError(err)
	}
	return gwspawner.Spawned{Pid: res.Pid, Verifier: res.Verifier}, nil
}

// Terminate implements spawner.Spawner.
func (c *Client) Terminate(ctx context.Context, t gwspawner.Termination) error {
	_, err := c.spawner.Terminate(ctx, &spawnpb.TerminateRequest{LeaseId: t.LeaseID, Reason: t.Reason, SkipGrace: t.SkipGrace, NoWait: t.NoWait})
	return callError(err)
}

// exits adapts a Watch stream.
type exits struct {
	recv func() (*spawnpb.ExitEvent, error)
}

func (x exits) Recv() (gwspawner.Exit, error) {
	ev, err := x.recv()
	if err != nil {
		return gwspawner.Exit{}, callError(err)
	}
	return gwspawner.Exit{LeaseID: ev.LeaseId, Pid: ev.Pid, ExitCode: ev.ExitCode, Signal: ev.Signal,
		Terminated: ev.Terminated, LogPath: ev.LogPath, OutputTail: ev.OutputTail}, nil
}

// Watch implements spawner.Spawner: it waits for the stream's header,
// which spawnd sends once the stream is subscribed (the call returning
// says nothing of that).
func (c *Client) Watch(ctx context.Context) (gwspawner.Exits, error) {
	stream, err := c.spawner.Watch(ctx, &spawnpb.WatchRequest{})
	if err == nil {
		_, err = stream.Header()
	}
	if err != nil {
		return nil, callError(err)
	}
	return exits{recv: stream.Recv}, nil
}

// Record implements spawner.Spawner: a principal is a hand-out, whose
// owner is "" on the wire for spawner.Anonymous.
func (c *Client) Record(ctx context.Context, lease, session, principal string) error {
	req := &spawnpb.RecordRequest{LeaseId: lease, SessionId: session, HandOut: principal != ""}
	if principal != gwspawner.Anonymous {
		req.Principal = principal
	}
	_, err := c.spawner.Record(ctx, req)
	return callError(err)
}

// Reload implements spawner.Spawner.
func (c *Client) Reload(ctx context.Context, digest string) (gwspawner.Reloaded, error) {
	res, err := c.spawner.Reload(ctx, &spawnpb.ReloadRequest{ConfigDigest: digest})
	if err != nil {
		return gwspawner.Reloaded{}, callError(err)
	}
	return gwspawner.Reloaded{Applied: res.Applied, Error: res.Error, Binaries: binaries(res.Binaries)}, nil
}

// Binding implements spawner.Spawner.
func (c *Client) Binding(ctx context.Context, session, principal string) (gwspawner.Bound, error) {
	res, err := c.spawner.Binding(ctx, &spawnpb.BindingRequest{SessionId: session, Principal: principal})
	if err != nil {
		return gwspawner.Bound{}, callError(err)
	}
	b := gwspawner.Bound{Entry: res.Entry}
	switch res.Ownership {
	case spawnpb.Ownership_OWNERSHIP_OWN:
		b.Owner = gwspawner.OwnerSelf
	case spawnpb.Ownership_OWNERSHIP_OTHER:
		b.Owner = gwspawner.OwnerOther
	}
	return b, nil
}

// HandOver implements spawner.Spawner: an empty file named lease in the
// run directory's releases directory, written whole (temp file, fsync,
// rename, directory fsync), which spawnd carries out (spawnd.TakeReleases).
func (c *Client) HandOver(lease string) error {
	if !core.IsToken(lease, 128) {
		return fmt.Errorf("lease id %q cannot name a file", lease)
	}
	return atomicfile.Write(filepath.Join(c.opts.RunDir, spawnrpc.ReleasesDir, lease), nil, nil)
}
