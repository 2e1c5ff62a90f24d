package gateway

import (
	"context"
	"slices"
	"sort"
	"sync"

	"github.com/nexus-broker/nexus-broker/internal/auth"
	"github.com/nexus-broker/nexus-broker/internal/cluster"
)

// joinCluster connects this broker to its peers over NATS (cluster mode).
// An authentication or configuration error refuses the boot; an
// unreachable NATS is retried while the broker serves its own leases.
func (g *Gateway) joinCluster(brokerID string) error {
	n, err := cluster.New(cluster.Options{Config: g.boot.Cluster, BrokerID: brokerID, Advertise: g.boot.AdvertiseAddr, Log: g.log})
	if err != nil {
		return err
	}
	g.registerClusterOps(n)
	// Set before the first request can arrive: the ops read it.
	g.node = n
	return n.Start()
}

// clusterLeases is GET /leases in cluster mode: every broker asked at once
// within one deadline, the leases of those that answered, their aggregates
// summed, and the others named.
func (g *Gateway) clusterLeases(ctx context.Context, p auth.Principal) leasesJSON {
	out := g.localLeases(p)
	unreachable := []string{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, peer := range g.node.Peers() {
		if !peer.Reachable {
			unreachable = append(unreachable, peer.ID)
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			var theirs leasesJSON
			err := g.node.Call(ctx, peer.ID, opLeases, leaseCall{Principal: p}, &theirs)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				unreachable = append(unreachable, peer.ID)
				return
			}
			out.Leases = append(out.Leases, theirs.Leases...)
			for _, sum := range [][2]*int{{out.MaxConcurrent, theirs.MaxConcurrent}, {out.SlotsInUse, theirs.SlotsInUse},
				{out.QueueDepth, theirs.QueueDepth}, {out.MaxQueueDepth, theirs.MaxQueueDepth}} {
				if sum[0] != nil && sum[1] != nil {
					*sum[0] += *sum[1]
				}
			}
		}()
	}
	wg.Wait()
	sortLeases(out.Leases)
	slices.Sort(unreachable)
	out.UnreachableBrokers = &unreachable
	return out
}

// sortLeases orders GET /leases: oldest first, then by id.
func sortLeases(ls []leaseJSON) {
	sort.Slice(ls, func(i, j int) bool {
		if !ls[i].CreatedAt.Equal(ls[j].CreatedAt) {
			return ls[i].CreatedAt.Before(ls[j].CreatedAt)
		}
		return ls[i].LeaseID < ls[j].LeaseID
	})
}
