package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/auth"
	"github.com/nexus-broker/nexus-broker/internal/config"
	"github.com/nexus-broker/nexus-broker/internal/config/core"
	"github.com/nexus-broker/nexus-broker/internal/gateway/internal/capacity"
	"github.com/nexus-broker/nexus-broker/internal/gateway/spawner"
	"github.com/nexus-broker/nexus-broker/pkg/sessionid"
)

type claimRequest struct {
	Config    string `json:"config"`
	SessionID string `json:"session_id"`
	Binary    string `json:"binary"`
}

// ClaimAnswer is POST /claim's 200 answer.
type ClaimAnswer struct {
	LeaseID   string `json:"lease_id"`
	WSURL     string `json:"ws_url"`
	SessionID string `json:"session_id,omitempty"` // none reported within session_report_grace
	// SessionError is why the instance's session-id report was refused.
	SessionError string `json:"session_error,omitempty"`
	Ticket       string `json:"ticket,omitempty"`
	// For the "claim ready" line; zero when a peer served the claim.
	PID    int64  `json:"-"`
	Binary string `json:"-"`
}

// claimError is a refusal: its status, its wire text, and its metrics
// outcome.
type claimError struct {
	status  int
	text    string
	outcome string
	cause   string // the underlying error, for the log only
	// retryAfter, when set, is the answer's Retry-After (seconds).
	retryAfter int
}

func (e *claimError) Error() string { return e.text }

// face is e as the layers above see it; nil for none.
func (e *claimError) face() *ClaimError {
	if e == nil {
		return nil
	}
	return &ClaimError{Status: e.status, Text: e.text, Outcome: e.outcome, Cause: e.cause, RetryAfter: e.retryAfter}
}

func refuse(status int, outcome, format string, args ...any) *claimError {
	return &claimError{status: status, text: fmt.Sprintf(format, args...), outcome: outcome}
}

// errServedAwayClaim is spawnLease's word that a peer served the claim.
var errServedAwayClaim = &claimError{outcome: "served_away"}

// TextGoneWhileQueued is the log reason of a claim whose client hung up in
// the capacity queue.
const TextGoneWhileQueued = "client went away while queued for capacity"

// errSpawnerUnavailable is the 503 body of a claim spawnd cannot serve now.
const errSpawnerUnavailable = "spawner unavailable"

// errJournalUnavailable is the 503 body of a claim spawnd's lease journal
// could not record, retryable after journalRetryAfter seconds (spawnd
// retries the journal's rewrite every second).
const (
	errJournalUnavailable = "lease journal unavailable"
	journalRetryAfter     = 2
)

// errBrokerDraining is the 503 body of a claim refused by a draining
// broker (nexus-broker -drain), outcomeBrokerDraining its outcome.
const (
	errBrokerDraining     = "this broker is draining (nexus-broker -drain): it takes no new claims; claim through another broker"
	outcomeBrokerDraining = "broker_draining"
)

// spawnerUnavailable refuses a claim at once while spawnd does not answer,
// rather than have it wait for a spawnd that may never come back.
func (g *Gateway) spawnerUnavailable() *claimError {
	if err := g.spawnerDown(); err != nil {
		g.log.Warn("claim refused: nexus-spawnd is not answering", "error", err)
		return refuse(http.StatusServiceUnavailable, "spawn_failed", errSpawnerUnavailable)
	}
	return nil
}

// CountClaim counts one claim of the spawn spine (POST /claim's or the A2A
// ingress's) by its outcome, from start, refused when e is set. Only
// accepted claims are timed: a refusal's latency measures the refusal or
// the queue wait, not what a claim costs.
func (g *Gateway) CountClaim(start time.Time, e *ClaimError) {
	if e != nil {
		g.m.Claims.Inc(e.Outcome)
		return
	}
	g.m.Claims.Inc("accepted")
	g.m.ClaimDuration.Observe(time.Since(start))
}

// ClaimRequest is POST /claim once the HTTP layer authenticated p and read
// the body within max_claim_body: validate, take a slot, mint, spawn, wait
// for ready. Every refusal that can be decided from the request is decided
// before anything is allocated. The caller counts it (CountClaim).
func (g *Gateway) ClaimRequest(r *http.Request, p auth.Principal, body []byte) (*ClaimAnswer, *ClaimError) {
	resp, cerr := g.claimBody(r, p, body, slotAcquire)
	return resp, cerr.face()
}

