package spawnd

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/nexus-broker/nexus-broker/internal/atomicfile"
	"github.com/nexus-broker/nexus-broker/internal/safedir"
	"github.com/nexus-broker/nexus-broker/internal/spawnproof"
)

// spawnKeySize is the spawn-key's length: HMAC-SHA256 gains nothing from a
// longer key.
const spawnKeySize = 32

// secretFor is a lease's spawn secret, hex(HMAC-SHA256(spawn-key, lease id)):
// derived, so a restarted nexus-spawnd recomputes what a surviving instance
// holds, and never written down.
func secretFor(key []byte, leaseID string) string {
	mac := hmac.New(sha256.New, key)
	mac.Write([]byte(leaseID))
	return hex.EncodeToString(mac.Sum(nil))
}

// verifierFor is the one-way verifier of a lease's spawn secret
// (spawnproof), which Spawn and List hand the gateway: it checks register
// frames with it, and cannot make a secret from it. Derived, as the secret
// is, so it is never journaled either.
func verifierFor(key []byte, leaseID string) []byte {
	return spawnproof.Of(secretFor(key, leaseID))
}

// loadSpawnKey returns <stateDir>/spawn-key, creating it on first boot (in
// memory only without a state_dir). A key of the wrong size, not spawnd's
// own, or readable by others refuses the boot: regenerating it would strand
// every running instance, and a key someone else wrote or can read lets
// them forge any live lease's dial-back.
func loadSpawnKey(stateDir string) ([]byte, error) {
	if stateDir == "" {
		return randomBytes(spawnKeySize)
	}
	path := filepath.Join(stateDir, "spawn-key")
	key, err := safedir.ReadOwned(path)
	if errors.Is(err, fs.ErrNotExist) {
		key, err := randomBytes(spawnKeySize)
		if err != nil {
			return nil, err
		}
		return key, atomicfile.Write(path, key, nil)
	}
	if err != nil {
		return nil, fmt.Errorf("spawn-key: %w", err)
	}
	if len(key) != spawnKeySize {
		return nil, fmt.Errorf("spawn-key %s holds %d bytes, not %d; it is not a key nexus-spawnd wrote. "+
			"Remove it to have a new one generated (instances already running will then fail to reattach and be reaped)",
			path, len(key), spawnKeySize)
	}
	return key, nil
}

// loadBrokerID returns broker_id as configured, else <stateDir>/broker-id's
// (an empty file is absent), else a new random one, persisted.
func loadBrokerID(configured, stateDir string) (string, error) {
	if configured != "" {
		return configured, nil
	}
	if stateDir == "" {
		return randomID()
	}
	path := filepath.Join(stateDir, "broker-id")
	data, err := safedir.ReadOwned(path)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("broker-id %s: %w", path, err)
	}
	if id := strings.TrimSpace(string(data)); id != "" {
		return id, nil
	}
	id, err := randomID()
	if err != nil {
		return "", err
	}
	return id, atomicfile.Write(path, []byte(id+"\n"), nil)
}

func randomID() (string, error) {
	b, err := randomBytes(16)
	return hex.EncodeToString(b), err
}

func randomBytes(n int) ([]byte, error) {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		return nil, fmt.Errorf("reading random bytes: %w", err)
	}
	return b, nil
}

// tempRoot holds the per-claim configs: $TMPDIR when set, else /dev/shm when
// usable, else the system's. On ext4 creating the file was most of spawnd's
// claim latency (≈0.35 ms, against ≈5 µs on tmpfs), and it need not survive
// a reboot its instance does not.
func tempRoot() string {
	if os.Getenv("TMPDIR") == "" {
		if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() && unix.Access("/dev/shm", unix.W_OK|unix.X_OK) == nil {
			return "/dev/shm"
		}
	}
	return os.TempDir()
}

// makeWorkDirs creates spawnd's two private directories: a fresh one under
// tempRoot, 0711, for temp configs (a run_as instance opens its own by exact
// name but cannot list the others; state_dir would not let it in), and
// <state_dir>/logs (0700; without a state_dir, logs in the temp directory).
// The first holds its lock (configdir.go), returned open.
func makeWorkDirs(stateDir string) (configDir, logDir string, lock *os.File, err error) {
	configDir, err = os.MkdirTemp(tempRoot(), configDirPrefix)
	if err == nil {
		err = os.Chmod(configDir, 0o711)
	}
	if err != nil {
		return "", "", nil, fmt.Errorf("creating nexus-spawnd's temp directory: %w; check TMPDIR", err)
	}
	if lock, err = lockConfigDir(configDir); err != nil {
		_ = os.RemoveAll(configDir)
		return "", "", nil, err
	}
	logDir = filepath.Join(configDir, "logs")
	if stateDir != "" {
		logDir = filepath.Join(stateDir, "logs")
	}
	if err := os.MkdirAll(logDir, 0o700); err != nil {
		_ = lock.Close()
		_ = os.RemoveAll(configDir)
		return "", "", nil, fmt.Errorf("creating the instance log directory: %w", err)
	}
	return configDir, logDir, lock, nil
}
