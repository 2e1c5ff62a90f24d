package config

import (
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/config/core"
)

// specAgentsExample is the listing of "The A2A front door (agents:)".
const specAgentsExample = `# broker.yaml
advertise_addr: "https://broker.example"    # the origin the agent cards advertise
state_dir: "~/.nexus/broker"                # needed for continuity across a restart

agents:
  support:
    binary: nexus                           # optional; omitted means the reserved ` + "`nexus`" + ` entry
    config: "~/agents/support.yaml"         # the nexus config instances of this profile boot with
    card:
      name: "Support Agent"
      description: "Answers customer questions from the product knowledge base."
      version: "1.2.0"
      skills:
        - id: "answer"
          name: "Answer questions"
          description: "Answers a customer question and cites its sources."

a2a:                                        # optional; every value below is the default
  tasks:
    ttl: "24h"                              # how long a finished task stays readable
    max_per_context: 50                     # tasks kept per (caller, conversation)
    input_timeout: "15m"                    # how long a question may wait on a human
`

func TestSpecAgentsExample(t *testing.T) {
	c := mustParse(t, specAgentsExample)
	want := map[string]*Agent{"support": {
		Binary: "nexus",
		Config: "~/agents/support.yaml",
		Card: Card{
			Name: "Support Agent", Description: "Answers customer questions from the product knowledge base.", Version: "1.2.0",
			Skills: []Skill{{ID: "answer", Name: "Answer questions", Description: "Answers a customer question and cites its sources."}},
		},
	}}
	if !reflect.DeepEqual(c.Agents, want) {
		t.Errorf("agents = %+v, want %+v", c.Agents["support"], want["support"])
	}
	if c.A2A != defaultA2A() {
		t.Errorf("a2a = %+v, want the defaults %+v", c.A2A, defaultA2A())
	}
}

func TestAgentsNormalized(t *testing.T) {
	c := mustParse(t, `listen_addr: "127.0.0.1:8080"
binaries: {vision: {path: /opt/v}}
agents:
  " research.v2 ": {binary: " vision ", config: c.yaml, card: {name: R, description: D, version: "2"}}
  plain: {config: c.yaml, card: {name: P, description: D, version: "1"}}
a2a: {tasks: {input_timeout: 0s, max_store_bytes: 1024}}
`)
	if a := c.Agents["research.v2"]; a == nil || a.Binary != "vision" {
		t.Errorf("trimmed profile = %+v", a)
	}
	if a := c.Agents["plain"]; a == nil || a.Binary != core.ReservedEntry {
		t.Errorf("a profile naming no binary gets %+v, want the reserved entry", a)
	}
	if c.A2A.Tasks.InputTimeout != 0 || c.A2A.Tasks.MaxStoreBytes != 1024 || c.A2A.Tasks.TTL.D() != 24*time.Hour {
		t.Errorf("a2a.tasks = %+v", c.A2A.Tasks)
	}
	t.Setenv("HOME", "/home/nb")
	for _, tc := range []struct{ yaml, want string }{
		{"", ""}, // neither: the store is in memory
		{"state_dir: /var/lib/nb\n", "/var/lib/nb"},
		{"state_dir: ~/.nexus/broker\n", "/home/nb/.nexus/broker"}, // as spawnd expands it
		{"state_dir: /var/lib/nb\na2a: {state_dir: /var/lib/gw}\n", "/var/lib/gw"},
	} {
		if d, err := mustParse(t, tc.yaml).A2AStateDir(); err != nil || d != tc.want {
			t.Errorf("%q: the A2A store is in %q (%v), want %q", tc.yaml, d, err, tc.want)
		}
	}
	t.Setenv("HOME", "")
	if _, err := mustParse(t, "state_dir: ~/x\n").A2AStateDir(); err == nil || !strings.Contains(err.Error(), "state_dir") || !strings.Contains(err.Error(), "no HOME") {
		t.Errorf("state_dir ~/x without HOME: %v, want an error naming state_dir and HOME", err)
	}
	if c := mustParse(t, "agents: {}\n"); c.Agents != nil {
		t.Errorf("agents: {} parsed as %v, want no profiles", c.Agents)
	}
}