// claimBody is a claim whose body has been read: one that arrived here
// (slotAcquire), or one a full peer offered (slotOffered: taken only if a
// slot is free now, never queued, never offered on).
func (g *Gateway) claimBody(r *http.Request, p auth.Principal, body []byte, slot slotMode) (*ClaimAnswer, *claimError) {
	var req claimRequest
	if json.Unmarshal(body, &req) != nil {
		return nil, refuse(http.StatusBadRequest, "rejected", TextInvalidClaimBody)
	}
	if strings.TrimSpace(req.Config) == "" {
		return nil, refuse(http.StatusBadRequest, "rejected", "claim requires a non-empty config")
	}
	requested := strings.TrimSpace(req.Binary)
	// A typo is a 400 that lists the entries, even on a resume of a bound
	// session: only the 400 says what this broker has.
	if requested != "" && !g.hasBinary(requested) {
		// In cluster mode a peer that spawns it may take the claim.
		if slot == slotAcquire && g.rt != nil {
			if a, ok := g.rt.OfferClaim(r.Context(), p, body); ok {
				return g.peerClaimed(a)
			}
			if g.rt.PeerServes(requested) {
				return nil, refuse(http.StatusServiceUnavailable, "no_capacity", "no capacity: no broker that spawns binary %q has a free slot", requested)
			}
		}
		return nil, refuse(http.StatusBadRequest, "rejected", "unknown binary %q; this broker spawns: %s", requested, strings.Join(g.binaryNames(), ", "))
	}
	session := strings.TrimSpace(req.SessionID)
	if session != "" {
		if err := sessionid.Validate(session); err != nil {
			return nil, refuse(http.StatusBadRequest, "rejected", "invalid session_id: %v", err)
		}
	}
	if cerr := g.spawnerUnavailable(); cerr != nil {
		return nil, cerr
	}
	if g.draining.Load() {
		if slot == slotOffered {
			return nil, refuse(http.StatusServiceUnavailable, outcomeDeclined, "draining")
		}
		return nil, refuse(http.StatusServiceUnavailable, outcomeBrokerDraining, errBrokerDraining)
	}
	offerAway := slot == slotAcquire && g.rt != nil
	if offerAway && session != "" {
		a, routed, mine := g.rt.RouteResume(r.Context(), p, session, body)
		if routed {
			return g.peerClaimed(a)
		}
		offerAway = !mine
	}
	var away *queuedOffer
	if offerAway {
		// A warm instance here serves the claim, or yields it its slot.
		if g.cap.Full() && !g.pools.m.Holding() {
			if a, ok := g.rt.OfferClaim(r.Context(), p, body); ok {
				return g.peerClaimed(a)
			}
		}
		if g.rt.Offerable(body) {
			away = &queuedOffer{ctx: r.Context(), principal: p, body: body}
		}
	}
	entry, cerr := g.resumeEntry(r.Context(), p.ID, session, requested)
	if cerr != nil {
		return nil, cerr
	}
	l, cerr := g.spawnLease(r.Context(), p.ID, entry, []byte(req.Config), session, slot, away)
	if cerr == errServedAwayClaim {
		return away.resp, away.cerr
	}
	if cerr != nil {
		return nil, cerr
	}
	l.mu.Lock()
	session, sessionErr := l.sessionID, l.sessionErr
	pid := l.pid
	l.mu.Unlock()
	if session != "" {
		sessionErr = ""
	}
	resp := &ClaimAnswer{LeaseID: l.id, WSURL: g.wsURL(r, l.id), SessionID: session, SessionError: sessionErr, PID: pid, Binary: l.entry}
	if g.auth.Enabled() {
		tok, err := g.tickets.Mint(l.id, p)
		if err != nil {
			// No claim without its ticket: the lease goes, as a claim that
			// failed does.
			go l.teardown(reasonClaimAbandoned, teardownGraceful)
			return nil, refuse(ticketRefusal(err), "rejected", "%v", err)
		}
		resp.Ticket = tok
	}
	return resp, nil
}

