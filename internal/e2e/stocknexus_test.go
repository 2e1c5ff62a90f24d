package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// The stock nexus engine, built from upstream's source, is not something CI
// can build (its module is not served by the proxy): these tests take the
// binary from NEXUS_STOCK_NEXUS, or build it from NEXUS_UPSTREAM_SRC
// (upstreamBinary), and skip without either.
const stockNexusEnv = "NEXUS_STOCK_NEXUS"

// stockEngine is the stock nexus engine's path, or skips t.
func stockEngine(t testing.TB) string {
	t.Helper()
	engine := upstreamBinary(t, stockNexusEnv, "./cmd/nexus")
	if engine == "" {
		t.Skipf("neither %s nor %s is set: they name a stock nexus engine built from upstream's source, or that source, which CI does not have", stockNexusEnv, UpstreamSrcEnv)
	}
	return engine
}

// llmStub is an OpenAI-compatible chat completions endpoint on loopback
// whose answer lists every user message it was sent ("stub heard N: a | b"),
// so an engine's memory shows; a message longer than 40 bytes is listed by
// its start and length. It streams when asked to, in chunks.
func llmStub(t testing.TB) string {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Stream   bool `json:"stream"`
			Messages []struct {
				Role    string          `json:"role"`
				Content json.RawMessage `json:"content"`
			} `json:"messages"`
		}
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		var users []string
		for _, m := range req.Messages {
			if m.Role != "user" {
				continue
			}
			var s string
			if json.Unmarshal(m.Content, &s) != nil {
				s = string(m.Content)
			}
			if len(s) > 40 {
				s = fmt.Sprintf("%s…(%d bytes)", s[:20], len(s))
			}
			users = append(users, s)
		}
		text := fmt.Sprintf("stub heard %d: %s", len(users), strings.Join(users, " | "))
		usage := map[string]int{"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
		if !req.Stream {
			w.Header().Set("Content-Type", "application/json")
			_ = json.NewEncoder(w).Encode(map[string]any{"id": "x", "object": "chat.completion", "model": "stub", "usage": usage,
				"choices": []any{map[string]any{"index": 0, "finish_reason": "stop", "message": map[string]string{"role": "assistant", "content": text}}}})
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		chunk := func(delta map[string]string, finish any, extra map[string]any) {
			c := map[string]any{"id": "x", "object": "chat.completion.chunk", "model": "stub",
				"choices": []any{map[string]any{"index": 0, "delta": delta, "finish_reason": finish}}}
			for k, v := range extra {
				c[k] = v
			}
			data, _ := json.Marshal(c)
			fmt.Fprintf(w, "data: %s\n\n", data)
		}
		for i := 0; i < len(text); i += 16 {
			chunk(map[string]string{"content": text[i:min(i+16, len(text))]}, nil, nil)
		}
		chunk(map[string]string{}, "stop", map[string]any{"usage": usage})
		fmt.Fprint(w, "data: [DONE]\n\n")
	}))
	t.Cleanup(srv.Close)
	return srv.URL + "/v1/chat/completions"
}

// stockNexus starts a broker whose nexus entry is the stock engine, and
// returns it with the engine config a claim sends (the broker IO plugin, a
// ReAct agent with memory, and the OpenAI provider pointed at llmStub).
// Its instances' HOME, where their sessions are kept, is the test's own.
func stockNexus(t *testing.T) (*Broker, string) {
	t.Helper()
	return stockNexusWith(t, nil, Options{})
}

