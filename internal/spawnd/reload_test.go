package spawnd

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/spawnrpc/spawnpb"
)

func (h *harness) names() []string {
	h.t.Helper()
	st, err := h.client.Status(h.ctx(), &spawnpb.StatusRequest{})
	if err != nil {
		h.t.Fatal(err)
	}
	var names []string
	for _, b := range st.Binaries {
		names = append(names, b.Name)
	}
	return names
}

func TestReloadIsAllOrNothing(t *testing.T) {
	const before = `
state_dir: STATE
release_grace: 10s
binaries:
  nexus:
    path: FAKE
    args: [-report, REPORT]
`
	h := newHarness(t, before)
	_, live := h.spawn("lease-live", "nexus")

	// A file with one bad entry changes nothing, not even its valid keys.
	h.writeConfig(strings.Replace(before, "release_grace: 10s", "release_grace: 1s", 1) + `
  vision:
    path: /nonexistent/nexus-vision
inherit_env: [SPAWND_TEST_INHERITED]
`)
	resp, err := h.client.Reload(h.ctx(), &spawnpb.ReloadRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if resp.Applied || !strings.Contains(resp.Error, `binaries: vision: path "/nonexistent/nexus-vision" (resolved /nonexistent/nexus-vision) does not exist`) {
		t.Errorf("Reload = %v, want rejected naming vision's path", resp)
	}
	if got := h.names(); !slices.Equal(got, []string{"nexus"}) {
		t.Errorf("after a rejected reload the registry is %v, want [nexus]", got)
	}
	if h.d.settings.releaseGrace != 10*time.Second {
		t.Errorf("a rejected reload changed release_grace to %s", h.d.settings.releaseGrace)
	}
	h.logs.await(t, "config reload rejected; the configuration already in force is unchanged", "path", h.cfgPath)

	// A good file is applied whole, and reports the keys it changed.
	h.writeConfig(`
state_dir: STATE
release_grace: 1s
inherit_env: [SPAWND_TEST_INHERITED]
binaries:
  nexus:
    path: FAKE
    args: [-report, REPORT]
  vision:
    path: FAKE
    label: Vision
    description: Multimodal build
    args: [-report, REPORT, -mode, exit]
`)
	resp, err = h.client.Reload(h.ctx(), &spawnpb.ReloadRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if !resp.Applied || !slices.Equal(resp.Changed, []string{"binaries", "release_grace", "inherit_env"}) {
		t.Errorf("Reload = %v, want applied, changed binaries, release_grace, inherit_env", resp)
	}
	if len(resp.Binaries) != 2 || resp.Binaries[1].GetLabel() != "Vision" || resp.Binaries[1].GetDescription() != "Multimodal build" {
		t.Errorf("Reload listing = %v", resp.Binaries)
	}
	if h.d.settings.releaseGrace != time.Second {
		t.Errorf("release_grace after reload = %s, want 1s", h.d.settings.releaseGrace)
	}
	h.logs.await(t, "config reload applied", "changed", "binaries,release_grace,inherit_env", "binaries", 2)
	h.logs.await(t, "binary registry entry", "name", "vision", "resolved_path", fakeBin)
	h.spawn("lease-vision", "vision")

	// The lease spawned before either reload is untouched.
	v, err := h.client.Verify(h.ctx(), &spawnpb.VerifyRequest{LeaseId: "lease-live", Secret: live.env()["NEXUS_BROKER_SPAWN_SECRET"]})
	if err != nil || v.Result != spawnpb.VerifyResult_VERIFY_RESULT_OK {
		t.Errorf("the live lease after reloads: Verify = %v (%v)", v, err)
	}

	// Boot-only keys are reported and left as they were.
	h.writeConfig(strings.Replace(defaultYAML, "state_dir: STATE", "state_dir: /elsewhere", 1))
	if resp, err = h.client.Reload(h.ctx(), &spawnpb.ReloadRequest{}); err != nil || !resp.Applied {
		t.Fatalf("Reload = %v (%v)", resp, err)
	}
	h.logs.await(t, "config reload: these keys changed in the file but are only read at boot, so the values in force are unchanged; restart nexus-spawnd to apply them",
		"keys", "state_dir")
}

// TestReloadHoldsToTheGatewaysDigest: a reload naming the digest the gateway
// validated applies only that version of the file; one that changed again
// in between is refused whole, and Status keeps reporting the version in
// force. refuse_boot_only refuses a change of a boot-only key instead of
// applying the rest.
func TestReloadHoldsToTheGatewaysDigest(t *testing.T) {
	h := newHarness(t, defaultYAML)
	st0, err := h.client.Status(h.ctx(), &spawnpb.StatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	before := h.names()
	if st0.ConfigPath != h.cfgPath || len(st0.ConfigDigest) != 64 {
		t.Fatalf("Status reports config %q digest %q, want %q and a SHA-256", st0.ConfigPath, st0.ConfigDigest, h.cfgPath)
	}
	validated := h.writeConfig(defaultYAML + "  vision:\n    path: FAKE\n")
	h.writeConfig(defaultYAML + "  other:\n    path: FAKE\n")
	resp, err := h.client.Reload(h.ctx(), &spawnpb.ReloadRequest{ConfigDigest: validated})
	if err != nil {
		t.Fatal(err)
	}
	if resp.Applied || !strings.Contains(resp.Error, "changed again after the gateway read it") {
		t.Fatalf("Reload of a file that changed again = %v, want refused", resp)
	}
	if got := h.names(); !slices.Equal(got, before) {
		t.Errorf("registry after the refused reload: %v, want %v", got, before)
	}
	if st, _ := h.client.Status(h.ctx(), &spawnpb.StatusRequest{}); st.ConfigDigest != st0.ConfigDigest {
		t.Errorf("Status digest moved to %q on a refused reload", st.ConfigDigest)
	}

	current := h.writeConfig(defaultYAML + "  vision:\n    path: FAKE\n")
	if resp, err = h.client.Reload(h.ctx(), &spawnpb.ReloadRequest{ConfigDigest: current}); err != nil || !resp.Applied {
		t.Fatalf("Reload of the validated version = %v (%v)", resp, err)
	}
	if st, _ := h.client.Status(h.ctx(), &spawnpb.StatusRequest{}); st.ConfigDigest != current {
		t.Errorf("Status digest after the reload = %q, want %q", st.ConfigDigest, current)
	}

	bootOnly := h.writeConfig(strings.Replace(defaultYAML, "state_dir: STATE", "state_dir: /elsewhere", 1))
	resp, err = h.client.Reload(h.ctx(), &spawnpb.ReloadRequest{ConfigDigest: bootOnly, RefuseBootOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	if resp.Applied || !slices.Equal(resp.BootOnly, []string{"state_dir"}) || !strings.Contains(resp.Error, "state_dir, which nexus-spawnd reads only at boot") {
		t.Fatalf("Reload changing state_dir with refuse_boot_only = %v, want refused naming state_dir", resp)
	}

	// A SIGHUP applies the rest and ignores the boot-only edit, which stays
	// pending: a gateway attaching with that file is still refused, and
	// one attaching with the file reverted is not.
	if resp, err = h.client.Reload(h.ctx(), &spawnpb.ReloadRequest{ConfigDigest: bootOnly}); err != nil || !resp.Applied {
		t.Fatalf("SIGHUP reload with a boot-only edit = %v (%v), want applied", resp, err)
	}
	if resp, err = h.client.Reload(h.ctx(), &spawnpb.ReloadRequest{ConfigDigest: bootOnly, RefuseBootOnly: true}); err != nil || resp.Applied || !slices.Equal(resp.BootOnly, []string{"state_dir"}) {
		t.Fatalf("attaching with the ignored boot-only edit = %v (%v), want refused naming state_dir", resp, err)
	}
	reverted := h.writeConfig(defaultYAML + "  vision:\n    path: FAKE\n")
	if resp, err = h.client.Reload(h.ctx(), &spawnpb.ReloadRequest{ConfigDigest: reverted, RefuseBootOnly: true}); err != nil || !resp.Applied || len(resp.BootOnly) != 0 {
		t.Fatalf("attaching with the boot-only edit reverted = %v (%v), want applied", resp, err)
	}
}
