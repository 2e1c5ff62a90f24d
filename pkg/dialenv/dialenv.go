// Package dialenv names the environment variables spawnd gives every
// instance so it can dial back to the gateway and register. It is its own
// package, beside the wire envelope (brokerframe), so that nexus-spawnd,
// which only sets them, links nothing of the envelope's codec.
package dialenv

// The variables, set last when spawnd builds a spawn's environment so
// nothing else can override them.
const (
	// BrokerAddr is the gateway's /instance WebSocket URL.
	BrokerAddr = "NEXUS_BROKER_ADDR"
	// LeaseID is the lease the instance registers as.
	LeaseID = "NEXUS_BROKER_LEASE_ID"
	// SpawnSecret proves the register frame comes from that lease's
	// instance.
	SpawnSecret = "NEXUS_BROKER_SPAWN_SECRET"
)
