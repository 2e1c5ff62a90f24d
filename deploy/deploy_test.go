package deploy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/config"
	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc"
)

// The files under test, and names they share.
const (
	spawndUnit  = "nexus-spawnd.service"
	gatewayUnit = "nexus-broker.service"
	exampleYAML = "broker.yaml"
	sysusers    = "nexus-broker.sysusers.conf"
	tmpfiles    = "nexus-broker.tmpfiles.conf"
	operations  = "OPERATIONS.md"

	gatewayUser = "nexus-broker"
	// configPath is where OPERATIONS.md installs broker.yaml; both units
	// must pass it as -config.
	configPath = "/etc/nexus-broker/broker.yaml"
)

// spawndCaps is the whole of what spawnd may do beyond an ordinary user;
// see the comment above CapabilityBoundingSet= in nexus-spawnd.service.
var spawndCaps = []string{"CAP_CHOWN", "CAP_KILL", "CAP_SETGID", "CAP_SETUID"}

func TestExampleConfigLoads(t *testing.T) {
	cfg := loadExample(t, readFile(t, exampleYAML))
	spawnd := loadUnit(t, spawndUnit)

	// spawnd runs as root: an entry without run_as would run its
	// instances as root with spawnd's capabilities.
	for name := range cfg.Binaries {
		if cfg.EntryRunAs(name) == nil {
			t.Errorf("binaries.%s has no run_as and there is no default: its instances would run as root", name)
		}
	}
	if cfg.RunAs == nil {
		t.Error("run_as: the example must keep a broker-level default, so an entry added later cannot run as root by omission")
	}
	if cfg.Spawnd.GatewayUID == nil || cfg.Spawnd.SocketGID == nil {
		t.Error("spawnd.gateway_uid and spawnd.socket_gid must be set: spawnd and the gateway run as different users")
	}
	if want := "/run/" + spawnd.last("Service", "RuntimeDirectory"); cfg.Spawnd.RunDir != want {
		t.Errorf("spawnd.run_dir is %q, but %s creates %s (RuntimeDirectory=)", cfg.Spawnd.RunDir, spawndUnit, want)
	}
	if want := "/var/lib/" + spawnd.last("Service", "StateDirectory"); cfg.StateDir != want {
		t.Errorf("state_dir is %q, but %s creates %s (StateDirectory=)", cfg.StateDir, spawndUnit, want)
	}
	for name, e := range cfg.Binaries {
		if home, ok := e.Env["HOME"]; ok {
			if err := instanceWritable(spawnd, home); err != nil {
				t.Errorf("binaries.%s.env.HOME: %v", name, err)
			}
		}
	}
	if len(cfg.InheritEnv) > 0 && len(spawnd.values("Service", "EnvironmentFile")) == 0 {
		t.Errorf("inherit_env is set, but %s has no EnvironmentFile= to give spawnd the values", spawndUnit)
	}
}

