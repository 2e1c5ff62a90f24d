// Package spawnd is the privileged half of nexus-broker: the daemon that
// execs instances for the unprivileged gateway, hands each its dial-back
// secret, and tears it down again.
//
// Shaped like OpenSSH's privilege-separation monitor: the gateway may send
// only the nine verbs of the table in this file, each naming at most one
// lease and served only in the lease states its row allows (Record has two
// rows: with hand_out it is a warm lease's hand-out, pool.go). A lease moves
// spawning → running → terminating → gone, once, and its id is never
// spawned again (a re-adopted lease enters at running). Nothing the gateway
// sends is a path, argv, environment, uid or gid: an entry name is resolved
// against spawnd's own registry (registry.go).
//
// spawnd signals only the members of a lease's own cgroup or, without
// cgroup v2, the process group of a lease whose leader provably still holds
// the group id (cgroup.go, process.go, recover.go). An instance leads its
// own session, inherits no descriptor but 0-2, and starts with
// no_new_privs unless its entry opts out.
//
// Files: spawnd.go (verbs, lease states), registry.go (registry, spawn
// environment), process.go (exec, supervision, escalation), cgroup.go,
// secrets.go (spawn-key, broker id), watch.go (exit fan-out), logcap.go
// (output bounds), journal.go (lease journal, state_dir lock), recover.go
// (re-adoption), index.go (session → binary index), limits.go (spawnd's own
// bounds), tenancy.go (a uid per principal), sandbox.go (bubblewrap),
// pool.go (warm leases and their hand-out).
//
// It may import nothing gateway-side (cmd/nexus-spawnd's deps test checks
// it): of the project only internal/config/core, spawnpb and the helpers
// both halves share.
package spawnd

