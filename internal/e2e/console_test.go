package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/chromedp"
	"github.com/chromedp/chromedp/kb"

	"github.com/nexus-broker/nexus-broker/internal/sockdir"
	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// chromiumPath is Debian's chromium, which .ci/run installs.
const chromiumPath = "/usr/bin/chromium"

// startChromium starts a headless Chromium with a fresh profile in the
// test's temp dir, and flags, and returns a tab; the browser is killed at
// cleanup.
func startChromium(t *testing.T, flags ...chromedp.ExecAllocatorOption) context.Context {
	t.Helper()
	if _, err := os.Stat(chromiumPath); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("the browser test needs %s (apt-get install chromium): %v", chromiumPath, err)
		}
		t.Skipf("no %s (apt-get install chromium)", chromiumPath)
	}
	profile := filepath.Join(t.TempDir(), "chromium-profile")
	alloc, cancelAlloc := chromedp.NewExecAllocator(context.Background(), append([]chromedp.ExecAllocatorOption{
		chromedp.ExecPath(chromiumPath),
		chromedp.Headless,
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.NoFirstRun,
		chromedp.NoDefaultBrowserCheck,
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.UserDataDir(profile),
		// Chromium puts its singleton socket under TMPDIR, which may be
		// too long for a unix socket path.
		chromedp.Env("TMPDIR=" + sockdir.New(t, "nxc")),
		chromedp.WindowSize(1280, 900),
	}, flags...)...)
	tab, cancelTab := chromedp.NewContext(alloc)
	t.Cleanup(func() {
		cancelTab()
		cancelAlloc() // kills the browser and waits for it
		// Its helpers (zygote, renderers) must be gone too.
		for _, pid := range processesWith(profile) {
			t.Errorf("chromium process %d outlived the test; killing it", pid)
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	// The first action starts the browser, which lives as long as tab: no
	// deadline on this one.
	if err := chromedp.Do(tab, chromedp.Navigate("about:blank")); err != nil {
		t.Fatalf("starting %s: %v", chromiumPath, err)
	}
	return tab
}

// processesWith lists the processes whose command line mentions arg.
func processesWith(arg string) []int {
	return pidsWhere(func(pid int) bool {
		cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		return err == nil && bytes.Contains(cmdline, []byte(arg))
	})
}

// TestConsoleInABrowser: an operator's console in headless Chromium shows
// two leases claimed after it loaded, without a reload; the Release button
// (pressed from the keyboard) ends one, and its row goes. Another
// principal's lease is listed without a Release button, and the page never
// holds a session id, a ticket or a token.
func TestConsoleInABrowser(t *testing.T) {
	b := startAuthBroker(t, "", Options{})

	// The console needs the admin scope: an owner gets the 403.
	status, got := b.doAs(tokAlice, "GET", "/console", "")
	wantAnswer(t, "GET /console without the admin scope", status, got, 403, `{"error":"insufficient scope"}`+"\n")
	status, got = b.doAs("", "GET", "/console/events", "")
	wantAnswer(t, "GET /console/events without a credential", status, got, 401, bodyRequired)

	tab := startChromium(t)
	ctx, cancel := context.WithTimeout(tab, 2*time.Minute)
	defer cancel()
	css := func(sel string) chromedp.CSS { return chromedp.CSS(sel) }
	row := func(id string) string { return `tr[data-lease="` + id + `"]` }
	eval := func(expr string, out any) {
		t.Helper()
		v, err := chromedp.Run(ctx, chromedp.Evaluate[json.RawMessage](expr))
		if err == nil {
			err = json.Unmarshal(v, out)
		}
		if err != nil {
			t.Fatalf("evaluating %s: %v", expr, err)
		}
	}
	// The operator's credential, as a proxy in front of the broker would add it.
	if _, err := chromedp.Call(ctx, network.Enable, network.EnableParams{}); err != nil {
		t.Fatal(err)
	}
	if _, err := chromedp.Call(ctx, network.SetExtraHTTPHeaders, network.SetExtraHTTPHeadersParams{
		Headers: network.Headers{"Authorization": "Bearer " + tokOps},
	}); err != nil {
		t.Fatal(err)
	}
	if err := chromedp.Do(ctx,
		chromedp.Navigate(b.Base+"/console"),
		chromedp.WaitVisible(css(`#conn[data-state="live"]`)),
	); err != nil {
		t.Fatalf("opening the console: %v", err)
	}
	var marked bool
	eval(`window.loadedOnce = true`, &marked)

	mine1, mine2 := b.claimAs(tokOps), b.claimAs(tokOps)
	bobs := b.claimAs(tokBob)
	for _, c := range []string{mine1.LeaseID, mine2.LeaseID, bobs.LeaseID} {
		if err := chromedp.Do(ctx, chromedp.WaitVisible(css(row(c)))); err != nil {
			t.Fatalf("lease %s never appeared on the open page: %v", c, err)
		}
	}
	var sameLoad bool
	var bobButtons int
	eval(`window.loadedOnce === true`, &sameLoad)
	eval(`document.querySelectorAll('`+row(bobs.LeaseID)+` button').length`, &bobButtons)
	if !sameLoad {
		t.Error("the page was reloaded to show the new leases")
	}
	if bobButtons != 0 {
		t.Errorf("bob's lease offers %d buttons to the operator; release has no operator bypass", bobButtons)
	}

	// A client attaches to the second, and a newer one displaces it: the
	// row says attached, the events say evicted.
	b.dial(mine2, brokerclient.DialOptions{Token: tokOps})
	b.dial(mine2, brokerclient.DialOptions{Token: tokOps})
	attached := row(mine2.LeaseID) + ` td:nth-of-type(6)`
	if err := chromedp.Do(ctx,
		chromedp.WaitVisible(css(`#events li:first-child[data-kind="evicted"]`)),
		chromedp.WaitVisible(css(attached+`[data-attached="yes"]`)),
	); err != nil {
		t.Fatalf("the eviction and the attached client never showed: %v", err)
	}

	// Release the first from the keyboard: focus its button, press Enter.
	if err := chromedp.Do(ctx,
		chromedp.Focus(css(`button[data-release="`+mine1.LeaseID+`"]`)),
		chromedp.KeyEvent(kb.Enter),
		chromedp.WaitNotPresent(css(row(mine1.LeaseID))),
	); err != nil {
		t.Fatalf("releasing %s from the page: %v", mine1.LeaseID, err)
	}
	if _, ok := b.lease(mine1.LeaseID); ok {
		t.Errorf("GET /leases still lists %s after its release from the page", mine1.LeaseID)
	}
	if err := chromedp.Do(ctx,
		chromedp.WaitVisible(css(row(mine2.LeaseID))),
		chromedp.WaitVisible(css(row(bobs.LeaseID))),
	); err != nil {
		t.Fatal(err)
	}
	var announced, events, html, snapshot string
	eval(`document.getElementById("announce").textContent`, &announced)
	eval(`document.getElementById("events").textContent`, &events)
	eval(`document.documentElement.outerHTML`, &html)
	eval(`JSON.stringify(snap)`, &snapshot)
	checkSchema(t, "ConsoleSnapshot", []byte(snapshot))
	shot, err := chromedp.Run(ctx, chromedp.FullScreenshot(90))
	if err != nil {
		t.Fatal(err)
	}
	png := filepath.Join(t.TempDir(), "console.png")
	if err := os.WriteFile(png, shot, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot: %s (%d bytes)", png, len(shot))
	if !strings.Contains(announced, "released") {
		t.Errorf("the page announced %q after the release", announced)
	}
	if !strings.Contains(events, "released") || !strings.Contains(events, "claimed") || !strings.Contains(events, "evicted") {
		t.Errorf("the event list does not show the claims and the release: %q", events)
	}

	// Nothing secret, and no session id, in what the page holds: the
	// rendered document and the last snapshot it was sent.
	for what, secret := range map[string]string{
		"bob's session id": bobs.SessionID, "the operator's session id": mine2.SessionID,
		"bob's ticket": bobs.Ticket, "the operator's ticket": mine2.Ticket,
		"bob's token": tokBob, "the operator's token": tokOps,
	} {
		if secret == "" {
			t.Fatalf("%s is empty: the check would prove nothing", what)
		}
		if strings.Contains(html, secret) || strings.Contains(snapshot, secret) {
			t.Errorf("the console shows %s", what)
		}
	}

	// Accessible markup: a captioned table with column headers, row headers
	// for the lease ids, and named buttons.
	var a11y struct {
		Caption, ColHeaders, RowHeaders, NamedButtons int
	}
	eval(`({
		Caption: document.querySelectorAll('table#leases > caption').length,
		ColHeaders: document.querySelectorAll('table#leases thead th[scope=col]').length,
		RowHeaders: document.querySelectorAll('table#leases tbody th[scope=row]').length,
		NamedButtons: [...document.querySelectorAll('table#leases button')].filter(b => b.getAttribute('aria-label')).length,
	})`, &a11y)
	if a11y.Caption != 1 || a11y.ColHeaders != 9 || a11y.RowHeaders != 2 || a11y.NamedButtons != 1 {
		t.Errorf("table markup: %+v, want 1 caption, 9 column headers, 2 row headers, 1 named button", a11y)
	}
}
