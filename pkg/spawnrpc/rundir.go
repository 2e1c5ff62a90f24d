package spawnrpc

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/nexus-broker/nexus-broker/internal/atomicfile"
	"github.com/nexus-broker/nexus-broker/internal/safedir"
)

// Files in the run directory.
const (
	// EndpointFile holds the reattach config of the serving spawnd.
	EndpointFile = "spawnd.json"
	// ServeLockFile is flocked by the serving spawnd for its whole life: a
	// second spawnd on the same run directory is refused, and a launcher
	// can tell "starting or stopping" from "gone" without signalling a pid.
	ServeLockFile = "spawnd.lock"
	// socketPrefix is how go-plugin names its sockets (os.CreateTemp
	// pattern "plugin").
	socketPrefix = "plugin"
)

// runDirBase holds the default run directories, one per config file:
// $XDG_RUNTIME_DIR/nexus-broker, else /tmp/nexus-broker-<uid>. The uid is the
// caller's, so a gateway and a spawnd running as different users must set
// spawnd.run_dir explicitly.
func runDirBase() string {
	if x := os.Getenv("XDG_RUNTIME_DIR"); x != "" {
		return filepath.Join(x, "nexus-broker")
	}
	return filepath.Join("/tmp", "nexus-broker-"+strconv.Itoa(os.Getuid()))
}

// configKeyLen is how many hex digits of the config path's SHA-256 name its
// default run directory: short, for the unix socket limit.
const configKeyLen = 12

// RunDir is runDir (spawnd.run_dir), or, when that is empty, the default
// run directory of the config file at configPath (its canonical absolute
// path, core.Canonical): one per config file, so two brokers on one host
// never share a spawnd by accident. It is keyed by the path, not the
// content, so editing the file does not strand the spawnd already running
// for it. Both processes resolve it with this function so they agree.
func RunDir(runDir, configPath string) string {
	if runDir != "" {
		return runDir
	}
	sum := sha256.Sum256([]byte(configPath))
	return filepath.Join(runDirBase(), hex.EncodeToString(sum[:])[:configKeyLen])
}

// maxSocketPath is the longest path a unix socket can bind: sun_path holds
// 108 bytes, one of them the terminating NUL.
const maxSocketPath = 107

// socketNameLen is the longest go-plugin socket name: "plugin" and a
// random uint32 in decimal (os.CreateTemp).
const socketNameLen = len(socketPrefix) + 10

// CheckSocketPath refuses a run directory whose socket path could exceed
// the unix limit, which bind would otherwise report as "invalid argument".
func CheckSocketPath(runDir string) error {
	abs, err := filepath.Abs(runDir)
	if err != nil {
		return err
	}
	if n := len(abs) + 1 + socketNameLen; n > maxSocketPath {
		return fmt.Errorf("run directory %s is too long for a unix socket: the socket path %s would be %d bytes, over the limit of %d; "+
			"set spawnd.run_dir to a directory of at most %d bytes", abs, filepath.Join(abs, socketPrefix+"NNNNNNNNNN"), n, maxSocketPath, maxSocketPath-1-socketNameLen)
	}
	return nil
}

// Endpoint is the content of spawnd.json: go-plugin's reattach config in a
// stable JSON shape, written by spawnd once it accepts connections.
type Endpoint struct {
	Protocol        string `json:"protocol"`         // "grpc"
	ProtocolVersion int    `json:"protocol_version"` // ProtocolVersion
	Network         string `json:"network"`          // "unix"
	Addr            string `json:"addr"`             // socket path
	Pid             int    `json:"pid"`              // spawnd's pid
}

// ReadEndpoint reads runDir/spawnd.json. A missing file is an error
// satisfying errors.Is(err, fs.ErrNotExist).
func ReadEndpoint(runDir string) (Endpoint, error) {
	path := filepath.Join(runDir, EndpointFile)
	data, err := os.ReadFile(path)
	if err != nil {
		return Endpoint{}, err
	}
	var ep Endpoint
	if err := json.Unmarshal(data, &ep); err != nil {
		return Endpoint{}, fmt.Errorf("%s: %w", path, err)
	}
	if ep.Pid <= 0 || ep.Addr == "" || ep.Network == "" {
		return Endpoint{}, fmt.Errorf("%s: incomplete (pid %d, network %q, addr %q)", path, ep.Pid, ep.Network, ep.Addr)
	}
	return ep, nil
}

// writeEndpoint publishes ep atomically: a reader sees the old file or the
// new one, never a torn write, and the rename is durable before we return.
// It is readable by the gateway's group, which is all the gateway needs.
func writeEndpoint(runDir string, ep Endpoint, gid int) error {
	data, err := json.Marshal(ep)
	if err != nil {
		return err
	}
	return atomicfile.Write(filepath.Join(runDir, EndpointFile), append(data, '\n'), func(f *os.File) error {
		if err := f.Chmod(0o640); err != nil {
			return err
		}
		if gid >= 0 {
			return f.Chown(-1, gid)
		}
		return nil
	})
}

// removeEndpointIfOurs removes spawnd.json when it still names pid; a file
// naming another pid belongs to whoever wrote it.
func removeEndpointIfOurs(runDir string, pid int) error {
	ep, err := ReadEndpoint(runDir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err == nil && ep.Pid != pid {
		return nil
	}
	// Ours, or unreadable garbage that nobody can attach with anyway.
	if err := os.Remove(filepath.Join(runDir, EndpointFile)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return atomicfile.SyncDir(runDir)
}

// PrepareRunDir creates runDir 0750 (group gid when gid >= 0), or checks
// the one that is there. A run directory somebody else owns (say a
// squatter's /tmp/nexus-broker-0) would let them swap the socket under the
// gateway, so it is refused rather than adopted; so is a default run
// directory whose private parent is not this user's alone.
func PrepareRunDir(runDir string, gid int) error {
	if err := CheckSocketPath(runDir); err != nil {
		return err
	}
	if filepath.Dir(filepath.Clean(runDir)) == runDirBase() {
		if err := safedir.Ensure(runDirBase(), 0o700); err != nil {
			return fmt.Errorf("run directory base: %w", err)
		}
	}
	if _, err := safedir.Private(runDir, 0o750); err != nil {
		return fmt.Errorf("run directory: %w; or set spawnd.run_dir", err)
	}
	if gid >= 0 {
		if err := os.Chown(runDir, -1, gid); err != nil {
			return fmt.Errorf("give run directory %s to group %d (spawnd.socket_gid): %w", runDir, gid, err)
		}
	}
	return nil
}

// removeStaleSockets deletes go-plugin sockets left behind by a spawnd that
// died without closing its listener (kill -9), and spawnd.json temp files.
// Only the holder of the serve lock may call it: everything it finds is
// then a dead spawnd's.
func removeStaleSockets(runDir string) {
	ents, err := os.ReadDir(runDir)
	if err != nil {
		return
	}
	for _, e := range ents {
		socket := strings.HasPrefix(e.Name(), socketPrefix) && e.Type()&fs.ModeSocket != 0
		// A temp file of writeEndpoint that a crash left behind.
		temp := strings.HasPrefix(e.Name(), "."+EndpointFile+".") && e.Type().IsRegular()
		if socket || temp {
			_ = os.Remove(filepath.Join(runDir, e.Name()))
		}
	}
}
