package auth

import (
	"context"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/auth/authtest"
)

// BenchmarkAuthenticate is what the guard costs one request, in process:
// no auth: block (the baseline), a static token, a warm JWT (verified
// before, so cached), and a JWT never seen before (a signature check over a
// cached key). Each reports its ns beside the baseline's from the same run.
func BenchmarkAuthenticate(b *testing.B) {
	is := authtest.NewIssuer()
	defer is.Stop()
	// Static first, as the spec advises (cheap validators first); a JWT
	// passes through it to jwks.
	yaml := strings.Replace(jwksYAML(is, ""), "  validators:\n", "  validators:\n    - type: static\n      tokens: [{token: tok, principal: p}]\n", 1)
	a := newAuth(b, yaml)
	iss := is.URL() + "/"
	warm := is.Sign(authtest.Claims(iss, "nexus-broker", "alice"))
	fresh := make([]string, 2000)
	for i := range fresh {
		c := authtest.Claims(iss, "nexus-broker", "alice")
		c["jti"] = i
		fresh[i] = is.Sign(c)
	}
	req := func(tok string) *Credential { return &Credential{Bearer: tok, Authorization: true} }
	if _, ref := a.Verify(context.Background(), req(warm)); ref != nil {
		b.Fatal(ref.Reason)
	}
	var none *Authenticator
	r := httptest.NewRequest("GET", "/binaries", nil)
	per := func(f func(i int)) float64 {
		start := time.Now()
		n := 0
		for ; time.Since(start) < 200*time.Millisecond || n < 100; n++ {
			f(n)
		}
		return float64(time.Since(start).Nanoseconds()) / float64(n)
	}
	for b.Loop() {
		base := per(func(int) { none.Authenticate(r) })
		static := per(func(int) { a.Verify(context.Background(), req("tok")) })
		jwtWarm := per(func(int) { a.Verify(context.Background(), req(warm)) })
		// Every token once, on an empty cache: a signature check each.
		a.chain[1].validator.(*jwks).cache = tokenCache{}
		start := time.Now()
		for _, tok := range fresh {
			a.Verify(context.Background(), req(tok))
		}
		jwtFresh := float64(time.Since(start).Nanoseconds()) / float64(len(fresh))
		b.ReportMetric(base, "none-ns")
		b.ReportMetric(static, "static-ns")
		b.ReportMetric(jwtWarm, "jwks-warm-ns")
		b.ReportMetric(jwtFresh, "jwks-first-sight-ns")
		b.ReportMetric(0, "ns/op")
	}
}