// TestExampleIDs fills broker.yaml's placeholder ids as OPERATIONS.md says
// to and checks the result: ids from users that nexus-broker.sysusers.conf
// creates, in a scratch root, with the HOMEs nexus-broker.tmpfiles.conf
// creates there.
func TestExampleIDs(t *testing.T) {
	yaml := readFile(t, exampleYAML)
	ph := placeholders(t, yaml)
	ops := readFile(t, operations)
	for _, p := range ph {
		if sed := fmt.Sprintf("s/%s/$(id -%s %s)/", p.value, p.flag, p.user); !strings.Contains(ops, sed) {
			t.Errorf("%s: the fill-in step does not contain %q for the placeholder of %s", operations, sed, p.key)
		}
	}
	for _, tool := range []string{"systemd-sysusers", "systemd-tmpfiles"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s is not installed (apt-get install systemd), so the users and HOMEs cannot be created in a scratch root", tool)
		}
	}
	if os.Geteuid() != 0 {
		t.Skip("not root: systemd-tmpfiles cannot give the scratch HOMEs to their users")
	}
	root := t.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "etc"), 0o755); err != nil {
		t.Fatal(err)
	}
	// With --root, a relative configuration file is looked up in the root.
	run(t, "systemd-sysusers", "--root="+root, absPath(t, sysusers))
	run(t, "systemd-tmpfiles", "--root="+root, "--create", absPath(t, tmpfiles))
	users := readPasswd(t, filepath.Join(root, "etc", "passwd"))

	filled := yaml
	for _, p := range ph {
		u, ok := users[p.user]
		if !ok {
			t.Fatalf("%s names user %s for %s, but %s does not create it", exampleYAML, p.user, p.key, sysusers)
		}
		id := u.uid
		if p.flag == "g" {
			id = u.gid
		}
		filled = regexp.MustCompile(`\b`+p.value+`\b`).ReplaceAllString(filled, strconv.Itoa(id))
	}
	cfg := loadExample(t, filled)

	gw := users[gatewayUser]
	if *cfg.Spawnd.GatewayUID != gw.uid || *cfg.Spawnd.SocketGID != gw.gid {
		t.Errorf("spawnd.gateway_uid/socket_gid are %d/%d, want %s's %d/%d",
			*cfg.Spawnd.GatewayUID, *cfg.Spawnd.SocketGID, gatewayUser, gw.uid, gw.gid)
	}
	spawnd := loadUnit(t, spawndUnit)
	for name := range cfg.Binaries {
		r := cfg.EntryRunAs(name)
		u, ok := userByUID(users, *r.UID)
		switch {
		case !ok:
			t.Errorf("binaries.%s: run_as uid %d is not a user %s creates", name, *r.UID, sysusers)
			continue
		case u.name == gatewayUser:
			t.Errorf("binaries.%s runs as the gateway's user: its instances could connect to spawnd's socket", name)
		case u.gid != *r.GID:
			t.Errorf("binaries.%s: run_as gid %d is not %s's group %d", name, *r.GID, u.name, u.gid)
		}
		if err := instanceWritable(spawnd, u.home); err != nil {
			t.Errorf("binaries.%s runs as %s, whose HOME: %v", name, u.name, err)
		}
		st, err := os.Stat(filepath.Join(root, u.home))
		if err != nil {
			t.Errorf("binaries.%s runs as %s, but %s does not create its HOME: %v", name, u.name, tmpfiles, err)
			continue
		}
		if sys := st.Sys().(*syscall.Stat_t); int(sys.Uid) != u.uid || st.Mode().Perm() != 0o700 {
			t.Errorf("%s: HOME of %s is uid %d mode %v, want uid %d mode 0700 (sessions live there)",
				u.home, u.name, sys.Uid, st.Mode().Perm(), u.uid)
		}
	}
}

