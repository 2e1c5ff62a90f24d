package brokerd

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/config"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc"
)

// ControlSocket is where a running broker takes an operator's verbs
// (nexus-broker -drain, -undrain) when control_socket is not set: in the
// run directory. Mode 0600, and each connection's peer checked by
// SO_PEERCRED. There is no HTTP route for them: the spec's admin scope
// grants visibility only.
const ControlSocket = "control.sock"

// controlPath is the control socket of the broker running with cfg, read
// from path: control_socket, else ControlSocket in the run directory.
func controlPath(cfg *config.Config, path string) string {
	if cfg.ControlSocket != "" {
		return cfg.ControlSocket
	}
	return filepath.Join(spawnrpc.RunDir(cfg.Spawnd.RunDir, path), ControlSocket)
}

// Control verbs and their answers: one line each way.
const (
	VerbDrain   = "drain"
	VerbUndrain = "undrain"
	answerOK    = "ok "
	answerError = "error "
	// controlWait bounds one control exchange on either side.
	controlWait = 5 * time.Second
	// maxVerb bounds the line a control connection may send.
	maxVerb = 64
)

// controlVerbs is the whole surface of the control socket: each verb and
// what it does, returning the broker's state after it.
func controlVerbs(drain func(bool)) map[string]func() string {
	return map[string]func() string{
		VerbDrain:   func() string { drain(true); return "draining: no new claims or offers; the leases keep working" },
		VerbUndrain: func() string { drain(false); return "serving: claims and offers are taken again" },
	}
}

// serveControl opens the control socket at path and answers its verbs
// until the listener is closed. Only this process's uid (or root) gets an
// answer.
func serveControl(path string, drain func(bool), log *slog.Logger) (io.Closer, error) {
	ln, err := listenSocket(path, "control_socket", -1, 0o600)
	if err != nil {
		return nil, err
	}
	log.Info("control socket listening", "control_socket", path, "mode", "0600")
	verbs := controlVerbs(drain)
	go func() {
		for {
			c, err := ln.AcceptUnix()
			if err != nil {
				return // closed
			}
			go answerControl(c, verbs, log)
		}
	}()
	return closer(func() error { err := ln.Close(); _ = os.Remove(path); return err }), nil
}

type closer func() error

func (c closer) Close() error { return c() }

// answerControl answers one connection: its peer's uid first, then one
// verb.
func answerControl(c *net.UnixConn, verbs map[string]func() string, log *slog.Logger) {
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(controlWait))
	pc, err := spawnrpc.ReadPeerCred(c)
	if err != nil {
		log.Warn("control socket: refused a connection: cannot read its peer credentials", "error", err)
		return
	}
	if pc.UID != os.Geteuid() && pc.UID != 0 {
		log.Warn("control socket: refused a connection of another user", "peer_uid", pc.UID, "peer_pid", pc.PID, "allowed_uid", os.Geteuid())
		fmt.Fprintf(c, "%suid %d may not control this broker: only uid %d (the broker's) or root may\n", answerError, pc.UID, os.Geteuid())
		return
	}
	line, err := bufio.NewReader(io.LimitReader(c, maxVerb)).ReadString('\n')
	if err != nil {
		return
	}
	verb := strings.TrimSpace(line)
	do, ok := verbs[verb]
	if !ok {
		fmt.Fprintf(c, "%sunknown verb %q; this broker takes %s or %s\n", answerError, verb, VerbDrain, VerbUndrain)
		return
	}
	state := do()
	log.Info("control socket: verb done", "verb", verb, "peer_uid", pc.UID, "peer_pid", pc.PID)
	fmt.Fprintf(c, "%s%s\n", answerOK, state)
}

// Control is nexus-broker -drain / -undrain: send verb to the broker
// running with o's config, through its control socket, and print its
// answer.
func Control(o Options, verb string) error {
	path, _, cfg, err := loadConfig(o)
	if err != nil {
		return err
	}
	sock := controlPath(cfg, path)
	c, err := net.DialTimeout("unix", sock, controlWait)
	if err != nil {
		return fmt.Errorf("-%s: no broker answers on its control socket %s (is one running with -config %s, as this user or root?): %w", verb, sock, path, err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(controlWait))
	if _, err := fmt.Fprintf(c, "%s\n", verb); err != nil {
		return fmt.Errorf("-%s: %w", verb, err)
	}
	answer, err := bufio.NewReader(io.LimitReader(c, 4096)).ReadString('\n')
	if err != nil && answer == "" {
		return fmt.Errorf("-%s: the broker closed its control socket %s without an answer: %w", verb, sock, err)
	}
	answer = strings.TrimSpace(answer)
	if rest, ok := strings.CutPrefix(answer, strings.TrimSpace(answerError)); ok {
		return errors.New("-" + verb + ": the broker refused: " + strings.TrimSpace(rest))
	}
	fmt.Fprintf(os.Stdout, "%s (%s)\n", strings.TrimPrefix(answer, answerOK), path)
	return nil
}
