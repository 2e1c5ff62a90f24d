// Package spawner is what the gateway needs of nexus-spawnd, said in the
// gateway's own types: the Spawner interface and the values the verbs it
// uses take and answer (spawnd's Verify it no longer needs: see Spawned). internal/spawnclient implements it over pkg/spawnrpc.
//
// It holds no logic and imports nothing of the project: no generated
// spawnpb type, no gRPC package, no gateway package. The gateway's layers
// import it; it imports none of them.
package spawner

import (
	"context"
	"errors"
	"time"
)

// Spawner is spawnd as the gateway uses it. Calls made while spawnd
// restarts wait for the next connection within their context. Every error
// a call returns is an *Error.
type Spawner interface {
	// Status is spawnd's registry listing and broker id.
	Status(ctx context.Context) (Status, error)
	// List is the leases spawnd holds.
	List(ctx context.Context) ([]Held, error)
	// Spawn starts the instance of a new lease and answers its pid and the
	// verifier of its spawn secret.
	Spawn(ctx context.Context, r SpawnRequest) (Spawned, error)
	// Terminate ends a lease's process group.
	Terminate(ctx context.Context, t Termination) error
	// Watch follows every instance exit. It returns once spawnd has
	// subscribed the stream, so every exit from then on reaches it.
	Watch(ctx context.Context) (Exits, error)
	// Record remembers the session id a lease reported (principal "").
	// With a principal it hands a warm lease out: spawnd durably makes
	// principal (Anonymous: the anonymous caller of a gateway without
	// auth:) the owner of the lease and of its session (given here, or
	// recorded before), and the lease no longer a pool's, once. Refused
	// with FailedPrecondition for a lease that is no pool lease in waiting
	// (an ordinary one, one handed out already, an unknown one) or has no
	// session id, and with Unavailable when spawnd's journal cannot record
	// it (the lease stays in waiting).
	Record(ctx context.Context, lease, session, principal string) error
	// Reload asks spawnd to re-read its keys of the file whose digest the
	// gateway validated.
	Reload(ctx context.Context, digest string) (Reloaded, error)
	// Binding is the entry that ran session ("" for no opinion), and
	// whether principal created it.
	Binding(ctx context.Context, session, principal string) (Bound, error)
	// HandOver hands spawnd a release durably without waiting for it to
	// answer: spawnd terminates the lease when it next can, whether or not
	// this gateway still runs then.
	HandOver(lease string) error
}

// Anonymous is the principal Record hands a warm lease out to for the
// anonymous caller (a gateway without auth:), whose principal is "": no
// principal spawnd accepts holds a NUL.
const Anonymous = "\x00anonymous"

// Bound is Binding's answer.
type Bound struct {
	Entry string
	Owner Ownership
}

// Ownership is whether a session belongs to the principal asking; spawnd
// never names the owner.
type Ownership int

// The ownerships.
const (
	// OwnerUnrecorded: no owner is recorded (evicted, created before owners
	// were, or since a spawnd without a state_dir started).
	OwnerUnrecorded Ownership = iota
	// OwnerSelf: the principal created the session.
	OwnerSelf
	// OwnerOther: another principal did.
	OwnerOther
)

// Binary is one registry entry as spawnd resolved it.
type Binary struct {
	Name string
	// Label and Description are nil when the operator wrote none, and ""
	// when the operator wrote an empty string.
	Label, Description *string
	// ResolvedPath is for the boot summary only.
	ResolvedPath string
}

// Status is spawnd's answer to Status.
type Status struct {
	Binaries []Binary
	BrokerID string
}

// Held is a lease spawnd holds.
type Held struct {
	LeaseID, Principal, SessionID, Entry string
	// Pool is the pool of a warm lease still in waiting (no owner, never
	// handed out); "" for every other lease, a handed-out one included.
	Pool    string
	Pid     int64
	Created time.Time
	// Verifier is the lease's, as Spawn answered it.
	Verifier []byte
}