// stockNexusWith is stockNexus with o, and with yaml(cfg) appended to the
// broker's YAML when yaml is not nil (a pool booted with cfg, say).
func stockNexusWith(t testing.TB, yaml func(cfg string) string, o Options) (*Broker, string) {
	t.Helper()
	engine := stockEngine(t)
	home := t.TempDir()
	cfg := fmt.Sprintf(`core:
  log_level: warn
  models:
    default: quick
    quick: {provider: nexus.llm.openai, model: gpt-4o-mini, max_tokens: 512}
  sessions: {root: %q, retention: 1d}
plugins:
  active: [nexus.io.broker, nexus.llm.openai, nexus.agent.react, nexus.memory.capped]
  nexus.llm.openai: {api_key: dummy, base_url: %q}
`, filepath.Join(home, ".nexus", "sessions"), llmStub(t))
	o.NoNexusEntry = true
	o.YAML = fmt.Sprintf(`binaries:
  nexus:
    path: %q
    env: {OPENAI_API_KEY: dummy, HOME: %q}
`, engine, home) + o.YAML
	if yaml != nil {
		o.YAML += yaml(cfg)
	}
	b := startBroker(t, o)
	// The harness ends the nexus-echo instances a test leaves; the stock
	// engine's it ends here, before the broker's cleanup kills spawnd.
	exe, err := filepath.EvalSymlinks(engine)
	if err != nil {
		t.Fatalf("%s=%q: %v", stockNexusEnv, engine, err)
	}
	if exe, err = filepath.Abs(exe); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { killGroupsOf(processesOf(exe, home)) })
	return b, cfg
}

// TestStockNexusInputOverMaxClientFrameIs1009: against the stock engine,
// which reads at most 32 KiB on its dial-back socket, a frame of exactly
// max_client_frame reaches the model; a 40 KiB input is refused with 1009
// naming the limit and the key, never relayed for the engine to drop; the
// lease answers a reconnect, and the model's memory shows the turns that
// reached it and not the refused one.
func TestStockNexusInputOverMaxClientFrameIs1009(t *testing.T) {
	b, cfg := stockNexus(t)
	c := b.claim(brokerclient.ClaimRequest{Config: cfg})
	conn := b.dial(c, brokerclient.DialOptions{})
	if got := say(t, conn, "hello"); got != "stub heard 1: hello" {
		t.Fatalf("the stock engine's first turn: %q", got)
	}
	if err := conn.WriteRaw(ioFrameOf(t, c.LeaseID, 32768)); err != nil {
		t.Fatal(err)
	}
	if got, err := answerWithin(conn); err != nil || !strings.HasPrefix(got, "stub heard 2: hello | xxxxxxxxxxxxxxxxxxxx…(") {
		t.Fatalf("a frame of exactly max_client_frame: %q, %v; want the model to have it", got, err)
	}

	conn = b.dial(c, brokerclient.DialOptions{})
	bare := bareInput(t, 40<<10)
	wrapped := len(bare) + len(fmt.Sprintf(`{"version":1,"lease_id":%q,"signal":"io","payload":}`, c.LeaseID))
	refusedWith1009(t, conn, bare, fmt.Sprintf("frame of %d bytes exceeds max_client_frame (32768 bytes)", wrapped))
	if l, ok := b.lease(c.LeaseID); !ok || l.State != "active" {
		t.Fatalf("after the refusal the lease is %+v (listed %v), want it active", l, ok)
	}
	conn = b.dial(c, brokerclient.DialOptions{})
	got := say(t, conn, "again")
	if !strings.HasPrefix(got, "stub heard 3: hello | xxxxxxxxxxxxxxxxxxxx…(") || !strings.HasSuffix(got, " | again") {
		t.Fatalf("after reconnecting: %q, want the model to have heard hello, the 32 KiB input and again, and not the refused one", got)
	}
}

// answerWithin is conn's next answer, read within 30 s.
func answerWithin(conn *brokerclient.Conn) (string, error) {
	_ = conn.Underlying().SetReadDeadline(time.Now().Add(30 * time.Second))
	return conn.Answer()
}

