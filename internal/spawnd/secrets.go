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
)

// spawnKeySize is the spawn-key's length: HMAC-SHA256 gains nothing from a
// longer key.
const spawnKeySize = 32

// secretFor is a lease's spawn secret, hex(HMAC-SHA256(spawn-key, lease id)).
// It is derived rather than minted so that a restarted nexus-spawnd
// recomputes exactly what a surviving instance holds, without the secret
// ever being written down.
func secretFor(key []byte, leaseID string) string {
	mac := hmac.New(sha256.New, key)
	mac.Write([]byte(leaseID))
	return hex.EncodeToString(mac.Sum(nil))
}

// loadSpawnKey returns <stateDir>/spawn-key, creating it on first boot. With
// no state_dir the key is random and lives in memory only.
//
// A key file of the wrong size, not spawnd's own, or readable by anyone but
// its owner, refuses the boot: regenerating it silently would strand every
// running instance, and a key someone else wrote or can read lets them
// forge any live lease's dial-back.
func loadSpawnKey(stateDir string) ([]byte, error) {
	if stateDir == "" {
		return randomBytes(spawnKeySize)
	}
	path := filepath.Join(stateDir, "spawn-key")
	// Owner and mode both: a key someone else wrote is theirs to forge
	// dial-backs with, and one others may read is anyone's.
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

// loadBrokerID returns broker_id as configured, else the id persisted in
// <stateDir>/broker-id, else a new random one (persisted when there is a
// state_dir). An empty file is treated as absent.
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

// tempRoot is where per-claim config files are created: $TMPDIR when the
// operator set one, else /dev/shm when it is there, else the system temp
// directory. A config is written and removed once per claim, and on a disk
// filesystem that file creation was most of spawnd's share of claim latency
// (≈0.35 ms on ext4 against ≈5 µs on tmpfs); nothing in it needs to survive
// a reboot, since its instance does not either.
func tempRoot() string {
	if os.Getenv("TMPDIR") == "" {
		if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() && unix.Access("/dev/shm", unix.W_OK|unix.X_OK) == nil {
			return "/dev/shm"
		}
	}
	return os.TempDir()
}

// makeWorkDirs creates spawnd's two private directories.
//
// Temp configs go in a fresh directory under tempRoot, mode 0711: a run_as
// instance must open its own config, which it can by exact name, but it may
// not list the directory, and state_dir (0700) would not let it in at all.
//
// Instance output goes to <state_dir>/logs (0700), where an operator finds
// it after a restart; without a state_dir, to a logs directory inside the
// temp directory.
func makeWorkDirs(stateDir string) (configDir, logDir string, err error) {
	configDir, err = os.MkdirTemp(tempRoot(), configDirPrefix)
	if err == nil {
		err = os.Chmod(configDir, 0o711)
	}
	if err != nil {
		return "", "", fmt.Errorf("creating nexus-spawnd's temp directory: %w; check TMPDIR", err)
	}
	logDir = filepath.Join(configDir, "logs")
	if stateDir != "" {
		logDir = filepath.Join(stateDir, "logs")
	}
	if err := os.MkdirAll(logDir, 0o700); err != nil {
		_ = os.RemoveAll(configDir)
		return "", "", fmt.Errorf("creating the instance log directory: %w", err)
	}
	return configDir, logDir, nil
}