// Spawned is Spawn's answer.
type Spawned struct {
	Pid int64
	// Verifier is the one-way verifier of the lease's spawn secret
	// (internal/spawnproof): the gateway checks a register frame's secret
	// against it, and cannot make one that passes from it.
	Verifier []byte
}

// SpawnRequest names what a new lease runs.
type SpawnRequest struct {
	LeaseID, Entry, RecallSession, Principal string
	// Pool, when set, makes a warm lease of that pool: Principal is then
	// empty (no owner until Record hands it out).
	Pool string
	// Config is the claim's nexus config (YAML text).
	Config []byte
	// ListenPort is the port the gateway's listener bound.
	ListenPort uint32
}

// Termination asks for a lease's end.
type Termination struct {
	LeaseID, Reason string
	// SkipGrace sends SIGTERM at once; NoWait answers once the teardown
	// has begun rather than at the exit.
	SkipGrace, NoWait bool
}

// Exit is spawnd's word that an instance process is gone.
type Exit struct {
	LeaseID  string
	Pid      int64
	ExitCode int32
	// Signal names the terminating signal ("SIGKILL"), "" otherwise.
	Signal string
	// Terminated is true when the exit followed a Terminate call: this
	// gateway's, or another caller's (nexus-broker -stop, a gateway before
	// a restart).
	Terminated bool
	// LogPath and OutputTail are, for an instance that exited on its own,
	// where its output is kept and its last bytes (escaped by spawnd).
	LogPath, OutputTail string
}

// Exits is a followed exit stream; Recv fails once the stream ends.
type Exits interface {
	Recv() (Exit, error)
}

// Reloaded is spawnd's answer to Reload.
type Reloaded struct {
	// Applied is false when the reload was rejected; Error says why.
	Applied  bool
	Error    string
	Binaries []Binary
}

// Code names why a call failed, in gRPC's words ("NotFound").
type Code string

// The codes the gateway tells apart.
const (
	OK                 Code = "OK"
	NotFound           Code = "NotFound"
	FailedPrecondition Code = "FailedPrecondition"
	Unavailable        Code = "Unavailable"
	InvalidArgument    Code = "InvalidArgument"
	ResourceExhausted  Code = "ResourceExhausted"
	Unknown            Code = "Unknown"
)

// Step is the step of a spawn that failed.
type Step int

// The steps.
const (
	StepUnspecified Step = iota
	StepTempConfig
	StepExec
	// StepUID: with tenancy:, no uid is left for a new principal.
	StepUID
	// StepHome: with tenancy:, the principal's home could not be made.
	StepHome
	// StepJournal: spawnd's lease journal could not record the lease, so
	// nothing runs; retry once Journal clears.
	StepJournal
)

// Error is a call's failure: spawnd's refusal, or the connection's.
type Error struct {
	Code Code
	// Message is spawnd's (or the connection's) words.
	Message string
	// Step is, for Spawn, the step that failed.
	Step Step
	// Text is the whole error as the transport said it.
	Text string
}

func (e *Error) Error() string { return e.Text }

// String makes a Code log as its name.
func (c Code) String() string { return string(c) }

// CodeOf is err's code: OK for nil, Unknown for an error that is no *Error.
func CodeOf(err error) Code {
	if err == nil {
		return OK
	}
	var e *Error
	if errors.As(err, &e) {
		return e.Code
	}
	return Unknown
}

// MessageOf is err's message without the transport's wrapping.
func MessageOf(err error) string {
	if err == nil {
		return ""
	}
	var e *Error
	if errors.As(err, &e) {
		return e.Message
	}
	return err.Error()
}

// StepOf is the spawn step err names; unspecified when it names none.
func StepOf(err error) Step {
	var e *Error
	if errors.As(err, &e) {
		return e.Step
	}
	return StepUnspecified
}
