package echo

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// The environment variables nexus-echo reads at start. Tests pass them through
// a registry entry's env; a stock nexus build has none of them.
const (
	EnvExitBeforeReady = "NEXUS_ECHO_EXIT_BEFORE_READY"
	EnvCrash           = "NEXUS_ECHO_CRASH"
	EnvSlowTurn        = "NEXUS_ECHO_SLOW_TURN"
	EnvIgnoreShutdown  = "NEXUS_ECHO_IGNORE_SHUTDOWN"
	EnvExitOnShutdown  = "NEXUS_ECHO_EXIT_ON_SHUTDOWN"
	EnvNoSecret        = "NEXUS_ECHO_NO_SECRET"
	EnvWrongSecret     = "NEXUS_ECHO_WRONG_SECRET"
	EnvFrameVersion    = "NEXUS_ECHO_FRAME_VERSION"
	EnvBootDelay       = "NEXUS_ECHO_BOOT_DELAY"
	EnvNoSessionReport = "NEXUS_ECHO_NO_SESSION_REPORT"
	EnvPingInterval    = "NEXUS_ECHO_PING_INTERVAL"
	EnvPeerTimeout     = "NEXUS_ECHO_PEER_TIMEOUT"
	// EnvReportSessionFrom names a file whose bytes, read at start, are
	// reported as the session id instead of the instance's own.
	EnvReportSessionFrom = "NEXUS_ECHO_REPORT_SESSION_FROM"
	// EnvReportFlood, <count>x<bytes>, follows the handshake's report with
	// count more, each a distinct id of that many bytes.
	EnvReportFlood = "NEXUS_ECHO_REPORT_FLOOD"
	// EnvAllowRun enables the /run command, which runs what a client
	// types: for containment tests only, never for a deployed entry.
	EnvAllowRun = "NEXUS_ECHO_ALLOW_RUN"
	// EnvIgnoreShutdownFrame ignores the broker's shutdown frame but not
	// SIGTERM, so a test sees release's signal reach the instance.
	EnvIgnoreShutdownFrame = "NEXUS_ECHO_IGNORE_SHUTDOWN_FRAME"
	// EnvStopDelay holds the orderly stop on SIGTERM or SIGINT back this
	// long, as an engine flushing its session would, and then logs that it
	// passed: a test sees whether the instance had that time.
	EnvStopDelay = "NEXUS_ECHO_STOP_DELAY"
	// EnvSessionReportDelay holds the first connection's session-id report
	// back this long after ready, as an engine that creates its session
	// lazily would; redials report it in the handshake as usual.
	EnvSessionReportDelay = "NEXUS_ECHO_SESSION_REPORT_DELAY"
	// EnvWorkState is the status state a turn reports when it starts, in
	// place of thinking: any string, so a test can report each state of
	// the manual's turn-liveness table, or one it does not list.
	EnvWorkState = "NEXUS_ECHO_WORK_STATE"
	// EnvOmitLeaseID sends io frames without lease_id, which a broker
	// forwards as the socket's lease (the frame envelope allows it).
	EnvOmitLeaseID = "NEXUS_ECHO_OMIT_LEASE_ID"
	// EnvStockStatus sends status payloads without turn_id, as the stock
	// broker plugin does (its other payloads name their turn).
	EnvStockStatus = "NEXUS_ECHO_STOCK_STATUS"
)

// The values EnvCrash accepts.
const (
	CrashMidTurn     = "mid-turn"
	CrashAfterAnswer = "after-answer"
)

// Liveness defaults, the upstream plugin's cadence: the broker must miss three
// pings in a row before the socket is declared dead, so one GC pause or slow
// moment never costs a reconnect.
const (
	defaultPingInterval = 15 * time.Second
	defaultPeerTimeout  = 45 * time.Second
)

