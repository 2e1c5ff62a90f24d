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
	// ServeLockFile is flocked by the serving spawnd for its life: a second
	// one is refused, and a launcher tells "starting or stopping" from
	// "gone" without signalling a pid.
	ServeLockFile = "spawnd.lock"
	// ReleasesDir holds the releases the gateway hands over while spawnd
	// does not answer, one empty file per lease id (spawnd.TakeReleases);
	// it belongs to spawnd.gateway_uid.
	ReleasesDir = "releases"
	// socketPrefix is go-plugin's os.CreateTemp pattern for its sockets.
	socketPrefix = "plugin"
)

// runDirBase holds the default run directories: $XDG_RUNTIME_DIR/nexus-broker,
// else /tmp/nexus-broker-<uid> (the caller's uid: a gateway and a spawnd of
// different users set spawnd.run_dir).
func runDirBase() string {
	if x := os.Getenv("XDG_RUNTIME_DIR"); x != "" {
		return filepath.Join(x, "nexus-broker")
	}
	return filepath.Join("/tmp", "nexus-broker-"+strconv.Itoa(os.Getuid()))
}

// configKeyLen is how many hex digits of the config path's SHA-256 name its
// default run directory (short, for the socket path limit).
const configKeyLen = 12

// RunDir is runDir (spawnd.run_dir), else the default run directory of the
// config file at configPath (canonical, core.Canonical): one per file, so two
// brokers on a host never share a spawnd by accident, keyed by path, not
// content, so an edit strands no running spawnd. Both processes use it.
func RunDir(runDir, configPath string) string {
	if runDir != "" {
		return runDir
	}
	sum := sha256.Sum256([]byte(configPath))
	return filepath.Join(runDirBase(), hex.EncodeToString(sum[:])[:configKeyLen])
}

const (
	// maxSocketPath is sun_path's 108 bytes less the terminating NUL.
	maxSocketPath = 107
	// socketNameLen is the longest go-plugin socket name: "plugin" and a
	// random uint32 in decimal.
	socketNameLen = len(socketPrefix) + 10
)

// CheckSocketPath refuses a run directory whose socket path could exceed
// the limit, which bind reports as "invalid argument".
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

// Endpoint is spawnd.json: go-plugin's reattach config in a stable shape.
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

// writeEndpoint publishes ep atomically and durably, readable by the
// gateway's group.
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
// the one that is there. One somebody else owns (a squatter's
// /tmp/nexus-broker-0) would let them swap the socket, so it is refused, as
// is a default run directory whose parent is not this user's alone.
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

// removeStaleSockets deletes the sockets and spawnd.json temp files of a
// spawnd killed with -9. Only the serve lock's holder may call it.
func removeStaleSockets(runDir string) {
	ents, err := os.ReadDir(runDir)
	if err != nil {
		return
	}
	for _, e := range ents {
		socket := strings.HasPrefix(e.Name(), socketPrefix) && e.Type()&fs.ModeSocket != 0
		temp := strings.HasPrefix(e.Name(), "."+EndpointFile+".") && e.Type().IsRegular()
		if socket || temp {
			_ = os.Remove(filepath.Join(runDir, e.Name()))
		}
	}
}