// spawnLease admits principal, takes a slot, mints a lease, has spawnd
// spawn it (with -recall when session is set) and waits for ready and, for
// a new session, its id. A new session's claim naming a pool's entry and
// config is served by a warm instance instead (warm.go). ctx is the
// claimant: when it ends while queued or booting the claim is abandoned.
// It is POST /claim's spine and the A2A ingress's, so an A2A lease is
// admitted and counted like any other. away, when set, lets a peer serve
// the claim while it queues: then spawnLease answers errServedAwayClaim,
// and away holds the answer.
func (g *Gateway) spawnLease(ctx context.Context, principal, entry string, cfgData []byte, session string, slot slotMode, away *queuedOffer) (*lease, *claimError) {
	if !g.admitPrincipal(principal) {
		return nil, refuse(http.StatusTooManyRequests, "principal_lease_limit", "lease limit reached for this principal")
	}
	admitted := true
	defer func() {
		if admitted {
			g.unadmitPrincipal(principal)
		}
	}()
	if session == "" {
		if l, cerr, ok := g.handOut(ctx, principal, entry, cfgData, &admitted); ok {
			return l, cerr
		}
	}
	acquire := g.cap.Acquire
	if slot == slotOffered {
		acquire = g.cap.TryAcquire
	}
	quota := g.queueQuota(principal)
	quota.Offer = away
	err := g.takeSlot(ctx, acquire, quota)
	if err == nil && slot == slotOffered {
		accepted(ctx)
	}
	if err != nil {
		switch {
		case errors.Is(err, capacity.ErrServedAway):
			return nil, errServedAwayClaim
		case errors.Is(err, capacity.ErrDeclined):
			return nil, refuse(http.StatusServiceUnavailable, outcomeDeclined, "no capacity")
		case errors.Is(err, capacity.ErrNoCapacity):
			return nil, refuse(http.StatusServiceUnavailable, "no_capacity", "no capacity")
		case errors.Is(err, capacity.ErrQueueFull):
			return nil, refuse(http.StatusServiceUnavailable, "queue_full", "capacity queue full")
		case errors.Is(err, capacity.ErrQueueTimeout):
			return nil, refuse(http.StatusServiceUnavailable, "queue_timeout", "capacity wait timed out")
		case errors.Is(err, capacity.ErrPrincipalQueue):
			return nil, refuse(http.StatusTooManyRequests, "principal_queue_limit", "queued claim limit reached for this principal")
		}
		return nil, refuse(499, "cancelled", TextGoneWhileQueued)
	}
	// Checked again: the wait for a slot may have been long.
	if cerr := g.spawnerUnavailable(); cerr != nil {
		g.freeSlot()
		return nil, cerr
	}
	l, cerr := g.mintLease(principal, entry, session, "", &admitted)
	if cerr == nil {
		cerr = g.bootLease(ctx, l, spawner.SpawnRequest{Entry: entry, Config: cfgData, RecallSession: session, Principal: principal})
	}
	if cerr != nil {
		return nil, cerr
	}
	g.publish(EventClaimed, l, "")
	return l, nil
}

// mintLease books a new lease of principal on the slot the caller holds
// (a warm lease of pool when pool is set); a failure gives the slot back.
// admitted, when set, is principal's admission, which the lease replaces.
func (g *Gateway) mintLease(principal, entry, session, pool string, admitted *bool) (*lease, *claimError) {
	id, err := g.newLeaseID()
	if err != nil {
		g.freeSlot()
		return nil, refuse(http.StatusInternalServerError, "internal", "minting lease")
	}
	l := g.newLease(id, principal, entry, time.Now())
	l.sessionID = session
	l.warm.pool = pool
	g.mu.Lock()
	g.leases[id] = l
	if admitted != nil {
		g.unadmitLocked(principal) // the lease itself counts from here
		*admitted = false
	}
	g.mu.Unlock()
	return l, nil
}