import (
	"cmp"
	"context"
	"crypto/hmac"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/nexus-broker/nexus-broker/internal/bindindex"
	"github.com/nexus-broker/nexus-broker/internal/bootlog"
	"github.com/nexus-broker/nexus-broker/internal/config/core"
	"github.com/nexus-broker/nexus-broker/internal/safedir"
	"github.com/nexus-broker/nexus-broker/pkg/sessionid"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

// leaseState is where a lease is in its one-way life.
type leaseState int

const (
	stateNone        leaseState = iota // spawnd has never held this lease id
	stateSpawning                      // admitted by Spawn; exec in progress
	stateRunning                       // the instance runs; its pid is known
	stateTerminating                   // Terminate's escalation is under way
	stateGone                          // reaped and forgotten; the id is spent
)

func (s leaseState) String() string {
	return [...]string{"unknown", "spawning", "running", "terminating", "gone"}[s]
}

// verb indexes the verb table.
type verb int

const (
	verbSpawn verb = iota
	verbVerify
	verbTerminate
	verbList
	verbWatch
	verbRecord
	verbReload
	verbStatus
	verbBinding
	// verbHandOut is Record with hand_out (pool.go): the same verb, its
	// own row.
	verbHandOut
)

// verbs is the whole of what the gateway may ask, and in which lease states
// (none: the verb names no lease). Every handler starts with admit (Verify
// with its allocation-free half, check); nothing else decides whether a
// request is served.
var verbs = [...]struct {
	name   string
	states []leaseState
}{
	verbSpawn:     {"Spawn", []leaseState{stateNone}},
	verbVerify:    {"Verify", []leaseState{stateSpawning, stateRunning, stateTerminating}},
	verbTerminate: {"Terminate", []leaseState{stateRunning, stateTerminating}},
	verbList:      {"List", nil},
	verbWatch:     {"Watch", nil},
	verbRecord:    {"Record", []leaseState{stateRunning, stateTerminating}},
	verbReload:    {"Reload", nil},
	verbStatus:    {"Status", nil},
	verbBinding:   {"Binding", nil},
	verbHandOut:   {"Record", []leaseState{stateRunning}},
}

// lease is one instance spawnd started or adopted. Daemon.mu guards every
// field but gone and exit; exit is written once, before gone is closed.
type lease struct {
	rec   leaseRecord
	state leaseState
	pidfd int // -1 once closed
	// configPath is the temp config to remove when the instance is gone;
	// empty for an adopted lease whose record named none spawnd would trust.
	configPath string
	// configBytes is the size of configPath while it exists (0 for an
	// adopted lease), for spawnd.max_config_bytes.
	configBytes int64
	// adopted: re-adopted from the journal, so spawnd is not the
	// instance's parent and cannot reap it (see signalGroup).
	adopted bool
	sid     int // the adopted leader's session id, for killGroupRemains
	// reports counts Record calls that tried to change rec.SessionID.
	reports int
	// inCgroup: teardown signals the lease cgroup, not the process group.
	inCgroup bool
	// sandboxed: spawned here in bubblewrap (sandbox: strict), so the
	// leader is bwrap and the engine another member of its group
	// (drainSandbox). False for an adopted lease.
	sandboxed bool
	// gone is closed once the instance is reaped and its exit published.
	gone chan struct{}
	exit *spawnpb.ExitEvent
}

// snapshot is the lease's record for the journal, numbered so that
// snapshots appended out of order are put back in order. The caller holds
// Daemon.mu.
func (l *lease) snapshot() leaseRecord {
	l.rec.seq++
	return l.rec
}

// Daemon serves the Spawner verbs. Create it with New.
type Daemon struct {
	log        *slog.Logger
	cfgPath    string
	key        []byte // spawn-key: the HMAC key every spawn secret derives from
	brokerID   string
	bootID     string   // this boot's /proc/sys/kernel/random/boot_id
	advertise  string   // advertise_addr, journaled with each lease
	listenAddr string   // listen_addr at boot, what NEXUS_BROKER_ADDR is built from
	privileged bool     // holds CAP_SETUID and CAP_SETGID, so run_as can work
	configDir  string   // temp configs; 0711 so a run_as instance can open its own
	configLock *os.File // configDir's lock, held for the Daemon's life
	logDir     string   // one stdout/stderr file per lease
	// cgroups holds one cgroup v2 per lease (cgroup.go); nil where there
	// is no delegated tree, and instances are contained by process group.
	cgroups *cgroupTree
	// tenancy is the tenancy: block in force (tenancy.go); nil when off.
	tenancy *tenancy
	// "" and nil without a state_dir (index also when it could not be
	// opened).
	stateDir  string
	stateLock *os.File
	// releases is the directory of handed-over releases, "" until
	// TakeReleases; releaseWatch its inotify watch (handover.go).
	releases     string
	releaseWatch *os.File
	journal      *bindindex.Index[journalLine]
	index        *bindindex.Index[binding]

	// reloadMu serialises Reload so the keys it reports are the ones it swapped.
	reloadMu sync.Mutex

	mu       sync.Mutex
	settings *settings         // replaced whole by Reload, never edited
	leases   map[string]*lease // spawning, running and terminating leases
	// spent holds every lease id Spawn ever admitted, so none is spawned
	// twice (one short string per lease for spawnd's life).
	spent  map[string]struct{}
	closed bool

	watchers watchers
	closing  chan struct{} // closed by Close
	// Closing stopW (a pipe) stops the exit watch, which also watches
	// logWatch, the inotify descriptor of logDir.
	stopR, stopW, logWatch int
	exits                  *exitWatch
	// wg counts supervisors, escalations and spawns; Close waits for them.
	wg sync.WaitGroup
}

// New resolves cfg's registry against this machine, loads or creates the
// spawn-key and broker id, and, with a state_dir, locks it, replays the lease
// journal and re-adopts the instances whose identity it can prove. Reload
// re-reads cfgPath.
func New(cfgPath string, cfg *core.Config, log *slog.Logger) (_ *Daemon, err error) {
	if err := sealInheritedFDs(); err != nil {
		return nil, err
	}
	s, err := resolve(cfg)
	if err != nil {
		return nil, err
	}
	if err := checkTenancyRoot(cfg); err != nil {
		return nil, err
	}
	stateDir, err := core.ExpandHome(cfg.StateDir)
	if err != nil {
		return nil, fmt.Errorf("broker config: state_dir: %w", err)
	}
	d := &Daemon{
		log:        log,
		stateDir:   stateDir,
		cfgPath:    cfgPath,
		advertise:  cfg.AdvertiseAddr,
		listenAddr: cfg.ListenAddr,
		privileged: hasSetIDCaps(),
		settings:   s,
		leases:     map[string]*lease{},
		spent:      map[string]struct{}{},
		watchers:   watchers{subs: map[*subscriber]struct{}{}},
		closing:    make(chan struct{}),
		stopR:      -1,
		stopW:      -1,
		logWatch:   -1,
	}
	defer func() {
		if err != nil {
			d.release()
		}
	}()
	if stateDir == "" {
		log.Warn(core.NoStateDirWarning)
	} else {
		if err := safedir.PrivateKey(stateDir, "state_dir", "nexus-spawnd's user", "the spawn-key, the lease journal and instance output", log); err != nil {
			return nil, bootlog.Wrap(bootlog.OpenState, err, "state_dir", stateDir)
		}
		// Before anything in state_dir is read: a second spawnd must not
		// even replay a journal another one appends to.
		if d.stateLock, err = lockStateDir(stateDir); err != nil {
			return nil, bootlog.Wrap(bootlog.OpenState, err, "state_dir", stateDir)
		}
	}
	if d.key, err = loadSpawnKey(stateDir); err != nil {
		return nil, bootlog.Wrap(bootlog.LoadSpawnKey, err, "state_dir", stateDir)
	}
	if d.brokerID, err = loadBrokerID(cfg.BrokerID, stateDir); err != nil {
		return nil, err
	}
	if cfg.Tenancy != nil {
		if d.tenancy, err = openTenancy(cfg, stateDir, log); err != nil {
			return nil, err
		}
	}
	if d.bootID, err = readBootID(); err != nil {
		return nil, err
	}
	if err := d.openCgroups(cfg.Spawnd.CgroupRoot, s); err != nil {
		return nil, err
	}
	pipe := make([]int, 2)
	if err := unix.Pipe2(pipe, unix.O_CLOEXEC); err != nil {
		return nil, fmt.Errorf("creating the supervisor stop pipe: %w", err)
	}
	d.stopR, d.stopW = pipe[0], pipe[1]
	if d.exits, err = newExitWatch(d.stopR); err != nil {
		return nil, err
	}
	sweepConfigDirs(tempRoot())
	if d.configDir, d.logDir, d.configLock, err = makeWorkDirs(stateDir); err != nil {
		return nil, err
	}
	var adopted []*lease
	if stateDir != "" {
		var live []leaseRecord
		if d.journal, live, err = openJournal(stateDir, d.brokerID, log); err != nil {
			return nil, bootlog.Wrap(bootlog.OpenState, err, "state_dir", stateDir)
		}
		adopted = d.recoverLeases(live)
		d.wg.Add(1)
		go d.healJournal()
	}
	d.index = openSessionIndex(stateDir, maxBindings, log)
	d.sweepCgroups()
	if err := d.startLogWatch(); err != nil {
		return nil, fmt.Errorf("watching the instance log directory %s: %w", d.logDir, err)
	}
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		if err := d.exits.run(); err != nil {
			d.log.Error("watching for instance exits and output failed; exits are no longer reported, nor logs capped", "error", err)
		}
	}()
	d.describe(s)
	for _, l := range adopted {
		d.wg.Add(1)
		d.supervise(l)
	}
	return d, nil
}

