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
// and its confirmation (pressed from the keyboard) end one, and its row
// goes. Another
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

	// Release the first from the keyboard: focus its button, press Enter,
	// and Enter again on the confirmation, which has the focus.
	if err := chromedp.Do(ctx,
		chromedp.Focus(css(`button[data-release="`+mine1.LeaseID+`"]`)),
		chromedp.KeyEvent(kb.Enter),
		chromedp.WaitVisible(css(`button[data-confirm="`+mine1.LeaseID+`"]:focus`)),
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

// TestConsoleReleaseNeedsConfirmationAndRowsHold: in headless Chromium,
// two clicks 700 ms apart where a Release button is never release two
// leases. The first asks for confirmation on that row and the second,
// landing on Cancel, cancels it: nothing is sent. A confirmed release
// sends one request, and the ended lease keeps its row while the pointer
// is over the table, so a click after it lands on nothing and the other
// rows stay where they were; once the pointer leaves, the row goes.
func TestConsoleReleaseNeedsConfirmationAndRowsHold(t *testing.T) {
	b := startBroker(t, Options{})
	l1, l2, l3 := b.claim(brokerclient.ClaimRequest{}), b.claim(brokerclient.ClaimRequest{}), b.claim(brokerclient.ClaimRequest{})
	tab := startChromium(t)
	ctx, cancel := context.WithTimeout(tab, 2*time.Minute)
	defer cancel()
	row := func(id string) chromedp.CSS { return chromedp.CSS(`tr[data-lease="` + id + `"]`) }
	if err := chromedp.Do(ctx, chromedp.Navigate(b.Base+"/console"), chromedp.WaitVisible(chromedp.CSS(`#conn[data-state="live"]`)),
		chromedp.WaitVisible(row(l1.LeaseID)), chromedp.WaitVisible(row(l2.LeaseID)), chromedp.WaitVisible(row(l3.LeaseID))); err != nil {
		t.Fatalf("opening the console: %v", err)
	}
	eval := func(expr string) float64 {
		t.Helper()
		v, err := chromedp.Run(ctx, chromedp.Evaluate[float64](expr))
		if err != nil {
			t.Fatalf("evaluating %s: %v", expr, err)
		}
		return v
	}
	// Every POST the page sends is counted.
	eval(`window.posts = 0; const f = window.fetch; window.fetch = (u, o) => { if (o && o.method === "POST") window.posts++; return f(u, o); }; 0`)
	center := func(sel string) (float64, float64) {
		t.Helper()
		x := eval(`(() => { const r = document.querySelector('` + sel + `').getBoundingClientRect(); return r.x + r.width / 2; })()`)
		y := eval(`(() => { const r = document.querySelector('` + sel + `').getBoundingClientRect(); return r.y + r.height / 2; })()`)
		return x, y
	}
	top := func(id string) float64 {
		return eval(`document.querySelector('tr[data-lease="` + id + `"]').getBoundingClientRect().y`)
	}
	click := func(x, y float64) {
		t.Helper()
		if err := chromedp.Do(ctx, chromedp.MouseEvent(chromedp.MouseMoved, x, y), chromedp.MouseClickXY(x, y)); err != nil {
			t.Fatal(err)
		}
	}
	wait := func(what string, sel chromedp.CSS) {
		t.Helper()
		wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
		defer wcancel()
		if err := chromedp.Do(wctx, chromedp.WaitVisible(sel)); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	// apart waits out the 700 ms between a user's two clicks: the scenario's
	// own interval, not a synchronisation.
	apart := func(since time.Time) { time.Sleep(time.Until(since.Add(700 * time.Millisecond))) }
	y2, y3 := top(l2.LeaseID), top(l3.LeaseID)

	rx, ry := center(`button[data-release="` + l1.LeaseID + `"]`)
	first := time.Now()
	click(rx, ry)
	wait("the first click asked for no confirmation on its row", chromedp.CSS(`tr[data-lease="`+l1.LeaseID+`"] button[data-confirm="`+l1.LeaseID+`"]`))
	apart(first)
	click(rx, ry)
	wait("the second click did not cancel the confirmation", chromedp.CSS(`button[data-release="`+l1.LeaseID+`"]`))
	if n := eval(`window.posts`); n != 0 {
		t.Errorf("two clicks where Release was sent %v POSTs, want none", n)
	}
	if n := len(b.leases().Leases); n != 3 {
		t.Fatalf("%d leases live after two clicks on Release, want 3", n)
	}

	// Confirmed, then a stray click on the same place and on Release's.
	click(rx, ry)
	wait("no confirmation", chromedp.CSS(`button[data-confirm="`+l1.LeaseID+`"]`))
	cx, cy := center(`button[data-confirm="` + l1.LeaseID + `"]`)
	confirmed := time.Now()
	click(cx, cy)
	wait("the released lease did not keep its row, marked ended, under the pointer", chromedp.CSS(`tr[data-lease="`+l1.LeaseID+`"][data-ended="yes"]`))
	apart(confirmed)
	click(cx, cy)
	click(rx, ry)
	if n := eval(`window.posts`); n != 1 {
		t.Errorf("a confirmed release and two stray clicks sent %v POSTs, want 1", n)
	}
	for _, l := range []*brokerclient.Claim{l2, l3} {
		if v, ok := b.lease(l.LeaseID); !ok || v.State != "active" {
			t.Errorf("lease %s after the stray clicks: %+v (listed %v), want active", l.LeaseID, v, ok)
		}
	}
	if got2, got3 := top(l2.LeaseID), top(l3.LeaseID); got2 != y2 || got3 != y3 {
		t.Errorf("rows moved under the pointer: %v, %v, were %v, %v", got2, got3, y2, y3)
	}
	if _, ok := b.lease(l1.LeaseID); ok {
		t.Errorf("the confirmed release left %s listed", l1.LeaseID)
	}
	// The pointer leaves the table: the ended row goes.
	wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
	defer wcancel()
	if err := chromedp.Do(wctx, chromedp.MouseEvent(chromedp.MouseMoved, 2, 2), chromedp.WaitNotPresent(row(l1.LeaseID))); err != nil {
		t.Errorf("the ended row stayed after the pointer left the table: %v", err)
	}
}