// bootLease has spawnd spawn req as lease l and waits for ready and, for a
// new session, its id; a failure gives l's slot back.
func (g *Gateway) bootLease(ctx context.Context, l *lease, req spawner.SpawnRequest) *claimError {
	cfg := g.cfg.Load()
	id, entry, session := l.id, req.Entry, req.RecallSession

	// The spawn runs to completion even if the claimant hangs up meanwhile:
	// cancelling it half-way could leave a process spawnd started and
	// nobody tracks. A claimant gone by then is handled by awaitReady.
	spawnCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	req.LeaseID, req.ListenPort = id, g.listenPort
	g.awaitAhead(req.RecallSession) // spawnd sees the session's Record first (ahead.go)
	spawned, err := g.sp.Spawn(spawnCtx, req)
	cancel()
	l.prove(spawned.Verifier) // an instance may have dialled back already
	pid := spawned.Pid
	if spawner.CodeOf(err) == spawner.FailedPrecondition {
		// The session was bound to another entry after resumeEntry asked.
		g.removeLease(l)
		l.releaseSlot()
		return refuse(http.StatusConflict, "rejected", "session %q was bound to another binary while this claim was admitted; omit `binary` to inherit it, or start a new session", session)
	}
	if spawner.CodeOf(err) == spawner.ResourceExhausted {
		// spawnd's own bound (spawnd.max_leases, max_config_bytes), or
		// tenancy.uid_range spent.
		g.removeLease(l)
		l.releaseSlot()
		g.log.Warn("spawning instance refused: nexus-spawnd is at its own bound", "lease_id", id, "binary", entry, "error", spawner.MessageOf(err))
		if spawner.StepOf(err) == spawner.StepUID {
			return refuse(http.StatusServiceUnavailable, "no_capacity", "no uid left in tenancy.uid_range")
		}
		return refuse(http.StatusServiceUnavailable, "no_capacity", "no capacity")
	}
	if spawner.StepOf(err) == spawner.StepJournal {
		// Nothing runs: spawnd refused what its journal could not record
		// (its log names state_dir and why).
		g.removeLease(l)
		l.releaseSlot()
		g.log.Error("spawning instance refused: nexus-spawnd's lease journal cannot record the lease", "lease_id", id, "binary", entry, "error", spawner.MessageOf(err))
		cerr := refuse(http.StatusServiceUnavailable, "journal_unavailable", errJournalUnavailable)
		cerr.retryAfter = journalRetryAfter
		return cerr
	}
	if spawner.CodeOf(err) == spawner.Unavailable {
		// spawnd stopped answering under this call: it may not even have
		// read it.
		g.removeLease(l)
		l.releaseSlot()
		g.log.Error("spawning instance failed: nexus-spawnd is not answering", "lease_id", id, "binary", entry, "error", spawner.MessageOf(err))
		return refuse(http.StatusServiceUnavailable, "spawn_failed", errSpawnerUnavailable)
	}
	if err != nil {
		g.removeLease(l)
		l.releaseSlot()
		g.log.Error("spawning instance failed", "lease_id", id, "binary", entry, "error", spawner.MessageOf(err), "code", spawner.CodeOf(err))
		if spawner.StepOf(err) == spawner.StepTempConfig {
			// No process was involved: a broker-side fault, not a spawn
			// failure of the instance.
			return refuse(http.StatusInternalServerError, "internal", "writing temp config")
		}
		g.m.SpawnFailures.Inc("exec")
		cerr := refuse(http.StatusInternalServerError, "spawn_failed", "spawning instance")
		cerr.cause = spawner.MessageOf(err)
		return cerr
	}
	l.mu.Lock()
	l.pid = pid
	l.spawned = true
	l.mu.Unlock()
	g.log.Info("instance spawned", "lease_id", id, "binary", entry, "pid", pid, "session_id", session)

	if cerr := g.awaitReady(ctx, l, cfg); cerr != nil {
		return cerr
	}
	if session == "" {
		// A new session's id comes from the instance; the claim still
		// succeeds without it after session_report_grace.
		select {
		case <-l.sessionReported:
		case <-time.After(cfg.SessionReportGrace.D()):
			g.log.Warn("instance did not report a session id within grace window",
				"lease_id", id, "session_report_grace", cfg.SessionReportGrace.D())
		}
	}
	l.mu.Lock()
	if l.state == stateSpawning {
		l.state = stateActive
		l.lastActivity = time.Now()
		l.rearmLocked()
	}
	l.mu.Unlock()
	return nil
}

// resumeEntry picks the entry a claim spawns. A resume is reconciled against
// the entry spawnd recorded for the session: omitting binary inherits it, and
// naming another is a 409, as is a recorded entry this broker no longer
// offers. No record means no opinion: the claim gets what it asked for, or
// the reserved entry. The record is best-effort, so a spawnd that cannot be
// asked is no opinion too.
//
// With auth:, a resume is first held to the session's owner (owned.go).
func (g *Gateway) resumeEntry(ctx context.Context, principal, session, requested string) (string, *claimError) {
	recorded := ""
	if session != "" {
		ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		b, err := g.sp.Binding(ctx, session, principal)
		cancel()
		if cerr := g.checkOwner(principal, session, b, err); cerr != nil {
			return "", cerr
		}
		if err != nil {
			g.log.Warn("could not ask nexus-spawnd which binary created a session; resuming unchecked", "session_id", session, "error", err)
		} else {
			recorded = b.Entry
		}
	}
	switch {
	case recorded == "" && requested == "":
		return core.ReservedEntry, nil
	case recorded == "":
		return requested, nil
	case requested == "":
		if !g.hasBinary(recorded) {
			return "", refuse(http.StatusConflict, "rejected",
				"session %q was created by binary %q, which this broker no longer offers; restore that entry, or start a new session. This broker spawns: %s",
				session, recorded, strings.Join(g.binaryNames(), ", "))
		}
		return recorded, nil
	case requested != recorded:
		return "", refuse(http.StatusConflict, "rejected",
			"session %q was created by binary %q but this claim requests %q; resume it with %q, or omit `binary` to inherit it, or start a new session",
			session, recorded, requested, recorded)
	}
	return requested, nil
}

