package config

import (
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"

	"github.com/nexus-broker/nexus-broker/internal/config/core"
)

// validateAdvertise enforces the advertise_addr rules, normalizes the value
// (trimmed, no trailing /) and records the two WARN shapes.
//
// The WARN texts are upstream's, word for word: operators grep for them.
func (c *Config) validateAdvertise() error {
	a := strings.TrimSpace(c.AdvertiseAddr)
	c.AdvertiseAddr = a
	if a == "" {
		if c.ListenHost() == "" {
			c.Warnings = append(c.Warnings, WarnNoAdvertise)
		}
		return nil
	}
	scheme, _, qualified := strings.Cut(a, "://")
	raw := a
	if !qualified {
		raw = "ws://" + a // a bare host:port keeps the ws:// scheme
	}
	switch scheme {
	case "ws", "http":
	case "wss", "https":
		c.Warnings = append(c.Warnings, WarnTLSScheme)
	default:
		if qualified {
			return fmt.Errorf("broker config: advertise_addr: scheme %q is not one of ws, wss, http, https; write host:port or one of those schemes followed by host:port", scheme)
		}
	}
	u, err := url.Parse(raw)
	if err != nil {
		return fmt.Errorf("broker config: advertise_addr: %q is not host:port or scheme://host:port (%v); write the address clients use, such as broker-1.example.com:8080", a, err)
	}
	if u.User != nil || (u.Path != "" && u.Path != "/") || u.RawQuery != "" || u.ForceQuery || u.Fragment != "" {
		return fmt.Errorf("broker config: advertise_addr: %q carries a path, query or user; give only host:port or scheme://host:port", a)
	}
	c.AdvertiseAddr = strings.TrimSuffix(a, "/")
	if core.IsWildcard(u.Hostname()) {
		return fmt.Errorf("broker config: advertise_addr: %q names a wildcard host, which no client can dial; give the address clients use to reach this broker", a)
	}
	// A scheme implies its port (the spec's own wss://broker-1.example.com);
	// a bare address has none to imply.
	port := u.Port()
	if port == "" && (!qualified || strings.HasSuffix(u.Host, ":")) {
		return fmt.Errorf("broker config: advertise_addr: %q has no port; write host:port, such as broker-1.example.com:8080", a)
	}
	if p, err := strconv.Atoi(port); port != "" && (err != nil || p < 1 || p > 65535) {
		return fmt.Errorf("broker config: advertise_addr: port %q is not a port number (1 to 65535)", port)
	}
	return nil
}

// ListenLoopback reports whether listen_addr binds loopback only.
func (c *Config) ListenLoopback() bool {
	host := c.ListenHost()
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// The two advertise_addr WARNs. They are logged with listen_addr and
// advertise_addr as attributes.
const (
	WarnNoAdvertise = "advertise_addr is not set and listen_addr names no host: " +
		"the ws_url returned by POST /claim will be derived from each claim request's Host header, " +
		"which behind a reverse proxy or load balancer names the proxy rather than this broker " +
		"and can send a client to a broker that does not hold its lease; " +
		"set advertise_addr to the address clients use to reach this broker"
	WarnTLSScheme = "advertise_addr names a TLS scheme but this broker serves cleartext: " +
		"it has no TLS listener, so the wss:// ws_url returned by POST /claim is correct " +
		"ONLY if a TLS-terminating proxy fronts this broker; " +
		"expected behind such a proxy, and a misconfiguration otherwise"
)

// ListenHost is listen_addr's host when it names one, "" for a wildcard bind
// (":8080", "0.0.0.0:8080", "[::]:8080"). The gateway builds ws_url from the
// request's Host exactly when this is "", which is the shape the boot WARN is
// about, so both read it from here.
func (c *Config) ListenHost() string {
	host, _, err := net.SplitHostPort(c.ListenAddr)
	if err != nil || core.IsWildcard(host) {
		return ""
	}
	return host
}
