package e2e

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/auth/authtest"
	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
)

// authBenchRig is the same broker twice: once without an auth: block, once
// with a static table and a jwks validator over a local issuer (static
// first, so a JWT is judged by both, as in the spec's worked example).
type authBenchRig struct {
	open, authed *Broker
	jwt          string
}

func newAuthBenchRig(b *testing.B) *authBenchRig {
	is := authtest.NewIssuer()
	b.Cleanup(is.Stop)
	yaml := fmt.Sprintf(`idle_timeout: 0s
max_concurrent: 0
auth:
  validators:
    - type: static
      tokens: [{token: bench-token, principal: bench}]
    - type: jwks
      issuer: %q
      jwks_url: %q
      audience: nexus-broker
      principal_claim: sub
`, is.URL(), is.JWKSURL())
	r := &authBenchRig{
		open:   startBroker(b, Options{YAML: "idle_timeout: 0s\nmax_concurrent: 0\n"}),
		authed: startBroker(b, Options{YAML: yaml}),
		jwt:    is.Sign(authtest.Claims(is.URL(), "nexus-broker", "bench-jwt")),
	}
	return r
}

// authCase is one way of calling: which broker, with which bearer.
type authCase struct {
	name  string
	b     *Broker
	token string
}

func (r *authBenchRig) cases() []authCase {
	return []authCase{{"none", r.open, ""}, {"static", r.authed, "bench-token"}, {"jwks", r.authed, r.jwt}}
}

// getRTT times one GET /binaries: the same middleware as POST /claim with
// nothing else in the way, so the differences between cases are what
// authentication costs a request.
func getRTT(b *testing.B, c authCase) time.Duration {
	req, _ := http.NewRequest("GET", c.b.Base+"/binaries", nil)
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	start := time.Now()
	resp, err := unchecked.Do(req)
	d := time.Since(start)
	if err != nil || resp.StatusCode != 200 {
		b.Fatalf("GET /binaries as %s: %v %v", c.name, resp, err)
	}
	resp.Body.Close()
	return d
}

// BenchmarkAuthCost reports POST /claim, a guarded GET, and the relay round
// trip for an unauthenticated, a static-token and a JWKS-verified caller,
// interleaved in one run. The claim figures carry a process spawn each and
// so the spawn's noise; the guarded GET isolates what authentication adds.
// Warm paths only: the first request of each kind (the JWKS fetch, the first
// signature check) is outside the figures, as a warm cache is the claim.
func BenchmarkAuthCost(b *testing.B) {
	benchPreflight(b)
	r := newAuthBenchRig(b)
	cases := r.cases()
	ctx := context.Background()
	claims := map[string][]time.Duration{}
	gets := map[string][]time.Duration{}
	claimOnce := func(c authCase) time.Duration {
		cl := &brokerclient.Client{Base: c.b.Base, Token: c.token, HTTP: unchecked}
		start := time.Now()
		claim, err := cl.Claim(ctx, brokerclient.ClaimRequest{Config: benchConfig})
		d := time.Since(start)
		if err != nil {
			b.Fatalf("claim as %s: %v", c.name, err)
		}
		if err := cl.Release(ctx, claim.LeaseID); err != nil {
			b.Fatalf("release as %s: %v", c.name, err)
		}
		return d
	}
	for _, c := range cases { // warm-up, not in the figures
		claimOnce(c)
		getRTT(b, c)
	}
	for i := 0; b.Loop(); i++ {
		// Rotate the order so no case always runs first.
		for k := range cases {
			c := cases[(i+k)%len(cases)]
			claims[c.name] = append(claims[c.name], claimOnce(c))
			for range 20 {
				gets[c.name] = append(gets[c.name], getRTT(b, c))
			}
		}
	}

	// Relay: one lease each, connected the way each caller would (a ticket
	// for the authenticated ones), frames interleaved.
	relay := map[string][]time.Duration{}
	conns := map[string]*brokerclient.Conn{}
	for _, c := range cases {
		cl := &brokerclient.Client{Base: c.b.Base, Token: c.token, HTTP: unchecked}
		claim, err := cl.Claim(ctx, brokerclient.ClaimRequest{Config: benchConfig})
		if err != nil {
			b.Fatal(err)
		}
		conn, err := brokerclient.Dial(ctx, claim.WSURL, brokerclient.DialOptions{Ticket: claim.Ticket})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { conn.Close() })
		conns[c.name] = conn
	}
	for n := range 500 {
		for _, c := range cases {
			d, err := clientRoundTrip(conns[c.name], n)
			if err != nil {
				b.Fatalf("relay as %s: %v", c.name, err)
			}
			relay[c.name] = append(relay[c.name], d)
		}
	}

	for _, c := range cases {
		b.ReportMetric(ms(pct(claims[c.name], 50)), "claim-"+c.name+"-p50-ms")
		b.ReportMetric(ms(pct(gets[c.name], 50)), "get-"+c.name+"-p50-ms")
		b.ReportMetric(ms(pct(relay[c.name], 50)), "relay-"+c.name+"-p50-ms")
	}
	none := pct(gets["none"], 50)
	static, jwks := pct(gets["static"], 50)-none, pct(gets["jwks"], 50)-none
	b.ReportMetric(ms(static), "auth-static-p50-ms")
	b.ReportMetric(ms(jwks), "auth-jwks-p50-ms")
	verdict(b, "auth adds ≤ 0.2 ms to a claim at p50", static <= 200*time.Microsecond && jwks <= 200*time.Microsecond,
		"guarded request p50: none %.3f ms, static %+.3f ms, jwks %+.3f ms (%d samples each); claim p50: none %.3f, static %.3f, jwks %.3f ms (%d each, spawn noise included); relay p50: none %.3f, static %.3f, jwks %.3f ms",
		ms(none), ms(static), ms(jwks), len(gets["none"]),
		ms(pct(claims["none"], 50)), ms(pct(claims["static"], 50)), ms(pct(claims["jwks"], 50)), len(claims["none"]),
		ms(pct(relay["none"], 50)), ms(pct(relay["static"], 50)), ms(pct(relay["jwks"], 50)))
}
