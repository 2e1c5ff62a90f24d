// Package ingress is the A2A door of nexus-broker's gateway: the agent
// cards, the JSON-RPC and HTTP+JSON bindings, and the conversations behind
// them, each bound to an engine session and running one task at a time on
// an ordinary lease. It holds the conversations and their live tasks; the
// task store, the turn mapping and the protocol types are internal/a2a's,
// beside it.
//
// It reaches the lease core only through the core's API
// (internal/gateway/api.go, as Core here) and the cluster router only
// through the part of its face Peers names: it holds no pointer to the
// gateway and shares no lock with it.
// It may not import the core's internals (internal/gateway/internal/...,
// which the compiler refuses anyway), internal/gateway/spawner, the
// cluster router or internal/cluster, the HTTP face, the console,
// internal/brokerd, internal/spawnclient or pkg/spawnrpc
// (internal/gateway/layers_test.go checks it).
package ingress

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"

	"github.com/nexus-broker/nexus-broker/internal/a2a"
	"github.com/nexus-broker/nexus-broker/internal/auth"
	"github.com/nexus-broker/nexus-broker/internal/bootlog"
	"github.com/nexus-broker/nexus-broker/internal/config"
	"github.com/nexus-broker/nexus-broker/internal/gateway"
	"github.com/nexus-broker/nexus-broker/internal/safedir"
)

// Core is the lease core as the door uses it: a part of its API.
type Core interface {
	// Claim starts a lease through the core's one spawn spine.
	Claim(gateway.ClaimSpec) (*gateway.Lease, *gateway.ClaimError)
	// SessionLease is principal's live lease running session, nil for none.
	SessionLease(principal, session string) *gateway.Lease
	// Authenticate is the guard every route goes through.
	Authenticate(http.ResponseWriter, *http.Request) (auth.Principal, bool)
	// Done is closed when the gateway shuts down.
	Done() <-chan struct{}
	// BaseURL is the origin the cards advertise.
	BaseURL() string
	// Identify verifies a credential without answering the request.
	Identify(*http.Request) (auth.Principal, *auth.Refusal)
	// InputFits says whether payload fits max_client_frame as l's io frame
	// (nil: a new lease's), with its size and the limit.
	InputFits(l *gateway.Lease, payload json.RawMessage) (size, limit int, fits bool)
	// Cluster is the cluster router, nil in single-broker mode.
	Cluster() gateway.Router
}

// Peers is the cluster router as the door asks it: a part of
// gateway.Router.
type Peers interface {
	// NewLeaseID mints an id naming this broker.
	NewLeaseID() (string, error)
	// A2AOwner is the peer holding what q names, "" for none; unsure when
	// a broker that may hold it did not answer.
	A2AOwner(ctx context.Context, q gateway.A2AQuery) (owner string, unsure bool)
	// CarryA2A has owner answer an A2A request (body read whole) as p,
	// streamed back when stream is set; refuse answers owner loss.
	CarryA2A(w http.ResponseWriter, r *http.Request, owner string, p auth.Principal, body []byte, stream bool, refuse func(http.ResponseWriter))
	// GatherTasks hands got every peer's share of a ListTasks and returns
	// the peers that did not answer.
	GatherTasks(ctx context.Context, q gateway.TaskQuery, got func(tasks []a2a.Task, total int)) []string
}

// buildProfilesFailed is upstream's record of agents: profiles that cannot
// be served.
const buildProfilesFailed = "failed to build the a2a agent profiles"

// Host is the lease core as Attach wires the door onto it: Core, and the
// core's hooks for a layer's routes (Mount), start, reloads and shutdown
// (Extend), and the A2A questions other brokers ask (ServeA2A).
type Host interface {
	Core
	Mount(routes func(*http.ServeMux))
	Extend(l gateway.Layer)
	ServeA2A(holds func(gateway.A2AQuery) bool, tasks func(gateway.TaskQuery) ([]a2a.Task, int))
}

// Attach puts the A2A door on g when boot (the configuration g was built
// with) has agents: its routes, and its part of g's start, reloads and
// shutdown. Attach before g.Start.
func Attach(g Host, boot *config.Config, log *slog.Logger) {
	if len(boot.Agents) == 0 {
		return
	}
	in := &ingress{core: g, boot: boot, log: log}
	g.ServeA2A(in.holdsCall, in.matchingQuery)
	g.Extend(in)
	g.Mount(in.routes)
}

// Start builds the profiles and opens the task store and the context index.
func (in *ingress) Start() error {
	ps, err := a2a.BuildProfiles(in.boot, in.boot, in.core.BaseURL())
	if err != nil {
		return bootlog.Wrap(buildProfilesFailed, fmt.Errorf("broker config: %w", err))
	}
	if d := in.boot.A2A.StateDir; d != "" {
		if err := safedir.PrivateKey(d, "a2a.state_dir", "the gateway's user", "A2A tasks and answers", in.log); err != nil {
			return err
		}
	}
	dir, err := in.boot.A2AStateDir()
	if err != nil {
		return err
	}
	in.open(dir)
	in.profiles.Store(ps)
	in.logBoot(ps, dir)
	return nil
}

// Reload builds the profiles of next; apply puts them in force once the
// reload applies.
func (in *ingress) Reload(next *config.Config) (apply func(), err error) {
	ps, err := a2a.BuildProfiles(next, in.boot, in.core.BaseURL())
	if err != nil {
		return nil, fmt.Errorf("broker config: %w", err)
	}
	return func() { in.profiles.Store(ps) }, nil
}

// Stop closes the task store and the context index.
func (in *ingress) Stop() {
	in.store.Close()
	in.contexts.Close()
}