func TestUnits(t *testing.T) {
	cfg := loadExample(t, readFile(t, exampleYAML))
	spawnd := loadUnit(t, spawndUnit)
	gw := loadUnit(t, gatewayUnit)

	for _, u := range []*unit{spawnd, gw} {
		// control-group, the default, kills every instance on stop.
		u.want(t, "Service", "KillMode", "process")
		u.want(t, "Service", "Restart", "on-failure")
		if exe, args := u.exec("ExecStart"); flagValue(args, "-config") != configPath {
			t.Errorf("%s: ExecStart=%s %v does not pass -config %s", u.name, exe, args, configPath)
		}
	}

	// The gateway must not go down with a spawnd restart.
	if !slices.Contains(gw.words("Unit", "Wants"), spawndUnit) || !slices.Contains(gw.words("Unit", "After"), spawndUnit) {
		t.Errorf("%s: want Wants= and After= %s", gatewayUnit, spawndUnit)
	}
	for _, k := range []string{"Requires", "Requisite", "BindsTo", "PartOf"} {
		if slices.Contains(gw.words("Unit", k), spawndUnit) {
			t.Errorf("%s: %s=%s would stop or restart the gateway with spawnd", gatewayUnit, k, spawndUnit)
		}
	}
	gw.want(t, "Service", "User", gatewayUser)
	if _, args := gw.exec("ExecStart"); !slices.Contains(args, "-launch-spawnd=false") {
		t.Errorf("%s: ExecStart must pass -launch-spawnd=false: spawnd belongs to %s", gatewayUnit, spawndUnit)
	}
	if exe, args := gw.exec("ExecReload"); filepath.Base(exe) != "kill" || !slices.Equal(args, []string{"-HUP", "$MAINPID"}) {
		t.Errorf("%s: ExecReload=%s %v, want kill -HUP $MAINPID", gatewayUnit, exe, args)
	}
	// systemd would chown a shared one to the gateway's user, and spawnd
	// refuses a run directory or state_dir it does not own. The gateway's
	// directories are its own: a2a.state_dir, a StateDirectory=, and the
	// directory of control_socket, a RuntimeDirectory= (the gateway cannot
	// write spawnd's, so without it there would be no -drain).
	run := gw.values("Service", "RuntimeDirectory")
	if len(run) != 1 || slices.Contains(spawnd.values("Service", "RuntimeDirectory"), run[0]) {
		t.Errorf("%s: RuntimeDirectory=%v, want one directory of the gateway's own, not %s's", gatewayUnit, run, spawndUnit)
	} else if want := "/run/" + run[0]; filepath.Dir(cfg.ControlSocket) != want {
		t.Errorf("control_socket is %q, but %s creates %s (RuntimeDirectory=): the gateway cannot write %s", cfg.ControlSocket, gatewayUnit, want, cfg.Spawnd.RunDir)
	}
	gw.want(t, "Service", "RuntimeDirectoryMode", "0700")
	own := gw.values("Service", "StateDirectory")
	if len(own) != 1 || slices.Contains(spawnd.values("Service", "StateDirectory"), own[0]) {
		t.Errorf("%s: StateDirectory=%v, want one directory of the gateway's own, not %s's", gatewayUnit, own, spawndUnit)
	} else if want := "/var/lib/" + own[0]; cfg.A2A.StateDir != want {
		t.Errorf("a2a.state_dir is %q, but %s creates %s (StateDirectory=): the gateway cannot write state_dir", cfg.A2A.StateDir, gatewayUnit, want)
	}
	gw.want(t, "Service", "StateDirectoryMode", "0700")
	gw.want(t, "Service", "CapabilityBoundingSet", "")
	gw.want(t, "Service", "NoNewPrivileges", "yes")
	gw.want(t, "Service", "ProtectSystem", "strict")
	gw.want(t, "Service", "ProtectHome", "yes")
	gw.want(t, "Service", "PrivateTmp", "yes")
	gw.want(t, "Service", "MemoryDenyWriteExecute", "yes")
	if v := gw.values("Service", "ReadWritePaths"); len(v) > 0 {
		t.Errorf("%s: ReadWritePaths=%v: the gateway writes nothing", gatewayUnit, v)
	}

	caps := spawnd.words("Service", "CapabilityBoundingSet")
	slices.Sort(caps)
	if !slices.Equal(caps, spawndCaps) {
		t.Errorf("%s: CapabilityBoundingSet=%v, want exactly %v", spawndUnit, caps, spawndCaps)
	}
	if v := spawnd.words("Service", "AmbientCapabilities"); len(v) > 0 {
		t.Errorf("%s: AmbientCapabilities=%v: root needs none, and a same-uid child would inherit them", spawndUnit, v)
	}
	spawnd.want(t, "Service", "RuntimeDirectoryPreserve", "yes")
	spawnd.want(t, "Service", "RuntimeDirectoryMode", "0750")
	spawnd.want(t, "Service", "StateDirectoryMode", "0700")
	spawnd.want(t, "Service", "OOMPolicy", "continue")
	spawnd.want(t, "Service", "Delegate", "yes")
	// Correctness, not taste: each of these breaks something.
	for k, why := range map[string]string{
		"PrivateTmp":           "systemd deletes a private /tmp on stop, under instances that outlive spawnd",
		"ProtectProc":          "spawnd reads /proc/<pid>/stat of instances running as other uids",
		"ExecReload":           "spawnd does not handle SIGHUP; reload through the gateway",
		"User":                 "spawnd runs as root, reduced by CapabilityBoundingSet=",
		"ProtectControlGroups": "a read-only /sys/fs/cgroup keeps spawnd from creating lease cgroups in its delegated subtree",
	} {
		if v := spawnd.last("Service", k); v != "" && v != "no" && v != "false" && v != "default" {
			t.Errorf("%s: %s=%s: %s", spawndUnit, k, v, why)
		}
	}
	if _, args := spawnd.exec("ExecStartPost"); !strings.Contains(strings.Join(args, " "), cfg.Spawnd.RunDir+"/"+spawnrpc.EndpointFile) {
		t.Errorf("%s: ExecStartPost= does not wait for %s/%s", spawndUnit, cfg.Spawnd.RunDir, spawnrpc.EndpointFile)
	}

	// Every run_as HOME the sysusers snippet creates is writable for
	// instances, and the tmpfiles snippet creates it.
	tmp := readFile(t, tmpfiles)
	for _, u := range sysusersLines(t) {
		if u.name == gatewayUser {
			continue
		}
		if err := instanceWritable(spawnd, u.home); err != nil {
			t.Errorf("%s: user %s's HOME: %v", sysusers, u.name, err)
		}
		if !regexp.MustCompile(`(?m)^d\s+` + regexp.QuoteMeta(u.home) + `\s+0700\s+` + u.name + `\s`).MatchString(tmp) {
			t.Errorf("%s: no `d %s 0700 %s ...` line creating %s's HOME", tmpfiles, u.home, u.name, u.name)
		}
	}
}

