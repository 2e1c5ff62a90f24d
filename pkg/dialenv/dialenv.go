// Package dialenv names the variables spawnd gives every instance to dial
// back and register: its own package, so spawnd links no wire codec.
//
// It imports nothing: spawnd and every instance link it.
package dialenv

// Set last in a spawn's environment, so nothing overrides them.
const (
	// BrokerAddr is the gateway's /instance WebSocket URL.
	BrokerAddr = "NEXUS_BROKER_ADDR"
	// LeaseID is the lease the instance registers as.
	LeaseID = "NEXUS_BROKER_LEASE_ID"
	// SpawnSecret proves the register frame comes from that lease's
	// instance.
	SpawnSecret = "NEXUS_BROKER_SPAWN_SECRET"
)
