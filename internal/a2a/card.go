package a2a

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"sort"
	"strings"

	"github.com/nexus-broker/nexus-broker/internal/config"
)

// The agents: profiles as the A2A door serves them: each profile's config
// and its rendered agent card.

// Profile is one agents: profile as served: its entry, the config its
// instances boot with, and its rendered card.
type Profile struct {
	Name   string
	Entry  string
	Path   string // the config file, resolved
	Config []byte
	Card   []byte
	ETag   string // of Card, its content's digest
}

// Profiles is every profile, swapped whole on a reload.
type Profiles struct{ ByName map[string]*Profile }

// BuildProfiles reads every profile's config file and renders every card; a
// failure anywhere leaves nothing half-built.
// The card's base URL and security come from the boot configuration (both
// are boot-only), the profiles from cfg.
func BuildProfiles(cfg *config.Config, boot *config.Config, base string) (*Profiles, error) {
	ps := &Profiles{ByName: map[string]*Profile{}}
	for name, a := range cfg.Agents {
		path, data, err := config.ReadEngineConfig(a.Config)
		if err != nil {
			return nil, fmt.Errorf("agents.%s.config: %w (the nexus config instances of this profile boot with)", name, err)
		}
		if a.WarmConfig != nil {
			data = a.WarmConfig // what its pool's instances booted with, byte for byte
		}
		card, err := json.Marshal(renderCard(name, a, base, boot.Auth))
		if err != nil {
			return nil, fmt.Errorf("agents.%s.card: %w", name, err)
		}
		sum := sha256.Sum256(card)
		ps.ByName[name] = &Profile{Name: name, Entry: a.Binary, Path: path, Config: data, Card: card, ETag: `"` + hex.EncodeToString(sum[:16]) + `"`}
	}
	return ps, nil
}

type cardJSON struct {
	Name                string           `json:"name"`
	Description         string           `json:"description"`
	Version             string           `json:"version"`
	SupportedInterfaces []cardInterface  `json:"supportedInterfaces"`
	Capabilities        cardCapabilities `json:"capabilities"`
	DefaultInputModes   []string         `json:"defaultInputModes"`
	DefaultOutputModes  []string         `json:"defaultOutputModes"`
	Skills              []cardSkill      `json:"skills"`
	Provider            *cardProvider    `json:"provider,omitempty"`
	DocumentationURL    string           `json:"documentationUrl,omitempty"`
	IconURL             string           `json:"iconUrl,omitempty"`
	SecuritySchemes     map[string]any   `json:"securitySchemes,omitempty"`
	SecurityRequirement []map[string]any `json:"securityRequirements,omitempty"`
}

type cardInterface struct {
	URL             string `json:"url"`
	ProtocolBinding string `json:"protocolBinding"`
	ProtocolVersion string `json:"protocolVersion"`
}

type cardCapabilities struct {
	Streaming         bool `json:"streaming"`
	PushNotifications bool `json:"pushNotifications"`
	ExtendedAgentCard bool `json:"extendedAgentCard"`
}

type cardSkill struct {
	ID          string   `json:"id"`
	Name        string   `json:"name"`
	Description string   `json:"description"`
	Tags        []string `json:"tags"`
	Examples    []string `json:"examples,omitempty"`
	InputModes  []string `json:"inputModes,omitempty"`
	OutputModes []string `json:"outputModes,omitempty"`
}

type cardProvider struct {
	Organization string `json:"organization"`
	URL          string `json:"url"`
}

// TextModes is what the ingress accepts and produces: the IO envelope
// carries one string each way.
var TextModes = []string{"text/plain"}

// orText is modes, or text/plain when the operator named none.
func orText(modes []string) []string {
	if len(modes) == 0 {
		return TextModes
	}
	return modes
}