// release frees what New acquired, for Close and for a New that fails.
// Instances are never touched.
func (d *Daemon) release() {
	for _, fd := range []int{d.stopR, d.stopW, d.logWatch} {
		if fd >= 0 {
			_ = unix.Close(fd)
		}
	}
	if d.exits != nil {
		_ = d.exits.ep.close()
	}
	d.journal.Close()
	d.index.Close()
	d.tenancy.close()
	if d.cgroups != nil {
		_ = os.Remove(d.cgroups.dir) // only if no lease cgroup is left
	}
	if d.configDir != "" {
		// Each succeeds only if empty: a live instance may still read its
		// config, and instance output is kept for the operator.
		_ = os.Remove(d.logDir)
		_ = d.configLock.Close()
		removeStaleDir(d.configDir)
	}
	if d.stateLock != nil {
		_ = d.stateLock.Close()
	}
}

// Close stops every supervisor, escalation and Watch stream. With a
// state_dir it never signals an instance: they keep running, with their temp
// configs, for the next nexus-spawnd to re-adopt from the journal. Without
// one nothing could ever adopt them, so it ends them first (endAll).
func (d *Daemon) Close() error {
	if d.stateLock == nil {
		d.endAll()
	}
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil
	}
	d.closed = true
	d.mu.Unlock()
	close(d.closing)
	if d.releaseWatch != nil {
		_ = d.releaseWatch.Close() // ends watchReleases
	}
	_ = unix.Close(d.stopW)
	d.stopW = -1
	d.wg.Wait()
	d.release()
	return nil
}

// reasonSpawndStopped is the teardown reason of the instances a spawnd
// without state_dir ends as it stops.
const reasonSpawndStopped = "nexus-spawnd stopped"

// endAll terminates every lease and waits for the exits, SIGTERM first
// (the gateway, gone or going, asks no instance to stop), SIGKILL after
// termGrace.
func (d *Daemon) endAll() {
	d.mu.Lock()
	ids := slices.Collect(maps.Keys(d.leases))
	d.mu.Unlock()
	if len(ids) == 0 {
		return
	}
	d.log.Warn("nexus-spawnd is stopping without a state_dir, so no successor could adopt its instances: ending them", "leases", len(ids))
	ctx, cancel := context.WithTimeout(context.Background(), 2*termGrace+time.Second)
	defer cancel()
	var wg sync.WaitGroup
	for _, id := range ids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _ = d.Terminate(ctx, &spawnpb.TerminateRequest{LeaseId: id, Reason: reasonSpawndStopped, SkipGrace: true})
		}()
	}
	wg.Wait()
}

// configFor and logFor are where a lease's temp config and output go.
func (d *Daemon) configFor(id string) string { return filepath.Join(d.configDir, id+".yaml") }
func (d *Daemon) logFor(id string) string    { return filepath.Join(d.logDir, id+".log") }

// admit checks one request against the verb table and returns the named
// lease (nil for Spawn and verbs naming none) or the refusal. The caller
// holds d.mu.
func (d *Daemon) admit(v verb, leaseID string) (*lease, error) {
	row := verbs[v]
	if err := d.shutdownRefusal(v); err != nil {
		return nil, err
	}
	if row.states == nil {
		return nil, nil
	}
	if !validLeaseID(leaseID) {
		return nil, refusal(codes.InvalidArgument, "%s: lease id %q is not 1 to %d letters, digits, '-' or '_'", row.name, leaseID, maxLeaseIDLen)
	}
	l, st, ok := d.check(v, leaseID)
	switch {
	case ok:
		return l, nil
	case v == verbSpawn:
		return nil, refusal(codes.AlreadyExists, "Spawn: lease %q is %s; nexus-spawnd spawns a lease id once, so mint a new lease", leaseID, st)
	case v == verbHandOut:
		return nil, refusal(codes.FailedPrecondition, "Record: lease %q is %s; only a running pool lease is handed out to a principal", leaseID, st)
	case st == stateNone || st == stateGone:
		return nil, refusal(codes.NotFound, "%s: nexus-spawnd holds no lease %q", row.name, leaseID)
	default:
		return nil, refusal(codes.FailedPrecondition, "%s: lease %q is %s; wait for Spawn to return", row.name, leaseID, st)
	}
}

