package gateway

import (
	"net/http/httptest"
	"testing"

	"github.com/nexus-broker/nexus-broker/internal/config"
)

func TestWSURLPrecedence(t *testing.T) {
	cases := []struct {
		listen, advertise, host, want string
		port                          uint32 // the listener's
	}{
		{":8080", "", "example.test:8080", "ws://example.test:8080/lease/L", 0},
		{"0.0.0.0:8080", "", "example.test:8080", "ws://example.test:8080/lease/L", 0},
		{"[::]:8080", "", "example.test:8080", "ws://example.test:8080/lease/L", 0},
		{"10.1.2.3:8080", "", "proxy.test", "ws://10.1.2.3:8080/lease/L", 8080},
		{":8080", "broker-1.test:9000", "proxy.test", "ws://broker-1.test:9000/lease/L", 0},
		{":8080", "wss://broker-1.example.com", "proxy.test", "wss://broker-1.example.com/lease/L", 0},
		{":8080", "https://broker.example/", "proxy.test", "wss://broker.example/lease/L", 0},
		{":8080", "http://b.test:80", "proxy.test", "ws://b.test:80/lease/L", 0},
		{":8080", "ws://b.test:81", "proxy.test", "ws://b.test:81/lease/L", 0},
		{"127.0.0.1:0", "", "proxy.test", "ws://127.0.0.1:40001/lease/L", 40001},
		{"[::1]:0", "", "proxy.test", "ws://[::1]:40001/lease/L", 40001},
	}
	for _, c := range cases {
		cfg := config.Default()
		cfg.ListenAddr, cfg.AdvertiseAddr = c.listen, c.advertise
		g := &Gateway{settings: settings{boot: cfg}, spawndLink: spawndLink{listenPort: c.port}}
		r := httptest.NewRequest("POST", "/claim", nil)
		r.Host = c.host
		if got := g.wsURL(r, "L"); got != c.want {
			t.Errorf("listen %q advertise %q host %q: %s, want %s", c.listen, c.advertise, c.host, got, c.want)
		}
	}
}
