package e2e

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/a2aproject/a2a-go/v2/a2a"
)

// getCard fetches ref resolved against base as a browser or the JS SDK's
// createFromUrl does (RFC 3986: without a trailing slash the last segment
// is replaced), following redirects; it answers the status and the card's
// name.
func getCard(t *testing.T, base, ref string) (int, string, string) {
	t.Helper()
	u, err := url.Parse(base)
	if err != nil {
		t.Fatal(err)
	}
	r, _ := url.Parse(ref)
	resp, err := http.Get(u.ResolveReference(r).String())
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var card struct {
		Name  string `json:"name"`
		Error string `json:"error"`
	}
	_ = json.NewDecoder(resp.Body).Decode(&card)
	return resp.StatusCode, card.Name, card.Error
}

// TestA2ACardFromProfileURL: a profile's URL with or without its trailing
// slash leads to its card, as a browser follows it and as the JS SDK
// resolves the well-known name against it: served when one profile is
// mounted, a 404 naming the profiles and the URL that works when several.
func TestA2ACardFromProfileURL(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "solo.yaml")
	if err := os.WriteFile(cfg, []byte("engine:\n  name: solo\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	solo := startBroker(t, Options{YAML: fmt.Sprintf("agents:\n  solo: {config: %q, card: {name: Solo, description: D, version: \"1\"}}\n", cfg)})
	for _, base := range []string{solo.Base + "/agents/solo", solo.Base + "/agents/solo/"} {
		for _, ref := range []string{".well-known/agent-card.json", ""} {
			if code, name, _ := getCard(t, base, ref); code != 200 || name != "Solo" {
				t.Errorf("card from %q + %q: %d %q, want 200 Solo", base, ref, code, name)
			}
		}
	}
	c := a2aClient(t, solo, "solo", a2a.TransportProtocolJSONRPC)
	if got := answerOf(t, sendTask(t, c, userMsg("solo", "hi"))); got != "echo #1: hi" {
		t.Errorf("solo answered %q", got)
	}

	many := a2aBroker(t, "", Options{})
	for _, base := range []string{many.Base + "/agents/support", many.Base + "/agents/support/"} {
		if code, name, _ := getCard(t, base, ""); code != 200 || name != "Support Agent" {
			t.Errorf("profile URL %q: %d %q, want its card", base, code, name)
		}
	}
	if code, name, _ := getCard(t, many.Base+"/agents/support/", ".well-known/agent-card.json"); code != 200 || name != "Support Agent" {
		t.Errorf("card from the profile URL with its slash: %d %q", code, name)
	}
	code, _, msg := getCard(t, many.Base+"/agents/support", ".well-known/agent-card.json")
	if code != 404 || !strings.Contains(msg, "5 agent profiles (crashy, late, lazy, slow, support)") || !strings.Contains(msg, "/agents/<name>/") {
		t.Errorf("the JS SDK's resolution on a broker of several profiles: %d %q, want 404 naming them and the form that works", code, msg)
	}
	if code, _, _ := getCard(t, many.Base+"/agents/nope", ""); code != 404 {
		t.Errorf("an unknown profile's URL: %d, want 404", code)
	}
}

// TestA2APushNotSupported: every push-notification operation, on both
// bindings, is PushNotificationNotSupported to the official client's
// errors.Is, as the card's pushNotifications false says.
func TestA2APushNotSupported(t *testing.T) {
	b := a2aBroker(t, "", Options{})
	for _, binding := range bindings {
		t.Run(string(binding), func(t *testing.T) {
			c := a2aClient(t, b, "support", binding)
			task := sendTask(t, c, userMsg("push-"+string(binding), "hi"))
			ctx := ctxT(t)
			_, create := c.CreateTaskPushConfig(ctx, &a2a.PushConfig{TaskID: task.ID, URL: "https://example.com/hook"})
			_, get := c.GetTaskPushConfig(ctx, &a2a.GetTaskPushConfigRequest{TaskID: task.ID, ID: "c"})
			_, list := c.ListTaskPushConfigs(ctx, &a2a.ListTaskPushConfigRequest{TaskID: task.ID})
			del := c.DeleteTaskPushConfig(ctx, &a2a.DeleteTaskPushConfigRequest{TaskID: task.ID, ID: "c"})
			for op, err := range map[string]error{"create": create, "get": get, "list": list, "delete": del} {
				if !errors.Is(err, a2a.ErrPushNotificationNotSupported) || !strings.Contains(err.Error(), "does not deliver push notifications") {
					t.Errorf("%s push config: %v, want PushNotificationNotSupported", op, err)
				}
			}
		})
	}
}
