package hostguard

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"slices"
	"strings"
	"testing"
)

func TestAllows(t *testing.T) {
	local := func() ([]string, []netip.Addr) {
		return []string{"box"}, []netip.Addr{netip.MustParseAddr("192.0.2.10"), netip.MustParseAddr("2001:db8::10")}
	}
	cases := []struct {
		listen, advertise string
		allowed, refused  []string
	}{
		{"127.0.0.1:8080", "",
			[]string{"127.0.0.1:8080", "127.0.0.1", "localhost:8080", "localhost", "LOCALHOST.:9", "[::1]:8080", "[::1]", "127.8.9.10:1", "[::ffff:127.0.0.1]:8080"},
			[]string{"evil.example", "evil.example:8080", "localhost.evil.example", "192.0.2.10:8080", "box", "", "[::]:8080", "0.0.0.0:8080", "[fe80::1%25lo]:8080", "[::1]:8080.evil.example", "127.0.0.1:x", "localhost:80:80"}},
		{"10.1.2.3:8080", "broker-1.test:9000",
			[]string{"10.1.2.3:8080", "10.1.2.3", "broker-1.test", "Broker-1.Test:9000", "broker-1.test.:1", "localhost"},
			[]string{"evil.example", "10.1.2.4:8080", "box"}},
		{":8080", "wss://broker.example/",
			[]string{"broker.example", "broker.example:443", "[::1]:8080", "[::]:8080", "0.0.0.0:8080"},
			[]string{"box", "192.0.2.10:8080", "evil.example"}},
		{":8080", "http://[2001:db8::5]:81",
			[]string{"[2001:db8::5]:81", "[2001:db8::5]"},
			[]string{"box", "[2001:db8::10]:8080"}},
		{"broker-2:8080", "",
			[]string{"broker-2", "broker-2:8080", "localhost"},
			[]string{"box", "evil.example"}},
		// A wildcard bind without advertise_addr: ws_url comes from Host,
		// so this host's name and interface addresses are accepted.
		{":8080", "",
			[]string{"box", "BOX:8080", "192.0.2.10:8080", "[2001:db8::10]:8080", "[2001:db8::10]", "localhost:8080", "127.0.0.1"},
			[]string{"evil.example", "192.0.2.11:8080", "box.evil.example", ""}},
		{"0.0.0.0:8080", "", []string{"box", "192.0.2.10"}, []string{"evil.example"}},
		{"[::]:8080", "", []string{"box", "[2001:db8::10]"}, []string{"evil.example"}},
	}
	for _, c := range cases {
		g := New(c.listen, c.advertise)
		if g.local != nil {
			g.local = local
		}
		for _, h := range c.allowed {
			if !g.Allows(h) {
				t.Errorf("listen %q advertise %q: Host %q refused, want allowed", c.listen, c.advertise, h)
			}
		}
		for _, h := range c.refused {
			if g.Allows(h) {
				t.Errorf("listen %q advertise %q: Host %q allowed, want refused", c.listen, c.advertise, h)
			}
		}
	}
}

// TestLocalNames: this host's own name and addresses are what the wildcard
// shape accepts.
func TestLocalNames(t *testing.T) {
	names, addrs := localNames()
	if len(names) == 0 || len(addrs) == 0 {
		t.Fatalf("hostname %v, interface addresses %v: want both", names, addrs)
	}
	g := New(":0", "")
	for _, a := range addrs {
		if !g.Allows(netip.AddrPortFrom(a, 80).String()) {
			t.Errorf("wildcard bind refuses this host's address %s", a)
		}
	}
	if !g.Allows(names[0]) {
		t.Errorf("wildcard bind refuses this host's name %q", names[0])
	}
}

func TestWrap(t *testing.T) {
	var refused []string
	h := New("127.0.0.1:8080", "").Wrap(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusTeapot)
	}), func(r *http.Request, status int, reason string) {
		refused = append(refused, fmt.Sprint(r.URL.Path, " ", status, " ", reason))
	})
	for _, c := range []struct {
		host, path string
		origins    []string
		want       int
	}{
		{"evil.example", "/leases", nil, http.StatusMisdirectedRequest},
		{"evil.example", "/console", nil, http.StatusMisdirectedRequest},
		{"evil.example", "/healthz", nil, http.StatusTeapot},
		{"evil.example", "/readyz", nil, http.StatusTeapot},
		{"evil.example", "/healthz/", nil, http.StatusMisdirectedRequest},
		{"localhost:8080", "/leases", nil, http.StatusTeapot},
		// The broker's own pages, and a page of another local port.
		{"localhost:8080", "/claim", []string{"http://localhost:8080"}, http.StatusTeapot},
		{"127.0.0.1:8080", "/claim", []string{"http://127.0.0.1:8080"}, http.StatusTeapot},
		{"127.0.0.1:8080", "/claim", []string{"https://[::1]:3000"}, http.StatusTeapot},
		// A cross-site page reaching an allowed Host.
		{"127.0.0.1:8080", "/claim", []string{"http://evil.example"}, http.StatusForbidden},
		{"127.0.0.1:8080", "/lease/x", []string{"https://evil.example:8080"}, http.StatusForbidden},
		{"127.0.0.1:8080", "/claim", []string{"null"}, http.StatusForbidden},
		{"127.0.0.1:8080", "/claim", []string{"file://"}, http.StatusForbidden},
		{"127.0.0.1:8080", "/claim", []string{"http://localhost:8080/x"}, http.StatusForbidden},
		{"127.0.0.1:8080", "/claim", []string{"http://localhost:8080", "http://evil.example"}, http.StatusForbidden},
		{"127.0.0.1:8080", "/healthz", []string{"http://evil.example"}, http.StatusTeapot},
	} {
		r := httptest.NewRequest(http.MethodPost, c.path, nil)
		r.Host = c.host
		for _, o := range c.origins {
			r.Header.Add("Origin", o)
		}
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		if w.Code != c.want {
			t.Errorf("Host %q Origin %q %s = %d, want %d", c.host, c.origins, c.path, w.Code, c.want)
		}
		if w.Code == http.StatusMisdirectedRequest && (!strings.Contains(w.Body.String(), `Host \"`+c.host+`\" names no address of this broker`) || w.Header().Get("Content-Type") != "application/json") {
			t.Errorf("421 body %q (%s)", w.Body, w.Header().Get("Content-Type"))
		}
		if w.Code == http.StatusForbidden && (!strings.Contains(w.Body.String(), `cross-origin request refused: Origin \"`+strings.Join(c.origins, ", ")+`\" names no address of this broker`) || w.Header().Get("Content-Type") != "application/json") {
			t.Errorf("403 body %q (%s)", w.Body, w.Header().Get("Content-Type"))
		}
	}
	want := []string{
		"/leases 421 " + Reason, "/console 421 " + Reason, "/healthz/ 421 " + Reason,
		"/claim 403 " + OriginReason, "/lease/x 403 " + OriginReason, "/claim 403 " + OriginReason,
		"/claim 403 " + OriginReason, "/claim 403 " + OriginReason, "/claim 403 " + OriginReason,
	}
	if !slices.Equal(refused, want) {
		t.Errorf("refused callback saw %q, want %q", refused, want)
	}
}