// shutdownRefusal refuses every verb once spawnd is closing. The caller
// holds d.mu.
func (d *Daemon) shutdownRefusal(v verb) error {
	if !d.closed {
		return nil
	}
	return refusal(codes.Unavailable, "%s: nexus-spawnd is shutting down; retry once it is back", verbs[v].name)
}

// check is admit's verdict without the refusal: the lease, its state and
// whether v may act on it. It allocates nothing and looks in both tables
// whatever it finds, so Verify does the same work for a live lease as for
// an unknown one. The caller holds d.mu.
func (d *Daemon) check(v verb, leaseID string) (*lease, leaseState, bool) {
	l, live := d.leases[leaseID]
	_, spent := d.spent[leaseID]
	st := stateNone
	switch {
	case live:
		st = l.state
	case spent:
		st = stateGone
	}
	return l, st, slices.Contains(verbs[v].states, st)
}

// admitError is admit's refusal, formatted only when it is sent: Verify
// drops it, and an unknown lease must not cost more than a wrong secret.
type admitError struct {
	code   codes.Code
	format string
	args   []any
}

func refusal(code codes.Code, format string, args ...any) error {
	return &admitError{code: code, format: format, args: args}
}

func (e *admitError) GRPCStatus() *status.Status { return status.Newf(e.code, e.format, e.args...) }
func (e *admitError) Error() string              { return e.GRPCStatus().Err().Error() }

// Bounds on the other strings the gateway has journaled, so every journal
// line is bounded: a principal (an OIDC subject is at most 255 characters,
// maybe prefixed by an issuer) and a teardown reason (a few words).
const (
	maxPrincipalLen = 1024
	maxReasonLen    = 128
)

// checkPrincipal refuses a principal past maxPrincipalLen or holding a
// NUL. It is a key (journal, owners, uids), never part of a path.
func checkPrincipal(p string) error {
	if len(p) > maxPrincipalLen {
		return fmt.Errorf("principal of %d bytes is longer than %d", len(p), maxPrincipalLen)
	}
	if strings.IndexByte(p, 0) >= 0 {
		return errors.New("principal holds a NUL byte")
	}
	return nil
}

// maxLeaseIDLen bounds a lease id; lease ids name files in spawnd's
// directories, hence the narrow alphabet too.
const maxLeaseIDLen = 128

func validLeaseID(id string) bool { return core.IsToken(id, maxLeaseIDLen) }

// spawnFailed is Spawn's INTERNAL error with the failed step as a
// SpawnFailure detail.
func spawnFailed(step spawnpb.SpawnStep, err error) error {
	code := codes.Internal
	if errors.Is(err, errNoUID) {
		code = codes.ResourceExhausted
	}
	st := status.New(code, "Spawn: "+err.Error())
	if withStep, derr := st.WithDetails(&spawnpb.SpawnFailure{Step: step}); derr == nil {
		st = withStep
	}
	return st.Err()
}