// awaitReady waits for the instance's ready signal, its exit, ready_timeout,
// or the claimant leaving, whichever is first.
func (g *Gateway) awaitReady(ctx context.Context, l *lease, cfg *config.Config) *claimError {
	timer := time.NewTimer(cfg.ReadyTimeout.D())
	defer timer.Stop()
	select {
	case <-l.ready:
		return nil
	case <-l.exited:
		select {
		case <-l.ready: // it said ready, then died: let the client see the crash
			return nil
		default:
		}
		g.m.SpawnFailures.Inc("exited_before_ready")
		l.mu.Lock()
		ev := l.exit
		l.mu.Unlock()
		// The tail comes escaped from spawnd, and is quoted here again: an
		// instance cannot write a log line of its own into ours.
		g.log.Error("instance exited before signalling ready", "lease_id", l.id, "exit_code", ev.ExitCode, "signal", ev.Signal,
			"log", ev.LogPath, "output_tail", ev.OutputTail)
		cerr := refuse(http.StatusBadGateway, "spawn_failed", "instance exited before signalling ready")
		cerr.cause = exitError(ev)
		return cerr
	case <-timer.C:
		g.m.SpawnFailures.Inc("ready_timeout")
		go l.teardown(reasonReadyTimeout, teardownSkipGrace)
		return refuse(http.StatusGatewayTimeout, "ready_timeout", "instance did not become ready in time")
	case <-ctx.Done():
		reason := reasonClaimAbandoned
		var ended warmEnded // a warm lease's boot, ended for a claim
		if errors.As(context.Cause(ctx), &ended) {
			reason = string(ended)
		}
		go l.teardown(reason, teardownSkipGrace)
		return refuse(499, "cancelled", "client went away while the instance was booting")
	}
}

// wsURL is where the client connects: this broker's origin, else the Host
// the claim arrived on (a guess, and wrong behind a proxy: hence the boot
// WARN for that shape).
func (g *Gateway) wsURL(r *http.Request, id string) string {
	o := g.origin("ws", "wss")
	if o == "" {
		o = "ws://" + r.Host
	}
	return o + "/lease/" + id
}

// origin is where clients reach this broker, by precedence: advertise_addr
// (its scheme mapped to plain or secure), else an explicit host in
// listen_addr with the port the listener bound (listen_addr may ask for
// port 0), else "" for a wildcard bind.
func (g *Gateway) origin(plain, secure string) string {
	a := strings.TrimSuffix(strings.TrimSpace(g.boot.AdvertiseAddr), "/")
	if a == "" {
		host := g.boot.ListenHost()
		if host == "" {
			return ""
		}
		if g.listenPort == 0 { // not listening (a unit test's gateway)
			return plain + "://" + g.boot.ListenAddr
		}
		return plain + "://" + net.JoinHostPort(host, strconv.Itoa(int(g.listenPort)))
	}
	scheme, hostport, ok := strings.Cut(a, "://")
	if !ok {
		return plain + "://" + a
	}
	if scheme == "https" || scheme == "wss" {
		return secure + "://" + hostport
	}
	return plain + "://" + hostport
}

func (g *Gateway) hasBinary(name string) bool {
	for _, b := range *g.binaries.Load() {
		if b.Name == name {
			return true
		}
	}
	return false
}

func (g *Gateway) binaryNames() []string {
	bs := *g.binaries.Load()
	names := make([]string, len(bs))
	for i, b := range bs {
		names[i] = b.Name
	}
	return names
}

// record asks spawnd to record a session id an instance reported, and says
// whether the lease may carry it, and why not when spawnd refused it.
// spawnd refuses an id another entry's session holds (a session belongs to
// the entry that created it); a spawnd that cannot be asked is logged and
// the id kept, since the record is best-effort.
func (g *Gateway) record(id, session string) (keep bool, refused string) {
	ctx, cancel := context.WithTimeout(g.ctx, 10*time.Second)
	defer cancel()
	err := g.sp.Record(ctx, id, session, "")
	switch spawner.CodeOf(err) {
	case spawner.OK:
		return true, ""
	case spawner.NotFound:
		return false, "" // the lease is gone; nothing carries the id
	case spawner.InvalidArgument, spawner.FailedPrecondition, spawner.ResourceExhausted:
		g.log.Warn("instance's session-id report refused by nexus-spawnd; the lease keeps running with the session id it had",
			"lease_id", id, "error", spawner.MessageOf(err))
		return false, spawner.MessageOf(err)
	}
	g.log.Warn("recording a lease's session id with nexus-spawnd failed", "lease_id", id, "error", err)
	return true, ""
}