// TestStockNexusUnderSandboxStrict: the stock engine, unchanged, under
// tenancy: with sandbox: strict and auth: claims, streams a turn through
// the stub, is released (the shutdown frame, then SIGTERM reaching the
// engine inside bubblewrap: its session is flushed to the principal's
// home, and it exits without the SIGKILL a missed SIGTERM would bring), and
// resumes with memory, twice.
func TestStockNexusUnderSandboxStrict(t *testing.T) {
	engine := stockEngine(t)
	stub := llmStub(t)
	h := startTenantHostWith(t, "strict", uidRange(60, 69), func(h *tenantHost) string {
		// A copy beside the host's, wherever the engine was built: the
		// sandbox replaces /tmp.
		h.echo = filepath.Join(h.root, "bin", "nexus")
		copyFile(t, engine, h.echo, 0o755)
		return staticAuthYAML + fmt.Sprintf("binaries:\n  nexus:\n    path: %q\n    env: {OPENAI_API_KEY: dummy}\n", h.echo)
	})
	cfg := fmt.Sprintf(`core:
  log_level: warn
  models:
    default: quick
    quick: {provider: nexus.llm.openai, model: gpt-4o-mini, max_tokens: 512}
  sessions: {root: ~/.nexus/sessions, retention: 1d}
plugins:
  active: [nexus.io.broker, nexus.llm.openai, nexus.agent.react, nexus.memory.capped]
  nexus.llm.openai: {api_key: dummy, base_url: %q}
`, stub)
	claim := func(session string) (*brokerclient.Claim, *brokerclient.Conn) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		c, err := h.as(tokAlice).Claim(ctx, brokerclient.ClaimRequest{Config: cfg, SessionID: session})
		if err != nil {
			t.Fatalf("claim (resuming %q): %v", session, err)
		}
		return c, h.dial(c, brokerclient.DialOptions{Token: tokAlice})
	}
	release := func(c *brokerclient.Claim) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		if err := h.as(tokAlice).Release(ctx, c.LeaseID); err != nil {
			t.Fatalf("release %s: %v", c.LeaseID, err)
		}
		m := h.SpawndLog.wait(t, regexp.MustCompile(`msg="instance exited" lease_id=`+c.LeaseID+` [^\n]*`), time.Minute)
		t.Logf("released: %s", m[0])
		if strings.Contains(m[0], "signal=SIGKILL") {
			t.Errorf("the engine was killed, not stopped by the shutdown frame or SIGTERM: %s", m[0])
		}
		if left := h.instances(); len(left) != 0 {
			t.Errorf("engine processes %v outlived their lease's exit", left)
		}
	}

	first, conn := claim("")
	if got := say(t, conn, "my secret is PINEAPPLE"); got != "stub heard 1: my secret is PINEAPPLE" {
		t.Fatalf("the stock engine's first turn in the sandbox: %q", got)
	}
	release(first)
	homes, err := os.ReadDir(h.homes)
	if err != nil || len(homes) != 1 {
		t.Fatalf("homes_dir holds %v (%v), want alice's home alone", homes, err)
	}
	uid, _ := strconv.Atoi(homes[0].Name())
	session := filepath.Join(h.homes, homes[0].Name(), ".nexus", "sessions", first.SessionID)
	var st syscall.Stat_t
	if err := syscall.Stat(session, &st); err != nil || int(st.Uid) != uid {
		t.Fatalf("alice's session %s after the release: %v, uid %d; want it flushed, of uid %d", session, err, st.Uid, uid)
	}
	t.Logf("alice's session, flushed under her uid %d: %s", uid, session)

	again, conn := claim(first.SessionID)
	got := say(t, conn, "what did I say?")
	if got != "stub heard 2: my secret is PINEAPPLE | what did I say?" {
		t.Errorf("the resumed engine answered %q, want the stub to have heard the first turn too", got)
	}
	t.Logf("resumed: %s", got)
	release(again)
	// Flushed at this release too (whether the shutdown frame or the
	// SIGTERM ended it): a third claim remembers both turns.
	third, conn := claim(first.SessionID)
	if got := say(t, conn, "and now?"); got != "stub heard 3: my secret is PINEAPPLE | what did I say? | and now?" {
		t.Errorf("the second resume answered %q, want the stub to have heard both earlier turns", got)
	}
	release(third)
}