// Spawn starts the instance of a new lease from a registry entry.
func (d *Daemon) Spawn(_ context.Context, req *spawnpb.SpawnRequest) (*spawnpb.SpawnResponse, error) {
	addr, err := core.DialBack(d.listenAddr, int(req.GetListenPort()))
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "Spawn: %v", err)
	}
	if err := checkPrincipal(req.GetPrincipal()); err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "Spawn: %v", err)
	}
	if err := checkWarm(req); err != nil {
		return nil, err
	}
	recall := req.GetRecallSessionId()
	if recall != "" {
		if err := sessionid.Validate(recall); err != nil {
			return nil, status.Errorf(codes.InvalidArgument, "Spawn: recall_session_id: %v", err)
		}
	}
	id := req.GetLeaseId()

	d.mu.Lock()
	if _, err := d.admit(verbSpawn, id); err != nil {
		d.mu.Unlock()
		return nil, err
	}
	s := d.settings
	e, ok := s.entries[req.GetEntry()]
	if !ok {
		d.mu.Unlock()
		return nil, status.Errorf(codes.NotFound, "Spawn: unknown entry %q; this nexus-spawnd spawns: %s",
			req.GetEntry(), strings.Join(slices.Sorted(maps.Keys(s.entries)), ", "))
	}
	if req.GetPool() != "" && d.tenancy != nil {
		d.mu.Unlock()
		return nil, status.Errorf(codes.FailedPrecondition, "Spawn: pool %q: with tenancy:, an instance boots as its principal's uid, and a warm lease has no principal yet", req.GetPool())
	}
	if e.runAs != nil && !d.privileged {
		d.mu.Unlock()
		d.log.Error("spawning instance refused: run_as needs CAP_SETUID and CAP_SETGID, which nexus-spawnd does not hold; "+
			"run it as root or grant both capabilities, or remove run_as from the entry",
			"lease_id", id, "entry", e.name, "run_as", e.runAs.String())
		return nil, status.Errorf(codes.PermissionDenied, "Spawn: entry %q runs as %s, and nexus-spawnd lacks CAP_SETUID and CAP_SETGID", e.name, e.runAs)
	}
	if err := d.capacityRefusal(len(req.GetConfig())); err != nil {
		d.mu.Unlock()
		d.log.Warn("spawning instance refused: nexus-spawnd is at its own bound", "lease_id", id, "entry", e.name, "error", status.Convert(err).Message())
		return nil, err
	}
	if owner := d.sessionOwner(recall, nil); owner != "" && owner != e.name {
		d.mu.Unlock()
		d.log.Warn("spawning instance refused: the session it resumes belongs to another entry",
			"lease_id", id, "entry", e.name, "session_id", recall, "bound_to", owner)
		return nil, status.Errorf(codes.FailedPrecondition, "Spawn: session %q belongs to entry %q, not %q", recall, owner, e.name)
	}
	l := &lease{
		rec: leaseRecord{
			LeaseID:   id,
			Principal: req.GetPrincipal(),
			// A resume's session id is known now (a new one comes through
			// Record); held here, it keeps other entries from binding it.
			SessionID:     recall,
			Entry:         e.name,
			Pool:          req.GetPool(),
			CreatedAt:     time.Now().UTC(),
			BrokerID:      d.brokerID,
			AdvertiseAddr: d.advertise,
			ConfigPath:    d.configFor(id),
		},
		state:       stateSpawning,
		pidfd:       -1,
		configBytes: int64(len(req.GetConfig())),
		gone:        make(chan struct{}),
	}
	d.leases[id] = l
	d.spent[id] = struct{}{}
	d.wg.Add(1) // handed to the supervisor, or released by unmint
	rec := l.snapshot()
	d.mu.Unlock()
	// A lease the journal cannot hold is refused before anything runs: a
	// restart would not know its instance.
	if err := d.journal.Put(journalLine{kindMinted, rec}); err != nil {
		d.unmint(l, reasonJournalFailed)
		return nil, d.journalRefusal(id, e.name, err, "nothing was started")
	}

	p, step, err := d.start(id, e, s.inherit, req, addr)
	if err != nil {
		d.unmint(l, reasonSpawnFailed)
		d.log.Error("spawning instance failed", "lease_id", id, "entry", e.name, "error", err)
		return nil, spawnFailed(step, err)
	}

	d.mu.Lock()
	l.state = stateRunning
	l.pidfd = p.pidfd
	l.inCgroup = d.cgroups != nil
	l.sandboxed = d.tenancy != nil && d.tenancy.bwrap != ""
	l.configPath = l.rec.ConfigPath
	l.rec.PID = p.pid
	l.rec.StartTime = p.startTime
	l.rec.BootID = d.bootID
	rec = l.snapshot()
	d.mu.Unlock()
	// Before the supervisor takes over this call's share of d.wg, so a
	// Close meanwhile waits for the record that carries the pid. Without
	// it, the instance is one no successor could prove ours: it goes.
	if err := d.journal.Put(journalLine{kindStarted, rec}); err != nil {
		d.discard(id, p.pid)
		_ = unix.Close(p.pidfd)
		_ = os.Remove(rec.ConfigPath)
		d.unmint(l, reasonJournalFailed)
		return nil, d.journalRefusal(id, e.name, err, "its instance was killed")
	}
	// Bound only once the instance runs: a failed exec replayed nothing. A
	// resume keeps the session's owner. A failed write is the index's to
	// log: the binding stays in memory.
	if recall != "" {
		_ = d.index.Put(binding{recall, e.name, d.creator(recall, l.rec.Principal)})
	}
	d.supervise(l)

	attrs := []any{"lease_id", id, "entry", e.name, "pid", p.pid, "log", d.logFor(id)}
	if e.runAs != nil {
		attrs = append(attrs, "run_as", e.runAs.String())
	}
	d.log.Info("instance spawned", attrs...)
	return &spawnpb.SpawnResponse{Pid: int64(p.pid), CreatedUnixNano: rec.CreatedAt.UnixNano(), Verifier: verifierFor(d.key, id)}, nil
}

// unmint ends a lease whose Spawn failed before its instance was handed to
// a supervisor.
func (d *Daemon) unmint(l *lease, reason string) {
	d.mu.Lock()
	l.state = stateGone
	delete(d.leases, l.rec.LeaseID)
	l.pidfd = -1
	l.rec.Reason = reason
	rec := l.snapshot()
	d.mu.Unlock()
	// Kept in memory if the journal is down: its rewrite leaves the lease
	// out.
	_ = d.journal.Put(journalLine{kindEnded, rec})
	d.wg.Done()
}