// knobs are the fault-injection and timing settings, fixed at start.
type knobs struct {
	ExitBeforeReady     bool          // exit 3 right after the register frame
	Crash               string        // "", CrashMidTurn or CrashAfterAnswer
	SlowTurn            time.Duration // wait before each stream.delta
	IgnoreShutdown      bool          // ignore shutdown frames and SIGTERM
	IgnoreShutdownFrame bool          // ignore shutdown frames only: SIGTERM still stops it
	StopDelay           time.Duration // EnvStopDelay
	ExitOnShutdown      bool          // exit 0 the moment a shutdown frame arrives
	NoSecret            bool          // register without a secret
	WrongSecret         bool          // register with a secret that cannot match
	RegisterVersion     int           // version stamped on register frames
	BootDelay           time.Duration // wait before the first dial
	NoSessionReport     bool          // never send session-id-report
	ReportDelay         time.Duration // EnvSessionReportDelay
	AllowRun            bool          // serve /run <argv…>
	PingInterval        time.Duration
	PeerTimeout         time.Duration
	ReportSession       string // path of EnvReportSessionFrom's file; "" reports the real id
	FloodReports        int    // extra session-id reports after the handshake
	FloodBytes          int    // the size of each
	WorkState           string // EnvWorkState; "" reports thinking
	OmitLeaseID         bool   // io frames carry no lease_id
	StockStatus         bool   // status payloads carry no turn_id
}

// loadKnobs reads the knobs through getenv (os.Getenv in production). An unset
// or empty variable leaves its default; a value that does not parse is an
// error naming the variable.
func loadKnobs(getenv func(string) string) (knobs, error) {
	k := knobs{
		RegisterVersion: brokerframe.Version,
		PingInterval:    defaultPingInterval,
		PeerTimeout:     defaultPeerTimeout,
	}
	bools := []struct {
		name string
		dst  *bool
	}{
		{EnvExitBeforeReady, &k.ExitBeforeReady},
		{EnvIgnoreShutdown, &k.IgnoreShutdown},
		{EnvIgnoreShutdownFrame, &k.IgnoreShutdownFrame},
		{EnvExitOnShutdown, &k.ExitOnShutdown},
		{EnvNoSecret, &k.NoSecret},
		{EnvWrongSecret, &k.WrongSecret},
		{EnvNoSessionReport, &k.NoSessionReport},
		{EnvAllowRun, &k.AllowRun},
		{EnvOmitLeaseID, &k.OmitLeaseID},
		{EnvStockStatus, &k.StockStatus},
	}
	for _, b := range bools {
		v := getenv(b.name)
		if v == "" {
			continue
		}
		on, err := strconv.ParseBool(v)
		if err != nil {
			return knobs{}, fmt.Errorf("%s=%q: want 1 or 0", b.name, v)
		}
		*b.dst = on
	}
	durations := []struct {
		name     string
		dst      *time.Duration
		positive bool // zero would mean "never" or a busy loop
	}{
		{EnvSlowTurn, &k.SlowTurn, false},
		{EnvBootDelay, &k.BootDelay, false},
		{EnvStopDelay, &k.StopDelay, false},
		{EnvSessionReportDelay, &k.ReportDelay, false},
		{EnvPingInterval, &k.PingInterval, true},
		{EnvPeerTimeout, &k.PeerTimeout, true},
	}
	for _, d := range durations {
		v := getenv(d.name)
		if v == "" {
			continue
		}
		dur, err := time.ParseDuration(v)
		if err != nil || dur < 0 || (d.positive && dur == 0) {
			return knobs{}, fmt.Errorf("%s=%q: want a Go duration such as 250ms or 2s", d.name, v)
		}
		*d.dst = dur
	}
	switch v := getenv(EnvCrash); v {
	case "", CrashMidTurn, CrashAfterAnswer:
		k.Crash = v
	default:
		return knobs{}, fmt.Errorf("%s=%q: want %q or %q", EnvCrash, v, CrashMidTurn, CrashAfterAnswer)
	}
	k.ReportSession = getenv(EnvReportSessionFrom)
	k.WorkState = getenv(EnvWorkState)
	if v := getenv(EnvReportFlood); v != "" {
		n, size, _ := strings.Cut(v, "x")
		var err1, err2 error
		k.FloodReports, err1 = strconv.Atoi(n)
		k.FloodBytes, err2 = strconv.Atoi(size)
		if err1 != nil || err2 != nil || k.FloodReports < 0 || k.FloodBytes < 1 {
			return knobs{}, fmt.Errorf("%s=%q: want <count>x<bytes>, such as 20x3800000", EnvReportFlood, v)
		}
	}
	if v := getenv(EnvFrameVersion); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			return knobs{}, fmt.Errorf("%s=%q: want an integer frame version", EnvFrameVersion, v)
		}
		k.RegisterVersion = n
	}
	return k, nil
}
