// Package hostguard refuses requests whose Host header names none of this
// broker's addresses, the defence against DNS rebinding for a broker
// without an auth: block: a page on evil.example that rebinds its name to
// 127.0.0.1 reaches the broker from the victim's browser, but with
// "Host: evil.example", so it is answered 421 and never reaches the
// console or the API.
//
// It imports nothing of the project but the reply envelope.
package hostguard

import (
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"slices"
	"strings"

	"github.com/nexus-broker/nexus-broker/internal/gateway/reply"
)

// Guard knows the names this broker answers to. The zero value accepts
// the loopback names only.
type Guard struct {
	names map[string]bool                 // lower-case host names, no trailing dot
	addrs map[netip.Addr]bool             // unmapped addresses
	local func() ([]string, []netip.Addr) // this host's hostname and interface addresses; nil unless listen_addr is a wildcard and advertise_addr unset
}

// New is the guard for a broker listening on listenAddr (host:port) and
// advertised at advertiseAddr (empty, host:port or scheme://host[:port]):
// it accepts the loopback names (localhost and every loopback address),
// listen_addr's host (for a wildcard, the unspecified addresses the
// broker logs it as) and advertise_addr's host. With a wildcard listen
// address and no advertise_addr, a claim's ws_url is built from its Host,
// so it also accepts this host's name and its interfaces' addresses, read
// afresh whenever a Host matches nothing else (addresses change).
func New(listenAddr, advertiseAddr string) *Guard {
	g := &Guard{names: map[string]bool{}, addrs: map[netip.Addr]bool{}}
	listen := ""
	if h, _, err := net.SplitHostPort(listenAddr); err == nil {
		listen = h
	}
	if a := strings.TrimSpace(advertiseAddr); a != "" {
		if _, rest, ok := strings.Cut(a, "://"); ok {
			a = rest
		}
		g.add(strings.TrimSuffix(a, "/"))
	}
	if ip, err := netip.ParseAddr(listen); listen == "" || (err == nil && ip.IsUnspecified()) {
		// The listen address as the broker logs it ([::]:8080), which
		// reaches this host like loopback does.
		g.addrs[netip.IPv4Unspecified()], g.addrs[netip.IPv6Unspecified()] = true, true
		if strings.TrimSpace(advertiseAddr) == "" {
			g.local = localNames
		}
	} else {
		g.add(listen)
	}
	return g
}

// add accepts host, given as a Host header would carry it.
func (g *Guard) add(host string) {
	name, ip := parse(host)
	if ip.IsValid() {
		g.addrs[ip] = true
	} else if name != "" {
		g.names[name] = true
	}
}

// parse splits a Host value (name, name:port, IP, IP:port, [IPv6],
// [IPv6]:port) into its lower-case name without a trailing dot, or its
// address when it is one; neither when its port is not a number.
func parse(host string) (string, netip.Addr) {
	if h, port, err := net.SplitHostPort(host); err == nil {
		if strings.Trim(port, "0123456789") != "" {
			return "", netip.Addr{} // "[::1]:80.evil.example" is no Host
		}
		host = h
	} else if strings.HasPrefix(host, "[") && strings.HasSuffix(host, "]") {
		host = host[1 : len(host)-1]
	}
	if ip, err := netip.ParseAddr(host); err == nil && ip.Zone() == "" {
		return "", ip.Unmap()
	}
	return strings.TrimSuffix(strings.ToLower(host), "."), netip.Addr{}
}

// Allows reports whether host (a request's Host) names this broker.
func (g *Guard) Allows(host string) bool {
	name, ip := parse(host)
	if ip.IsValid() {
		if ip.IsLoopback() || g.addrs[ip] {
			return true
		}
	} else if name == "localhost" || g.names[name] {
		return true
	}
	if g.local == nil || (name == "" && !ip.IsValid()) {
		return false
	}
	names, addrs := g.local()
	if ip.IsValid() {
		return slices.Contains(addrs, ip)
	}
	return slices.Contains(names, name)
}

// localNames is this host's hostname and its interfaces' addresses.
func localNames() ([]string, []netip.Addr) {
	var names []string
	if h, err := os.Hostname(); err == nil {
		names = append(names, strings.TrimSuffix(strings.ToLower(h), "."))
	}
	var addrs []netip.Addr
	ifaddrs, _ := net.InterfaceAddrs()
	for _, a := range ifaddrs {
		if p, err := netip.ParsePrefix(a.String()); err == nil {
			addrs = append(addrs, p.Addr().Unmap())
		}
	}
	return names, addrs
}

// Reason is why a request was refused 421, as the audit record says it.
const Reason = "Host names no address of this broker"

// OriginReason is why a request was refused 403 for its Origin.
const OriginReason = "Origin names no address of this broker"

// Exempt reports whether path is answered whatever the Host: the probes.
func Exempt(path string) bool { return path == "/healthz" || path == "/readyz" }

// AllowsOrigin reports whether a request's Origin header may reach the
// broker: absent (not a browser, or a same-origin GET), or an http or https
// origin whose host g allows. A browser names the page's origin on every
// cross-origin request and WebSocket handshake, so a page served elsewhere
// (a cross-site form or fetch, "null" from a sandboxed frame or a file)
// cannot drive an open broker even through an allowed Host.
func (g *Guard) AllowsOrigin(origin string) bool {
	if origin == "" {
		return true
	}
	u, err := url.Parse(origin)
	return err == nil && (u.Scheme == "http" || u.Scheme == "https") && u.Host != "" && u.Path == "" && u.RawQuery == "" && g.Allows(u.Host)
}

// Wrap answers, before h sees it, every request but the probes whose Host g
// does not allow with 421 Misdirected Request, and every one whose Origin
// it does not allow with 403. refused is told of each refusal and its
// reason (the audit record).
func (g *Guard) Wrap(h http.Handler, refused func(r *http.Request, status int, reason string)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if Exempt(r.URL.Path) {
			h.ServeHTTP(w, r)
			return
		}
		if !g.Allows(r.Host) {
			refused(r, http.StatusMisdirectedRequest, Reason)
			reply.Error(w, http.StatusMisdirectedRequest, fmt.Sprintf("misdirected request: Host %q names no address of this broker; without an auth: block it answers only to its loopback names, listen_addr's host and advertise_addr's host", r.Host))
			return
		}
		if origins := r.Header.Values("Origin"); len(origins) > 1 || (len(origins) == 1 && !g.AllowsOrigin(origins[0])) {
			refused(r, http.StatusForbidden, OriginReason)
			reply.Error(w, http.StatusForbidden, fmt.Sprintf("cross-origin request refused: Origin %q names no address of this broker; without an auth: block it answers browsers only on pages of its loopback names, listen_addr's host and advertise_addr's host", strings.Join(origins, ", ")))
			return
		}
		h.ServeHTTP(w, r)
	})
}