// Verify checks a register frame's secret against the lease's derived one.
// It skips admit's refusal (whose formatting would cost an unknown lease
// more) and derives and compares the secret whatever the lookup found, so
// an unknown or malformed lease costs what a wrong secret does and the
// timing tells a dialer nothing.
func (d *Daemon) Verify(_ context.Context, req *spawnpb.VerifyRequest) (*spawnpb.VerifyResponse, error) {
	id, secret := req.GetLeaseId(), req.GetSecret()
	d.mu.Lock()
	closing := d.shutdownRefusal(verbVerify)
	_, _, live := d.check(verbVerify, id)
	d.mu.Unlock()
	live = validLeaseID(id) && live // valid checked first: both cases check it
	if closing != nil {
		return nil, closing
	}
	match := hmac.Equal([]byte(secret), []byte(secretFor(d.key, id)))
	result := spawnpb.VerifyResult_VERIFY_RESULT_OK
	switch {
	case !live:
		result = spawnpb.VerifyResult_VERIFY_RESULT_UNKNOWN_LEASE
	case secret == "":
		result = spawnpb.VerifyResult_VERIFY_RESULT_NO_SECRET
	case !match:
		result = spawnpb.VerifyResult_VERIFY_RESULT_WRONG_SECRET
	}
	return &spawnpb.VerifyResponse{Result: result}, nil
}

// Terminate starts the lease's escalation unless one is under way, and
// returns the instance's exit (at once with no_wait). Concurrent calls share
// one escalation; the first call's reason and skip_grace stand, and the
// reason is what the ended record says. The escalation outlives a caller
// that goes away.
func (d *Daemon) Terminate(ctx context.Context, req *spawnpb.TerminateRequest) (*spawnpb.TerminateResponse, error) {
	if len(req.GetReason()) > maxReasonLen {
		return nil, status.Errorf(codes.InvalidArgument, "Terminate: reason of %d bytes is longer than %d", len(req.GetReason()), maxReasonLen)
	}
	d.mu.Lock()
	l, err := d.admit(verbTerminate, req.GetLeaseId())
	if err != nil {
		d.mu.Unlock()
		return nil, err
	}
	began, grace := l.state == stateRunning, d.settings.releaseGrace
	if began {
		l.state = stateTerminating
		l.rec.Reason = req.GetReason()
		d.wg.Add(1)
		go d.escalate(l, req.GetSkipGrace(), grace)
	}
	pid := l.rec.PID
	d.mu.Unlock()
	if began {
		d.log.Info("terminating instance", "lease_id", req.GetLeaseId(), "pid", pid, "reason", req.GetReason(),
			"skip_grace", req.GetSkipGrace(), "release_grace", grace.String())
	}
	if req.GetNoWait() {
		return &spawnpb.TerminateResponse{}, nil
	}
	select {
	case <-l.gone:
		return &spawnpb.TerminateResponse{Exit: l.exit}, nil
	case <-ctx.Done():
		return nil, status.FromContextError(ctx.Err()).Err()
	case <-d.closing:
		return nil, status.Error(codes.Unavailable, "Terminate: nexus-spawnd is shutting down; the instance was left running")
	}
}

// List returns the live leases, oldest first.
func (d *Daemon) List(context.Context, *spawnpb.ListRequest) (*spawnpb.ListResponse, error) {
	d.mu.Lock()
	if _, err := d.admit(verbList, ""); err != nil {
		d.mu.Unlock()
		return nil, err
	}
	out := make([]*spawnpb.Lease, 0, len(d.leases))
	for _, l := range d.leases {
		out = append(out, &spawnpb.Lease{
			LeaseId:         l.rec.LeaseID,
			Principal:       l.rec.Principal,
			SessionId:       l.rec.SessionID,
			Entry:           l.rec.Entry,
			Pid:             int64(l.rec.PID),
			CreatedUnixNano: l.rec.CreatedAt.UnixNano(),
			Adopted:         l.adopted,
			Pool:            l.rec.waitingIn(),
		})
	}
	d.mu.Unlock()
	for _, l := range out { // derived outside the lock: d.key never changes
		l.Verifier = verifierFor(d.key, l.LeaseId)
	}
	slices.SortFunc(out, func(a, b *spawnpb.Lease) int {
		return cmp.Or(cmp.Compare(a.CreatedUnixNano, b.CreatedUnixNano), strings.Compare(a.LeaseId, b.LeaseId))
	})
	return &spawnpb.ListResponse{Leases: out}, nil
}