// renderCard is the operator's identity plus what the broker derives: the
// interfaces it serves, its capabilities, and the credential its auth:
// chain accepts.
func renderCard(name string, a *config.Agent, base string, authCfg *config.Auth) cardJSON {
	root := AgentRoot(base, name) + "/a2a"
	c := cardJSON{
		Name: a.Card.Name, Description: a.Card.Description, Version: a.Card.Version,
		SupportedInterfaces: []cardInterface{
			{URL: root, ProtocolBinding: "JSONRPC", ProtocolVersion: ProtocolVersion},
			{URL: root + "/v1", ProtocolBinding: "HTTP+JSON", ProtocolVersion: ProtocolVersion},
		},
		Capabilities:       cardCapabilities{Streaming: true},
		DefaultInputModes:  orText(a.Card.DefaultInputModes),
		DefaultOutputModes: orText(a.Card.DefaultOutputModes),
		Skills:             []cardSkill{},
		DocumentationURL:   a.Card.DocumentationURL,
		IconURL:            a.Card.IconURL,
	}
	c.SecuritySchemes, c.SecurityRequirement = securityOf(authCfg)
	if p := a.Card.Provider; p != nil {
		c.Provider = &cardProvider{Organization: p.Organization, URL: p.URL}
	}
	for _, s := range a.Card.Skills {
		tags := s.Tags
		if tags == nil {
			tags = []string{}
		}
		c.Skills = append(c.Skills, cardSkill{ID: s.ID, Name: s.Name, Description: s.Description, Tags: tags, Examples: s.Examples,
			InputModes: s.InputModes, OutputModes: s.OutputModes})
	}
	return c
}

// securityOf derives the card's security from the auth: chain as upstream
// does: one bearer scheme per validator a client presents a credential to,
// named as the chain names it (its type, "jwks#2" for the second jwks), with
// upstream's description, and one requirement per scheme since any one
// validator suffices. proxy_headers takes no client credential and is not
// advertised; without auth: there is no security at all. (A requirement's
// scopes are an array, which the A2A clients read.)
func securityOf(a *config.Auth) (map[string]any, []map[string]any) {
	if a == nil {
		return nil, nil
	}
	schemes := map[string]any{}
	var reqs []map[string]any
	names := a.ValidatorNames()
	for i, v := range a.Validators {
		name := names[i]
		scheme := map[string]any{"scheme": "Bearer"}
		switch v.Type {
		case config.ValidatorStatic:
			scheme["description"] = "Shared bearer token issued out-of-band by the operator of this broker."
		case config.ValidatorJWKS:
			d := "OIDC JWT access token, verified against the issuer's published key set."
			if iss := strings.TrimSpace(v.Issuer); iss != "" {
				d += " Issuer: " + iss + "."
			}
			if aud := strings.Join(v.Audience, ", "); aud != "" {
				d += " Audience: " + aud + "."
			}
			scheme["description"], scheme["bearerFormat"] = d, "JWT"
		case config.ValidatorIntrospect:
			scheme["description"] = "Opaque bearer token, verified by RFC 7662 introspection at the issuer."
		default:
			continue
		}
		schemes[name] = map[string]any{"httpAuthSecurityScheme": scheme}
		reqs = append(reqs, map[string]any{"schemes": map[string]any{name: []string{}}})
	}
	if len(schemes) == 0 {
		return nil, nil
	}
	return schemes, reqs
}

// AgentRoot is where a profile's routes live.
func AgentRoot(base, name string) string { return base + "/agents/" + name }

// Names are the profiles' names, sorted (for logs).
func (ps *Profiles) Names() []string {
	out := make([]string, 0, len(ps.ByName))
	for n := range ps.ByName {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// ETagMatches is If-None-Match against one strong validator: a list, "*",
// and weak forms compared weakly.
func ETagMatches(header, etag string) bool {
	for c := range strings.SplitSeq(header, ",") {
		c = strings.TrimPrefix(strings.TrimSpace(c), "W/")
		if c == "*" || c == etag {
			return true
		}
	}
	return false
}
