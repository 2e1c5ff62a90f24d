// Package spawnproof is the one-way verifier of a lease's spawn secret:
// nexus-spawnd, which derives the secret from its spawn-key, makes it and
// hands it to the gateway with the lease; the gateway checks an instance's
// register frame against it without asking spawnd, and without being able
// to make a secret that passes.
//
// The verifier is SHA-256 over a domain string and the secret. The secret
// is 256 bits of HMAC output, so the hash cannot be searched back to it,
// and no key is needed: an HMAC keyed by something the gateway holds would
// protect nothing more. The domain string keeps the verifier from being
// any other digest of the secret.
//
// Both processes link it, and it imports nothing of the project (a leaf:
// internal/gateway/layers_test.go checks it).
package spawnproof

import (
	"crypto/sha256"
	"crypto/subtle"
)

// domain separates the verifier from every other use of SHA-256.
const domain = "nexus-broker spawn-secret verifier v1\x00"

// Size is a verifier's length.
const Size = sha256.Size

// unmatchable stands in for a missing verifier: no secret matches it, since
// that would take a SHA-256 preimage of Size zero bytes.
var unmatchable [Size]byte

// Of is secret's verifier.
func Of(secret string) []byte {
	sum := digest(secret)
	return sum[:]
}

// Matches says whether secret is the one verifier was made from, in time
// that depends on the secret's length only. A verifier that is not Size
// bytes (nil: a lease id nobody holds) matches nothing and is checked the
// same way, so refusing an unknown lease costs what a wrong secret does.
func Matches(verifier []byte, secret string) bool {
	if len(verifier) != Size {
		verifier = unmatchable[:]
	}
	sum := digest(secret)
	return subtle.ConstantTimeCompare(sum[:], verifier) == 1
}

func digest(secret string) [Size]byte {
	h := sha256.New()
	h.Write([]byte(domain))
	h.Write([]byte(secret))
	var sum [Size]byte
	h.Sum(sum[:0])
	return sum
}