// Watch streams every exit from the moment it subscribes, and sends its
// headers once it has: a caller that waits for them, then calls List,
// misses no exit. A subscriber watchBuffer exits behind is dropped rather
// than allowed to stall the supervisors.
func (d *Daemon) Watch(_ *spawnpb.WatchRequest, stream grpc.ServerStreamingServer[spawnpb.ExitEvent]) error {
	d.mu.Lock()
	_, err := d.admit(verbWatch, "")
	d.mu.Unlock()
	if err != nil {
		return err
	}
	sub := d.watchers.subscribe()
	defer d.watchers.unsubscribe(sub)
	if err := stream.SendHeader(nil); err != nil {
		return err
	}
	for {
		select {
		case ev := <-sub.events:
			if err := stream.Send(ev); err != nil {
				return err
			}
		case <-sub.dropped:
			return status.Errorf(codes.ResourceExhausted, "Watch: this stream fell %d exits behind and was dropped; call Watch again, then List to resync", watchBuffer)
		case <-stream.Context().Done():
			return status.FromContextError(stream.Context().Err()).Err()
		case <-d.closing:
			return status.Error(codes.Unavailable, "Watch: nexus-spawnd is shutting down")
		}
	}
}

// Record stores the session id an instance reported, in the journal and the
// session → binary index. A session belongs to the entry that created it:
// an id another entry holds is refused, as is one another principal
// created, one breaking the session id rule, or one past maxSessionReports. A refused report leaves the lease running
// with the session id it had. With hand_out it is a hand-out (handOut).
func (d *Daemon) Record(_ context.Context, req *spawnpb.RecordRequest) (*spawnpb.RecordResponse, error) {
	if req.GetHandOut() {
		return d.handOut(req)
	}
	if req.GetPrincipal() != "" {
		return nil, status.Error(codes.InvalidArgument, "Record: a principal is given only with hand_out")
	}
	session := req.GetSessionId()
	d.mu.Lock()
	l, err := d.admit(verbRecord, req.GetLeaseId())
	if err != nil {
		d.mu.Unlock()
		return nil, err
	}
	if l.rec.SessionID == session {
		d.mu.Unlock()
		return &spawnpb.RecordResponse{}, nil // a redial's repeat changes nothing
	}
	l.reports++
	if err := d.bindLocked(l, session); err != nil {
		n := l.reports
		d.mu.Unlock()
		if n <= maxSessionReports+1 { // one line for the first refusal past the cap, none after
			d.log.Warn("session-id report refused; the lease keeps running with the session id it had",
				"lease_id", l.rec.LeaseID, "entry", l.rec.Entry, "error", status.Convert(err).Message())
		}
		return nil, err
	}
	rec := l.snapshot()
	d.wg.Add(1) // so Close waits for this write rather than racing it
	d.mu.Unlock()
	defer d.wg.Done()
	d.journal.Put(journalLine{kindRecorded, rec})
	return &spawnpb.RecordResponse{}, nil
}

// maxSessionReports is how many session ids one lease may try to record. A
// stock nexus reports one per session (its redials repeat it, which Record
// ignores); the cap keeps a hostile instance from growing the journal and
// the index.
const maxSessionReports = 4

// bindLocked makes session l's, in the lease and the index, or says why not.
// The caller holds d.mu, which is what makes the check and the bind one step.
func (d *Daemon) bindLocked(l *lease, session string) error {
	if l.reports > maxSessionReports {
		return status.Errorf(codes.ResourceExhausted, "Record: lease %q already reported %d session ids, the most one lease may", l.rec.LeaseID, maxSessionReports)
	}
	if err := sessionid.Validate(session); err != nil {
		return status.Errorf(codes.InvalidArgument, "Record: %v", err)
	}
	if owner := d.sessionOwner(session, l); owner != "" && owner != l.rec.Entry {
		return status.Errorf(codes.FailedPrecondition, "Record: session %q belongs to entry %q, not %q", session, owner, l.rec.Entry)
	}
	// A claimed lease's instance may not take a session another principal
	// created: its claimant would be handed an id it may not resume, and
	// the session's owner, resuming, could be placed on this instance. An
	// ownerless (warm) lease is checked at its hand-out (handOutRefusal).
	if l.rec.Principal != "" && d.ownership(session, l.rec.Principal) == spawnpb.Ownership_OWNERSHIP_OTHER {
		return status.Errorf(codes.FailedPrecondition, "Record: session %q belongs to another principal", session)
	}
	l.rec.SessionID = session
	_ = d.index.Put(binding{session, l.rec.Entry, d.creator(session, l.rec.Principal)}) // a failed write is the index's to log
	return nil
}

// creator is the principal a session belongs to: its recorded owner, else
// (a new session, or one recorded without an owner) principal.
func (d *Daemon) creator(session, principal string) string {
	if b, ok := d.index.Get(session); ok && b.Principal != "" {
		return b.Principal
	}
	return principal
}

// ownership is whether session belongs to principal, by the index alone:
// every session an instance reports is recorded there, with its creator,
// before the claim answers.
func (d *Daemon) ownership(session, principal string) spawnpb.Ownership {
	b, ok := d.index.Get(session)
	switch {
	case !ok || b.Principal == "":
		return spawnpb.Ownership_OWNERSHIP_UNRECORDED
	case b.Principal != principal:
		return spawnpb.Ownership_OWNERSHIP_OTHER
	}
	return spawnpb.Ownership_OWNERSHIP_OWN
}

