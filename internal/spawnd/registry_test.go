package spawnd

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/nexus-broker/nexus-broker/internal/config/core"
)

// boot runs New on a config text, with TMPDIR private to the test so the
// temp directory of a Daemon that boots is cleaned up with it.
func boot(t *testing.T, yaml string) (*Daemon, *logBuffer, error) {
	t.Helper()
	t.Setenv("TMPDIR", t.TempDir())
	cfg, err := core.Parse([]byte(yaml))
	if err != nil {
		t.Fatalf("core.Parse: %v", err)
	}
	logs := newLogBuffer()
	d, err := New(filepath.Join(t.TempDir(), "broker.yaml"), cfg, slog.New(slog.NewJSONHandler(logs, nil)))
	if d != nil {
		t.Cleanup(func() { _ = d.Close() })
	}
	return d, logs, err
}

func TestRegistryRefusesWhatItCannotExec(t *testing.T) {
	dir := t.TempDir()
	plain := filepath.Join(dir, "plain")
	if err := os.WriteFile(plain, []byte("#!/bin/sh\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	emptyPath := t.TempDir()
	for _, tc := range []struct {
		name, yaml, home, path, want string
	}{
		{
			name: "missing",
			yaml: "binaries:\n  nexus: {path: FAKE}\n  vision: {path: DIR/nope}\n",
			want: `broker config: binaries: vision: path "DIR/nope" (resolved DIR/nope) does not exist`,
		},
		{
			name: "directory",
			yaml: "binaries:\n  nexus: {path: FAKE}\n  vision: {path: DIR}\n",
			want: `broker config: binaries: vision: path "DIR" (resolved DIR) is a directory`,
		},
		{
			name: "no execute bit",
			yaml: "binaries:\n  nexus: {path: FAKE}\n  vision: {path: DIR/plain}\n",
			want: `broker config: binaries: vision: path "DIR/plain" (resolved DIR/plain) is not executable (mode -rw-r--r--); chmod +x it`,
		},
		{
			name: "no execute bit behind ~",
			yaml: "binaries:\n  nexus: {path: FAKE}\n  vision: {path: ~/plain}\n",
			home: dir,
			want: `broker config: binaries: vision: path "~/plain" (resolved DIR/plain) is not executable`,
		},
		{
			name: "reserved nexus not on PATH",
			yaml: "listen_addr: 127.0.0.1:8080\n",
			path: emptyPath,
			want: `broker config: binaries: nexus: path "nexus" has no path separator, so it was looked up on nexus-spawnd's PATH (` + emptyPath + `), and no executable of that name is there`,
		},
		{
			name: "bare name not on PATH",
			yaml: "binaries:\n  nexus: {path: FAKE}\n  vision: {path: plain}\n",
			path: dir, // plain is there, but without an execute bit
			want: `broker config: binaries: vision: path "plain" has no path separator`,
		},
		{
			name: "run_as uid without passwd entry or env.HOME",
			yaml: "binaries:\n  nexus: {path: FAKE}\n  vision: {path: FAKE, run_as: {uid: 3999999, gid: 3999999}}\n",
			want: `broker config: binaries: vision: run_as uid 3999999 has no passwd entry`,
		},
		{
			name: "run_as the gateway's uid, gateway apart",
			yaml: "spawnd: {gateway_uid: 3999998}\nbinaries:\n  nexus: {path: FAKE}\n  vision: {path: FAKE, run_as: {uid: 3999998, gid: 3999999}, env: {HOME: /}}\n",
			want: `broker config: binaries: vision: run_as uid 3999998 is spawnd.gateway_uid, the only uid nexus-spawnd takes requests from`,
		},
		{
			name: "run_as the socket group, gateway apart",
			yaml: "spawnd: {gateway_uid: 3999998, socket_gid: 3999997}\nrun_as: {uid: 3999999, gid: 3999997}\nbinaries:\n  nexus: {path: FAKE, env: {HOME: /}}\n",
			want: `broker config: binaries: nexus: run_as gid 3999997 is spawnd.socket_gid, the group that reaches nexus-spawnd's socket`,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.home != "" {
				t.Setenv("HOME", tc.home)
			}
			if tc.path != "" {
				t.Setenv("PATH", tc.path)
			}
			yaml := strings.NewReplacer("FAKE", fakeBin, "DIR", dir).Replace(tc.yaml)
			d, _, err := boot(t, yaml)
			want := strings.ReplaceAll(tc.want, "DIR", dir)
			if err == nil || !strings.Contains(err.Error(), want) {
				t.Fatalf("New = %v, %v\nwant an error containing %s", d, err, want)
			}
		})
	}
}

// TestRegistryResolvesTildeAndPATH: ~ is spawnd's HOME; a bare name is
// looked up on spawnd's PATH; both end up absolute in the boot log.
func TestRegistryResolvesTildeAndPATH(t *testing.T) {
	t.Setenv("HOME", filepath.Dir(fakeBin))
	t.Setenv("PATH", "/nonexistent-dir:"+filepath.Dir(fakeBin))
	_, logs, err := boot(t, "binaries:\n  nexus: {path: "+fakeName+"}\n  tilde: {path: ~/"+fakeName+"}\n")
	if err != nil {
		t.Fatal(err)
	}
	for name, written := range map[string]string{"nexus": fakeName, "tilde": "~/" + fakeName} {
		logs.await(t, "binary registry entry", "name", name, "path", written, "resolved_path", fakeBin)
	}
}

// TestBootLog checks the per-entry lines (sorted, names only, what a spawn
// will carry) and the WARN for declared names spawnd does not hold.
func TestBootLog(t *testing.T) {
	t.Setenv("SPAWND_TEST_INHERITED", "secret value")
	t.Setenv("SPAWND_TEST_LEAK", "x")
	os.Unsetenv("SPAWND_TEST_MISSING")
	_, logs, err := boot(t, strings.ReplaceAll(`
inherit_env: [SPAWND_TEST_INHERITED, SPAWND_TEST_MISSING]
binaries:
  vision:
    path: FAKE
    env: {VISION: "1"}
  nexus:
    path: FAKE
`, "FAKE", fakeBin))
	if err != nil {
		t.Fatal(err)
	}
	common := []string{"NEXUS_BROKER_ADDR", "NEXUS_BROKER_LEASE_ID", "NEXUS_BROKER_SPAWN_SECRET", "SPAWND_TEST_INHERITED"}
	for _, name := range alwaysPass {
		if _, ok := os.LookupEnv(name); ok {
			common = append(common, name)
		}
	}
	entries := logs.find("binary registry entry")
	if len(entries) != 2 || entries[0]["name"] != "nexus" || entries[1]["name"] != "vision" {
		t.Fatalf("registry lines = %v, want nexus then vision", entries)
	}
	for i, extra := range [][]string{nil, {"VISION"}} {
		want := slices.Sorted(slices.Values(slices.Concat(common, extra)))
		if got := entries[i]["spawn_env"]; got != strings.Join(want, ",") {
			t.Errorf("%s spawn_env = %v, want %s", entries[i]["name"], got, strings.Join(want, ","))
		}
		if entries[i]["level"] != "INFO" || entries[i]["resolved_path"] != fakeBin || entries[i]["path"] != fakeBin {
			t.Errorf("registry line = %v", entries[i])
		}
		if _, ok := entries[i]["run_as"]; ok {
			t.Errorf("%s logs run_as without one configured", entries[i]["name"])
		}
	}
	warn := logs.await(t, "inherit_env names variables this broker's own environment does not hold, so no spawned instance will carry them; "+
		"export them into the broker's environment or set them under binaries.<name>.env")
	if warn["level"] != "WARN" || warn["missing"] != "SPAWND_TEST_MISSING" || warn["environment"] != "nexus-spawnd's" {
		t.Errorf("missing inherit_env WARN = %v", warn)
	}
	if strings.Contains(logs.text(), "secret value") {
		t.Error("the boot log carries an environment value")
	}
}

// TestRunAsWarnings: run_as uid 0 is a WARN naming the entry, and so is a
// run_as uid the gateway shares with spawnd (one user's setup); a run_as of
// another uid is neither.
func TestRunAsWarnings(t *testing.T) {
	own := os.Getuid()
	_, logs, err := boot(t, strings.ReplaceAll(fmt.Sprintf(`
binaries:
  nexus: {path: FAKE}
  rooted: {path: FAKE, run_as: {uid: 0, gid: 0}, env: {HOME: /}}
  shared: {path: FAKE, run_as: {uid: %d, gid: 3999999}, env: {HOME: /}}
  apart: {path: FAKE, run_as: {uid: 3999999, gid: 3999999}, env: {HOME: /}}
`, own), "FAKE", fakeBin))
	if err != nil {
		t.Fatal(err)
	}
	root := logs.await(t, "these entries set run_as uid 0, so their instances run as root; give them an unprivileged user")
	wantRoot := "rooted"
	if own == 0 {
		wantRoot = "rooted,shared"
	}
	if root["level"] != "WARN" || root["entries"] != wantRoot {
		t.Errorf("run_as uid 0 WARN = %v, want entries %s", root, wantRoot)
	}
	shared := logs.await(t, "these entries run_as the uid the gateway and nexus-spawnd share, so their instances could ask nexus-spawnd for anything the gateway may; "+
		"fine for one user's development setup, otherwise run the gateway as its own user (spawnd.gateway_uid) and give the entries another")
	wantShared := "shared"
	if own == 0 {
		wantShared = "rooted,shared"
	}
	if shared["level"] != "WARN" || shared["entries"] != wantShared {
		t.Errorf("shared-uid WARN = %v, want entries %s", shared, wantShared)
	}
}
