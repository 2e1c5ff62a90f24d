package cluster

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"runtime/debug"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/atomicfile"
	"github.com/nexus-broker/nexus-broker/internal/config/core"
)

// MembersFile, in state_dir, is the membership record: every broker heard
// and when it was last, so that after a restart a lease of a broker not
// heard yet is 503 (it may be away), not 404, until cluster.forget_after
// has passed since it was last seen.
const MembersFile = "cluster-members.json"

// recordRefresh is how often the record is saved when nothing but the
// times changed.
const recordRefresh = time.Minute

// maxRecorded bounds the brokers a record file is read for.
const maxRecorded = 10000

// recorded is one broker of the record.
type recorded struct {
	Advertise string    `json:"advertise_addr"`
	LastSeen  time.Time `json:"last_seen"`
}

type recordFile struct {
	Brokers map[string]*recorded `json:"brokers"`
}

// Version is this build, as heartbeats and GET /cluster show it: the
// module version, and the commit when the build recorded one.
var Version = buildVersion()

func buildVersion() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "unknown"
	}
	v := bi.Main.Version
	for _, s := range bi.Settings {
		if s.Key == "vcs.revision" && len(s.Value) >= 12 {
			v += "+" + s.Value[:12]
		}
	}
	return v
}

// decodeRecord reads a record file's content: broker ids must be ids a
// broker may have, and there are at most maxRecorded.
func decodeRecord(data []byte) (map[string]*recorded, error) {
	var f recordFile
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, err
	}
	if len(f.Brokers) > maxRecorded {
		return nil, fmt.Errorf("%d brokers, more than the %d a record holds", len(f.Brokers), maxRecorded)
	}
	for id, r := range f.Brokers {
		if !core.IsToken(id, core.MaxBrokerIDLen) {
			return nil, fmt.Errorf("%q is not a broker_id", id)
		}
		if r == nil {
			return nil, fmt.Errorf("broker %q has no entry", id)
		}
	}
	if f.Brokers == nil {
		f.Brokers = map[string]*recorded{}
	}
	return f.Brokers, nil
}

// loadRecord reads the record at boot, less the brokers silent for
// forgetAfter. One that cannot be read is said and replaced: it only
// makes leases of brokers not heard yet 404 rather than 503.
func (n *Node) loadRecord(now time.Time) {
	data, err := os.ReadFile(n.recordPath)
	if errors.Is(err, fs.ErrNotExist) {
		return
	}
	var rec map[string]*recorded
	if err == nil {
		rec, err = decodeRecord(data)
	}
	if err != nil {
		n.log.Warn("cluster: the membership record cannot be read; starting without it (leases of brokers not heard yet are 404 until they are)", "path", n.recordPath, "error", err)
		return
	}
	delete(rec, n.id)
	n.mu.Lock()
	n.record = rec
	n.forget(now)
	n.mu.Unlock()
}

// remember records broker id as seen at now; n.mu is held.
func (n *Node) remember(id, advertise string, now time.Time) {
	r := n.record[id]
	if r == nil || r.Advertise != advertise {
		r = &recorded{Advertise: advertise}
		n.record[id] = r
		n.recordDirty = true
	}
	r.LastSeen = now
}

// forget drops from the record the brokers silent for forgetAfter; n.mu
// is held.
func (n *Node) forget(now time.Time) {
	for id, r := range n.record {
		if n.peers[id] == nil && now.Sub(r.LastSeen) >= n.forgetAfter {
			delete(n.record, id)
			n.recordDirty = true
		}
	}
}

// saveRecord writes the record (mode 0600, replaced by rename).
func (n *Node) saveRecord(now time.Time) {
	if n.recordPath == "" {
		return
	}
	n.mu.Lock()
	data, err := json.Marshal(recordFile{Brokers: n.record})
	n.recordDirty, n.recordSaved = false, now
	n.mu.Unlock()
	if err == nil {
		err = atomicfile.Write(n.recordPath, data, nil)
	}
	if err != nil {
		n.log.Warn("cluster: saving the membership record failed", "path", n.recordPath, "error", err)
	}
}
