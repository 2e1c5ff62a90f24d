package cluster

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strings"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"

	"github.com/nexus-broker/nexus-broker/internal/config/core"
)

// randomPart is the length of a lease id's random part: 128 bits in hex.
const randomPart = 32

// NewLeaseID mints a lease id owned by broker: 128 random bits in hex, a
// dash, the broker id. Every broker routes it without a lookup, and it
// stays a URL-safe token a client treats as opaque.
func NewLeaseID(broker string) (string, error) {
	var b [randomPart / 2]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	return hex.EncodeToString(b[:]) + "-" + broker, nil
}

// Owner is the broker id an id minted by NewLeaseID names, "" for an id
// minted in single-broker mode (or not such an id at all: its suffix
// cannot be a broker id).
func Owner(leaseID string) string {
	if len(leaseID) <= randomPart+1 || leaseID[randomPart] != '-' {
		return ""
	}
	if strings.ContainsFunc(leaseID[:randomPart], func(r rune) bool { return !('0' <= r && r <= '9' || 'a' <= r && r <= 'f') }) {
		return ""
	}
	if o := leaseID[randomPart+1:]; core.IsToken(o, core.MaxBrokerIDLen) {
		return o
	}
	return ""
}

// nkeyOption authenticates with an nkey user seed held in memory.
func nkeyOption(seed string) (nats.Option, error) {
	kp, err := nkeys.FromSeed([]byte(seed))
	if err != nil {
		return nil, fmt.Errorf("broker config: cluster.nkey_seed: not an nkey seed (%v); give the user seed, starting SU", err)
	}
	pub, err := kp.PublicKey()
	if err != nil {
		return nil, fmt.Errorf("broker config: cluster.nkey_seed: %v", err)
	}
	return nats.Nkey(pub, kp.Sign), nil
}