// TestReadinessWait runs the ExecStartPost= of nexus-spawnd.service against
// a spawnd.json written the way spawnd writes it.
func TestReadinessWait(t *testing.T) {
	if _, err := exec.LookPath("sh"); err != nil {
		t.Skip("no sh on PATH")
	}
	cfg := loadExample(t, readFile(t, exampleYAML))
	spawnd := loadUnit(t, spawndUnit)
	raw := spawnd.last("Service", "ExecStartPost")
	script, prefixed := strings.CutPrefix(raw, "/bin/sh -c '")
	script, suffixed := strings.CutSuffix(script, "'")
	if !prefixed || !suffixed || strings.Contains(script, "'") || strings.Contains(script, `\`) {
		t.Fatalf("ExecStartPost=%s: want /bin/sh -c '<script>' with no quote or backslash inside, which is all this test can emulate", raw)
	}
	// systemd substitutes ${MAINPID} and turns $$ into $; any other $ is a
	// variable systemd would expand (to nothing) before sh sees it.
	if rest := strings.NewReplacer("${MAINPID}", "", "$$", "").Replace(script); strings.Contains(rest, "$") {
		t.Fatalf("ExecStartPost script has a $ systemd would substitute; write $$ for the shell's: %s", script)
	}
	runDir := t.TempDir()
	script = strings.ReplaceAll(script, cfg.Spawnd.RunDir+"/", runDir+"/")
	publish := func(pid int) {
		data, err := json.Marshal(spawnrpc.Endpoint{Protocol: "grpc", ProtocolVersion: spawnrpc.ProtocolVersion, Network: "unix", Addr: runDir + "/plugin1", Pid: pid})
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(runDir, spawnrpc.EndpointFile), append(data, '\n'), 0o640); err != nil {
			t.Fatal(err)
		}
	}
	wait := func(mainPID int, timeout time.Duration) error {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		s := strings.NewReplacer("${MAINPID}", strconv.Itoa(mainPID), "$$", "$").Replace(script)
		out, err := exec.CommandContext(ctx, "sh", "-c", s).CombinedOutput()
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if err != nil {
			return fmt.Errorf("%w: %s", err, out)
		}
		return nil
	}
	self := os.Getpid()

	// Published by this process: ready.
	publish(self)
	if err := wait(self, 10*time.Second); err != nil {
		t.Errorf("spawnd.json names MAINPID: %v", err)
	}

	// Not yet published: it waits, then sees the file.
	os.Remove(filepath.Join(runDir, spawnrpc.EndpointFile))
	timer := time.AfterFunc(300*time.Millisecond, func() { publish(self) })
	defer timer.Stop()
	if err := wait(self, 10*time.Second); err != nil {
		t.Errorf("spawnd.json published after the wait began: %v", err)
	}

	// A pid that merely starts with MAINPID's digits is another process.
	publish(self*10 + 7)
	if err := wait(self, 1500*time.Millisecond); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("spawnd.json names pid %d, MAINPID %d: want the wait to go on, got %v", self*10+7, self, err)
	}

	// spawnd died before publishing: give up at once.
	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := wait(dead.Process.Pid, 10*time.Second); err == nil || errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("MAINPID %d is dead: want a prompt failure, got %v", dead.Process.Pid, err)
	} else if d := time.Since(start); d > 5*time.Second {
		t.Errorf("MAINPID is dead: the wait took %v to give up", d)
	}
}

// TestSystemdVerify has systemd check both units: every key known, every
// value parsed, every command executable. The units name binaries that this
// machine need not have, so ours are pointed at true(1); every other
// command is checked as shipped. A broken copy proves the check can fail
// here. Then systemd's own exposure score bounds each sandbox, so a setting
// dropped by accident shows up.
func TestSystemdVerify(t *testing.T) {
	analyze, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Skip("systemd-analyze is not installed (Debian: apt-get install systemd); the units were not verified")
	}
	truePath, err := exec.LookPath("true")
	if err != nil {
		t.Skip("no true(1) to stand in for the nexus binaries")
	}
	dir := t.TempDir()
	for _, name := range []string{spawndUnit, gatewayUnit} {
		text := regexp.MustCompile(`(?m)^(Exec[A-Za-z]*=[-@:+!]*)/usr/local/bin/nexus-[a-z]+`).ReplaceAllString(readFile(t, name), "${1}"+truePath)
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	verify := func(files ...string) (string, error) {
		args := []string{"verify", "--man=no", "--recursive-errors=no"}
		for _, f := range files {
			args = append(args, filepath.Join(dir, f))
		}
		out, err := exec.Command(analyze, args...).CombinedOutput()
		// Unknown keys and unparsable values are warnings (exit 0), so
		// every line about our files counts. Lines about the host's own
		// units do not.
		var ours []string
		for line := range strings.Lines(string(out)) {
			for _, f := range files {
				if strings.Contains(line, f) || strings.Contains(line, dir) {
					ours = append(ours, strings.TrimSpace(line))
					break
				}
			}
		}
		switch {
		case err != nil:
			return string(out), fmt.Errorf("systemd-analyze verify: %w\n%s", err, strings.Join(ours, "\n"))
		case len(ours) > 0:
			return string(out), errors.New(strings.Join(ours, "\n"))
		}
		return string(out), nil
	}
	if out, err := verify(spawndUnit, gatewayUnit); err != nil {
		t.Errorf("%v\n--- full output:\n%s", err, out)
	}

	broken := strings.Replace(readFile(t, filepath.Join(dir, spawndUnit)), "[Service]\n", "[Service]\nNoSuchSetting=1\nKillMode=bogus\n", 1)
	if err := os.WriteFile(filepath.Join(dir, "broken.service"), []byte(broken), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := verify("broken.service"); err == nil || !strings.Contains(err.Error(), "NoSuchSetting") || !strings.Contains(err.Error(), "bogus") {
		t.Fatalf("a unit with an unknown key and a bad KillMode passed verification (%v): this check cannot fail on this host", err)
	}

	// systemd-analyze security --offline arrived in systemd 250.
	if v := systemdVersion(t, analyze); v < 250 {
		t.Logf("systemd %d: too old for systemd-analyze security --offline; exposure not checked", v)
		return
	}
	// --threshold is in tenths of the 0.0-10.0 exposure it prints, and
	// fails only above it. The thresholds are the scores systemd 252 gives
	// the units as shipped, so losing any one setting fails; a systemd
	// that scores differently needs them measured again.
	for _, c := range []struct {
		unit      string
		threshold int
	}{
		// What remains is the network and /proc the gateway needs.
		{gatewayUnit, 11},
		// Root with four capabilities, and the latitude its instances
		// need (see the unit's comments); a writable /sys/fs/cgroup
		// (no ProtectControlGroups=) for its delegated lease cgroups.
		{spawndUnit, 43},
	} {
		path := filepath.Join(dir, c.unit)
		out, err := exec.Command(analyze, "security", "--offline=true", "--threshold="+strconv.Itoa(c.threshold), path).CombinedOutput()
		if err != nil {
			t.Errorf("%s: exposure above %.1f (%v): was a sandbox setting lost? (systemd-analyze security --offline=true %s)\n%s",
				c.unit, float64(c.threshold)/10, err, path, out)
		}
	}
}

// instanceWritable explains why an instance of the spawnd unit u could not
// write under path, or returns nil. Instances inherit spawnd's mount
// namespace, so a HOME that is read-only or hidden there is read-only or
// hidden for them.
func instanceWritable(u *unit, path string) error {
	path = filepath.Clean(path)
	if !filepath.IsAbs(path) {
		return fmt.Errorf("%s is not absolute", path)
	}
	under := func(dirs ...string) bool {
		for _, d := range dirs {
			d = filepath.Clean(strings.TrimLeft(d, "-+"))
			if d == "/" || path == d || strings.HasPrefix(path, d+"/") {
				return true
			}
		}
		return false
	}
	if d := u.last("Service", "StateDirectory"); d != "" && under("/var/lib/"+d) {
		return fmt.Errorf("%s is inside spawnd's state_dir, which no instance may read", path)
	}
	if d := u.last("Service", "RuntimeDirectory"); d != "" && under("/run/"+d) {
		return fmt.Errorf("%s is inside spawnd's run directory", path)
	}
	for _, k := range []string{"InaccessiblePaths", "ReadOnlyPaths", "TemporaryFileSystem"} {
		if under(u.words("Service", k)...) {
			return fmt.Errorf("%s is under %s= of %s", path, k, u.name)
		}
	}
	if under("/home", "/root", "/run/user") {
		switch u.last("Service", "ProtectHome") {
		case "yes", "true", "tmpfs":
			return fmt.Errorf("%s is hidden by ProtectHome=%s in %s; use ProtectHome=read-only plus ReadWritePaths=%s, or a HOME under /var/lib",
				path, u.last("Service", "ProtectHome"), u.name, path)
		case "read-only":
			if !under(u.words("Service", "ReadWritePaths")...) {
				return fmt.Errorf("%s is read-only under ProtectHome=read-only in %s; add it to ReadWritePaths=", path, u.name)
			}
		}
	}
	var readOnly []string
	switch u.last("Service", "ProtectSystem") {
	case "strict":
		readOnly = []string{"/"}
	case "full":
		readOnly = []string{"/usr", "/boot", "/efi", "/etc"}
	case "yes", "true":
		readOnly = []string{"/usr", "/boot", "/efi"}
	}
	if under(readOnly...) && !under(u.words("Service", "ReadWritePaths")...) {
		return fmt.Errorf("%s is read-only under ProtectSystem=%s in %s: instances could not write their sessions; add it to ReadWritePaths=",
			path, u.last("Service", "ProtectSystem"), u.name)
	}
	return nil
}

// unit is a parsed systemd unit file: every assignment of every key, in
// order, per section.
type unit struct {
	name     string
	sections map[string]map[string][]string
}

func loadUnit(t *testing.T, name string) *unit {
	t.Helper()
	u := &unit{name: name, sections: map[string]map[string][]string{}}
	var section string
	sc := bufio.NewScanner(strings.NewReader(readFile(t, name)))
	sc.Buffer(nil, 1<<20)
	var cont strings.Builder
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if cont.Len() == 0 && (line == "" || line[0] == '#' || line[0] == ';') {
			continue
		}
		// A trailing backslash continues the line (systemd.syntax(7)).
		if s, ok := strings.CutSuffix(line, `\`); ok {
			cont.WriteString(s + " ")
			continue
		}
		cont.WriteString(line)
		line = cont.String()
		cont.Reset()
		if strings.HasPrefix(line, "[") && strings.HasSuffix(line, "]") {
			section = line[1 : len(line)-1]
			if u.sections[section] == nil {
				u.sections[section] = map[string][]string{}
			}
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok || section == "" {
			t.Fatalf("%s:%d: not a section header or Key=Value: %q", name, n, line)
		}
		k = strings.TrimSpace(k)
		u.sections[section][k] = append(u.sections[section][k], strings.TrimSpace(v))
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return u
}

// values is every assignment of key, in order.
func (u *unit) values(section, key string) []string { return u.sections[section][key] }

// last is the assignment in force for a single-valued key.
func (u *unit) last(section, key string) string {
	v := u.values(section, key)
	if len(v) == 0 {
		return ""
	}
	return v[len(v)-1]
}

// words is a list-valued key: assignments accumulate, and an empty one
// resets the list, as systemd reads them.
func (u *unit) words(section, key string) []string {
	var out []string
	for _, v := range u.values(section, key) {
		if v == "" {
			out = nil
			continue
		}
		out = append(out, strings.Fields(v)...)
	}
	return out
}

// exec splits a command key into its executable and arguments. Quoting is
// kept inside the arguments; the tests only look for plain words.
func (u *unit) exec(key string) (string, []string) {
	f := strings.Fields(u.last("Service", key))
	if len(f) == 0 {
		return "", nil
	}
	return strings.TrimLeft(f[0], "-@:+!"), f[1:]
}

// flagValue is the word after name in args, or "".
func flagValue(args []string, name string) string {
	if i := slices.Index(args, name); i >= 0 && i+1 < len(args) {
		return args[i+1]
	}
	return ""
}

func (u *unit) want(t *testing.T, section, key, want string) {
	t.Helper()
	if got := u.last(section, key); got != want {
		t.Errorf("%s: %s=%q, want %q", u.name, key, got, want)
	}
}

// placeholder is one id of broker.yaml to fill in, recognised by its
// comment: `uid: 4000000003   # id -u nexus-instance`.
type placeholder struct {
	key, value, flag, user string
}

var placeholderRE = regexp.MustCompile(`(?m)^\s*([a-z_]+):\s*([0-9]+)\s*#\s*id -([ug]) ([a-z][a-z0-9-]*)\s*$`)

func placeholders(t *testing.T, yaml string) []placeholder {
	t.Helper()
	var out []placeholder
	seen := map[string]bool{}
	for _, m := range placeholderRE.FindAllStringSubmatch(yaml, -1) {
		p := placeholder{key: m[1], value: m[2], flag: m[3], user: m[4]}
		// Far above any uid or gid a host allocates, so an unfilled one
		// fails loudly; distinct, so the fill-in is unambiguous.
		if n, _ := strconv.ParseInt(p.value, 10, 64); n < 4_000_000_000 || seen[p.value] {
			t.Errorf("%s: %s: %s: placeholders must be distinct and at least 4000000000", exampleYAML, p.key, p.value)
		}
		seen[p.value] = true
		out = append(out, p)
	}
	// gateway_uid, socket_gid, and a uid and gid per run_as block.
	if len(out) < 4 {
		t.Fatalf("%s: found %d `# id -u NAME` placeholders; the ids to fill in must be marked that way", exampleYAML, len(out))
	}
	return out
}

type account struct {
	name     string
	uid, gid int
	home     string
}

func readPasswd(t *testing.T, path string) map[string]account {
	t.Helper()
	out := map[string]account{}
	for line := range strings.Lines(readFile(t, path)) {
		f := strings.Split(strings.TrimSpace(line), ":")
		if len(f) < 7 {
			continue
		}
		uid, err1 := strconv.Atoi(f[2])
		gid, err2 := strconv.Atoi(f[3])
		if err1 != nil || err2 != nil {
			t.Fatalf("%s: bad line %q", path, line)
		}
		out[f[0]] = account{name: f[0], uid: uid, gid: gid, home: f[5]}
	}
	return out
}

func userByUID(users map[string]account, uid int) (account, bool) {
	for _, u := range users {
		if u.uid == uid {
			return u, true
		}
	}
	return account{}, false
}

// sysusersLines is the `u` lines of the sysusers snippet, home "-" read as
// the default "/".
func sysusersLines(t *testing.T) []account {
	t.Helper()
	var out []account
	for line := range strings.Lines(readFile(t, sysusers)) {
		line = strings.TrimSpace(line)
		if !strings.HasPrefix(line, "u ") && !strings.HasPrefix(line, "u\t") {
			continue
		}
		// u NAME ID "GECOS" HOME SHELL
		rest := strings.Fields(line)[1:]
		name := rest[0]
		_, after, ok := strings.Cut(line, `"`)
		if ok {
			_, after, ok = strings.Cut(after, `"`)
		}
		if !ok {
			t.Fatalf("%s: want a quoted GECOS in %q", sysusers, line)
		}
		tail := strings.Fields(after)
		home := "/"
		if len(tail) > 0 && tail[0] != "-" {
			home = tail[0]
		}
		out = append(out, account{name: name, home: home})
	}
	if len(out) == 0 {
		t.Fatalf("%s: no u lines", sysusers)
	}
	return out
}

func loadExample(t *testing.T, yaml string) *config.Config {
	t.Helper()
	cfg, err := config.Parse([]byte(yaml))
	if err != nil {
		t.Fatalf("%s does not load: %v", exampleYAML, err)
	}
	return cfg
}

func systemdVersion(t *testing.T, analyze string) int {
	out, err := exec.Command(analyze, "--version").Output()
	if err != nil {
		t.Fatalf("systemd-analyze --version: %v", err)
	}
	var v int
	if _, err := fmt.Sscanf(string(out), "systemd %d", &v); err != nil {
		t.Fatalf("systemd-analyze --version printed %q", bytes.SplitN(out, []byte("\n"), 2)[0])
	}
	return v
}

func absPath(t *testing.T, name string) string {
	t.Helper()
	p, err := filepath.Abs(name)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func run(t *testing.T, name string, args ...string) {
	t.Helper()
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
}

// readFile reads path; a bare name is a file of this directory.
func readFile(t *testing.T, path string) string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(data)
}