const okCard = "card: {name: S, description: D, version: \"1\"}"

var agentErrorCases = []struct{ name, yaml, key, want string }{
	{"name with a slash", "agents: {\"a/b\": {config: c, " + okCard + "}}", "agents.a/b", "letters, digits, -, _ and . only"},
	{"name with a space inside", "agents: {\"a b\": {config: c, " + okCard + "}}", "agents.a b", "URL path segment"},
	{"dot segment", "agents: {\"..\": {config: c, " + okCard + "}}", "agents...", "dot segment"},
	{"empty name", "agents: {\" \": {config: c, " + okCard + "}}", "agents", "empty once whitespace is trimmed"},
	{"names collide once trimmed", "agents: {\"s \": {config: c, " + okCard + "}, s: {config: c, " + okCard + "}}", "agents.s", "same profile name once surrounding whitespace is trimmed"},
	{"unknown binary", "agents: {s: {binary: vision, config: c, " + okCard + "}}", "agents.s.binary", `unknown entry "vision"; this broker spawns: nexus`},
	{"no config", "agents: {s: {" + okCard + "}}", "agents.s.config", "required"},
	{"no card name", "agents: {s: {config: c, card: {description: D, version: \"1\"}}}", "agents.s.card.name", "required"},
	{"no card version", "agents: {s: {config: c, card: {name: N, description: D}}}", "agents.s.card.version", "required"},
	{"skill without id", "agents: {s: {config: c, card: {name: N, description: D, version: \"1\", skills: [{name: a, description: b}]}}}", "agents.s.card.skills[0].id", "required"},
	{"skill listed twice", "agents: {s: {config: c, card: {name: N, description: D, version: \"1\", skills: [{id: a, name: a, description: b}, {id: a, name: a, description: b}]}}}", "agents.s.card.skills[1].id", "listed twice"},
	{"unknown card key", "agents: {s: {config: c, card: {name: N, description: D, version: \"1\", url: x}}}", "agents.s.card.url", "unknown key"},
	{"configured capabilities", "agents: {s: {config: c, capabilities: {streaming: true}, " + okCard + "}}", "agents.s.capabilities", "unknown key"},
	{"half a provider", "agents: {s: {config: c, card: {name: N, description: D, version: \"1\", provider: {organization: o}}}}", "agents.s.card.provider", "both organization and url"},
	{"wildcard bind without advertise_addr", "listen_addr: \":8080\"\nagents: {s: {config: c, " + okCard + "}}", "advertise_addr", "required with agents: profiles"},
	{"ttl zero", "a2a: {tasks: {ttl: 0s}}", "a2a.tasks.ttl", "must be positive"},
	{"max_per_context zero", "a2a: {tasks: {max_per_context: 0}}", "a2a.tasks.max_per_context", "must be positive"},
	{"input_timeout negative", "a2a: {tasks: {input_timeout: -1s}}", "a2a.tasks.input_timeout", "must not be negative"},
	{"relative a2a.state_dir", "a2a: {state_dir: gw}", "a2a.state_dir", "must be an absolute path"},
	{"unknown a2a key", "a2a: {task: {ttl: 1h}}", "a2a.task", "unknown key; the keys allowed here are state_dir, tasks"},
}

func TestAgentErrors(t *testing.T) {
	for _, tc := range agentErrorCases {
		t.Run(tc.name, func(t *testing.T) {
			yaml := tc.yaml
			if !strings.Contains(yaml, "listen_addr") {
				yaml = "listen_addr: \"127.0.0.1:8080\"\n" + yaml
			}
			c, err := Parse([]byte(yaml))
			if err == nil {
				t.Fatalf("parsed as %+v; want an error naming %q", c, tc.key)
			}
			msg := err.Error()
			if prefix := "broker config: " + tc.key + ": "; !strings.HasPrefix(msg, prefix) {
				t.Errorf("error %q\ndoes not start %q", msg, prefix)
			}
			if !strings.Contains(msg, tc.want) {
				t.Errorf("error %q\ndoes not say %q", msg, tc.want)
			}
		})
	}
}