// sessionOwner is the entry a session belongs to: that of the newest live
// lease other than self holding it (from the claim, or accepted by Record),
// else the index's; "" for none. The caller holds d.mu.
func (d *Daemon) sessionOwner(session string, self *lease) string {
	if session == "" {
		return "" // a new session
	}
	var newest *lease
	for _, l := range d.leases {
		if l != self && l.rec.SessionID == session && (newest == nil || l.rec.CreatedAt.After(newest.rec.CreatedAt)) {
			newest = l
		}
	}
	if newest != nil {
		return newest.rec.Entry
	}
	if d.stateLock == nil {
		return "" // an index in memory holds owners only: no state_dir, no binary check
	}
	b, _ := d.index.Get(session)
	return b.Entry
}

// Reload re-reads broker.yaml and resolves it as New did; only if all of it
// succeeds are the settings replaced, in one step, never touching a live
// lease. It refuses a request whose digest the file no longer has, and one
// with refuse_boot_only when a boot-only key of spawnd's changed.
func (d *Daemon) Reload(_ context.Context, req *spawnpb.ReloadRequest) (*spawnpb.ReloadResponse, error) {
	d.reloadMu.Lock()
	defer d.reloadMu.Unlock()
	d.mu.Lock()
	_, err := d.admit(verbReload, "")
	prev := d.settings
	d.mu.Unlock()
	if err != nil {
		return nil, err
	}

	next, err := loadSettings(d.cfgPath)
	var changed, bootOnly []string
	if err == nil {
		changed, bootOnly = core.ReloadDiff(prev.cfg, next.cfg)
		changed, bootOnly = ownKeys(changed), ownKeys(bootOnly)
		switch want := req.GetConfigDigest(); {
		case want != "" && next.cfg.Digest != want:
			err = fmt.Errorf("%s changed again after the gateway read it (the gateway validated digest %.12s, the file now has %.12s); "+
				"nothing was applied: send SIGHUP again", d.cfgPath, want, next.cfg.Digest)
		case req.GetRefuseBootOnly() && len(bootOnly) > 0:
			err = fmt.Errorf("%s changed %s, which nexus-spawnd reads only at boot; nothing was applied: restart nexus-spawnd to apply them",
				d.cfgPath, strings.Join(bootOnly, ", "))
		default:
			err = d.cgroups.admit(next)
		}
	}
	if err != nil {
		d.log.Error("config reload rejected; the configuration already in force is unchanged", "path", d.cfgPath, "error", err)
		return &spawnpb.ReloadResponse{Applied: false, Error: err.Error(), Binaries: prev.listing(), BootOnly: bootOnly}, nil
	}
	// The boot-only values stay those in force, so an ignored edit stays
	// pending; no version of the file is then wholly in force, and Status
	// names none, so that a gateway attaching with it is refused.
	digest := next.cfg.Digest
	next.cfg = core.Reloaded(prev.cfg, next.cfg)
	next.cfg.Digest = ""
	if len(bootOnly) == 0 {
		next.cfg.Digest = digest
	}
	d.mu.Lock()
	d.settings = next
	d.mu.Unlock()

	if len(bootOnly) > 0 {
		d.log.Warn("config reload: these keys changed in the file but are only read at boot, so the values in force are unchanged; restart nexus-spawnd to apply them",
			"keys", strings.Join(bootOnly, ","))
	}
	d.log.Info("config reload applied", "path", d.cfgPath, "changed", strings.Join(changed, ","), "binaries", len(next.entries))
	d.describe(next)
	return &spawnpb.ReloadResponse{Applied: true, Changed: changed, Binaries: next.listing(), BootOnly: bootOnly}, nil
}

// Status returns the public registry listing, spawnd's identity, and why
// its lease journal cannot record a lease now, if it cannot.
func (d *Daemon) Status(context.Context, *spawnpb.StatusRequest) (*spawnpb.StatusResponse, error) {
	d.mu.Lock()
	_, err := d.admit(verbStatus, "")
	s := d.settings
	d.mu.Unlock()
	if err != nil {
		return nil, err
	}
	return &spawnpb.StatusResponse{Binaries: s.listing(), BrokerId: d.brokerID, Pid: int64(os.Getpid()),
		ConfigPath: d.cfgPath, ConfigDigest: s.cfg.Digest, JournalError: d.journalError()}, nil
}

// Binding answers which entry ran a session, for the gateway to hold a
// resume to it (sessionOwner; "" is no opinion: the resume proceeds
// unchecked), and whether the asking principal created it (ownership),
// never naming the owner.
func (d *Daemon) Binding(_ context.Context, req *spawnpb.BindingRequest) (*spawnpb.BindingResponse, error) {
	session := req.GetSessionId()
	if err := sessionid.Validate(session); err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "Binding: %v; ask only about a claim that resumes a session", err)
	}
	if err := checkPrincipal(req.GetPrincipal()); err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "Binding: %v", err)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.admit(verbBinding, ""); err != nil {
		return nil, err
	}
	return &spawnpb.BindingResponse{Entry: d.sessionOwner(session, nil), Ownership: d.ownership(session, req.GetPrincipal())}, nil
}
