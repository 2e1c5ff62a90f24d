// Package echo is the engine of nexus-echo, the reference nexus instance the
// broker spawns by default and every test and benchmark talks to.
//
// It plays both halves of a stock nexus build: the nexus.io.broker dial-back
// client (register → ready → session-id-report on every connect, redial with
// backoff, a bounded outbound buffer, pings) and a deterministic fake agent
// that streams "echo #n: …" answers between status frames, keeps a transcript
// under $HOME/.nexus/sessions/<id>/ that -recall reloads, asks hitl questions,
// honours cancel, and echoes any other payload verbatim. Fault knobs in the
// environment (see the Env constants) make it misbehave on purpose so the
// broker's failure paths can be tested against a real process.
//
// It is an instance, not the broker: of the project it imports only
// pkg/brokerframe, pkg/dialenv and internal/logbound, nothing of the
// gateway or of spawnd.
package echo

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/logbound"
	"github.com/nexus-broker/nexus-broker/pkg/dialenv"
)

// Process exit codes. The broker only tells zero from non-zero; tests tell
// the knobs apart by these.
const (
	ExitOK               = 0
	ExitFailure          = 1 // a runtime failure, including an unknown -recall session
	ExitUsage            = 2 // bad flags, an unreadable -config, a knob that does not parse
	ExitBeforeReady      = 3 // NEXUS_ECHO_EXIT_BEFORE_READY
	ExitCrashMidTurn     = 4 // NEXUS_ECHO_CRASH=mid-turn
	ExitCrashAfterAnswer = 5 // NEXUS_ECHO_CRASH=after-answer
)

// Options are what the command line carries.
type Options struct {
	ConfigPath string   // required; must be readable, content ignored
	Recall     string   // session to resume; empty starts a new one
	Args       []string // positional arguments, ignored as stock nexus ignores them
	Logger     *slog.Logger
}

// errStop is the cancel cause of an orderly stop (shutdown frame or signal);
// any other cause is a failure.
var errStop = errors.New("stop requested")

// Run runs the instance until the broker shuts it down or a signal arrives,
// and returns the process exit code. The knobs and the broker coordinates
// come from the process environment.
func Run(opts Options) int {
	log := opts.Logger
	k, err := loadKnobs(os.Getenv)
	if err != nil {
		log.Error("invalid fault knob", "error", err)
		return ExitUsage
	}
	if _, err := os.ReadFile(opts.ConfigPath); err != nil {
		log.Error("cannot read -config; pass a readable file", "config", opts.ConfigPath, "error", err)
		return ExitUsage
	}
	if len(opts.Args) > 0 {
		log.Info("ignoring positional arguments", "args", opts.Args)
	}
	for _, name := range []string{dialenv.BrokerAddr, dialenv.LeaseID, "HOME"} {
		if os.Getenv(name) == "" {
			log.Error("environment variable not set; nexus-echo must be started by nexus-broker's spawn daemon", "variable", name)
			return ExitFailure
		}
	}
	addr, leaseID, secret := os.Getenv(dialenv.BrokerAddr), os.Getenv(dialenv.LeaseID), os.Getenv(dialenv.SpawnSecret)

	var sess *session
	if opts.Recall != "" {
		sess, err = recallSession(os.Getenv("HOME"), opts.Recall, log)
	} else {
		sess, err = newSession(os.Getenv("HOME"))
	}
	if err != nil {
		log.Error("cannot open session", "session_id", opts.Recall, "error", err)
		return ExitFailure
	}
	defer sess.close()
	log = log.With("lease_id", leaseID, "session_id", sess.id)
	log.Info("starting", "broker_addr", addr, "recalled", opts.Recall != "", "turns", sess.turns,
		"spawn_secret_present", secret != "")

	reported := sess.id
	if k.ReportSession != "" {
		data, err := os.ReadFile(k.ReportSession)
		if err != nil {
			log.Error("cannot read the session id to report", "knob", EnvReportSessionFrom, "error", err)
			return ExitFailure
		}
		reported = string(data)
		log.Warn("reporting a session id that is not this instance's", "knob", EnvReportSessionFrom, "bytes", len(reported))
	}

	ctx, stop := context.WithCancelCause(context.Background())
	defer stop(errStop)
	go watchSignals(ctx, stop, k, log)

	if k.BootDelay > 0 {
		log.Info("delaying boot", "knob", EnvBootDelay, "delay", k.BootDelay)
		t := time.NewTimer(k.BootDelay)
		select {
		case <-ctx.Done():
		case <-t.C:
		}
		t.Stop()
	}

	out := newOutbox(outboxLimit)
	send := &sender{leaseID: leaseID, out: out, log: log}
	if k.OmitLeaseID {
		send.leaseID = ""
	}
	echoes := newEchoes(send, ctx.Done())
	ag := newAgent(sess, send, echoes, k, log, stop)
	var workers sync.WaitGroup
	workers.Go(func() { echoes.run(ctx) })
	workers.Go(func() { ag.run(ctx) })
	l := &link{
		addr: addr, leaseID: leaseID, secret: secret, sessionID: reported,
		knobs: k, out: out, log: log, quiet: logbound.New(log, logbound.Window),
		onIO:       ag.handle,
		onShutdown: func() { stop(errStop) },
	}
	l.reportDue.Store(!k.NoSessionReport && k.ReportDelay == 0)
	ag.drop = l.drop // before l.run: no input can reach the agent earlier
	// The link's graceful close flushes whatever the agent sent before the
	// stop; the agent then finishes before the transcript is closed.
	l.run(ctx)
	workers.Wait()

	if cause := context.Cause(ctx); !errors.Is(cause, errStop) {
		log.Error("stopping after a failure", "error", cause)
		return ExitFailure
	}
	log.Info("stopped")
	return ExitOK
}

// watchSignals turns SIGTERM and SIGINT into an orderly stop. After the first
// one the default handling is restored, so a second ^C kills at once. The
// ignore-shutdown knob makes SIGTERM a no-op so the broker's SIGKILL
// escalation can be observed; the stop-delay knob holds the stop back, so a
// test can see whether the instance had that time before a SIGKILL.
func watchSignals(ctx context.Context, stop context.CancelCauseFunc, k knobs, log *slog.Logger) {
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	defer signal.Stop(sigs)
	for {
		select {
		case <-ctx.Done():
			return
		case s := <-sigs:
			if s == syscall.SIGTERM && k.IgnoreShutdown {
				log.Warn("ignoring SIGTERM", "knob", EnvIgnoreShutdown)
				continue
			}
			log.Info("stopping on signal", "signal", s.String())
			if k.StopDelay > 0 {
				time.Sleep(k.StopDelay)
				log.Info("stop delay passed", "knob", EnvStopDelay, "delay", k.StopDelay.String())
			}
			stop(fmt.Errorf("%w: %s", errStop, s))
			return
		}
	}
}
