package config

import "reflect"

// sighupKeys are the top-level keys a SIGHUP applies to the running broker:
// the registry and its credentials and environment, and the per-claim and
// per-lease policy the next claim reads, and who may open the console. Every other key is boot-only: the
// listener, the journal and its identity, the replay buffers, the queue and
// per-principal admission caps, and the spawnd: wiring are built once at
// boot, and a reload that changes them is reported and ignored. A key
// missing from this table is therefore boot-only, which is the safe mistake.
var sighupKeys = map[string]bool{
	"binaries":             true,
	"inherit_env":          true,
	"run_as":               true,
	"max_concurrent":       true,
	"idle_timeout":         true,
	"max_turn_duration":    true,
	"release_grace":        true,
	"ready_timeout":        true,
	"session_report_grace": true,
	"max_claim_body":       true,
	"console":              true,
	// agents reloads only on a broker that booted with the ingress on; the
	// gateway reports it as boot-only otherwise.
	"agents": true,
}

// ReloadDiff names the top-level keys whose values differ between c (the
// configuration in force) and next (the file just re-read), split into
// those a SIGHUP applies and those only read at boot. Both lists are sorted.
// nexus_binary_path is never named: Load folds it into binaries, so a change
// to it shows as binaries. Warnings are not configuration and are ignored.
func (c *Config) ReloadDiff(next *Config) (reloadable, bootOnly []string) {
	cur, nxt := reflect.ValueOf(c).Elem(), reflect.ValueOf(next).Elem()
	fields := yamlFields(configType)
	for _, key := range sortedKeys(fields) {
		if key == "nexus_binary_path" {
			continue
		}
		idx := fields[key].Index
		if reflect.DeepEqual(cur.FieldByIndex(idx).Interface(), nxt.FieldByIndex(idx).Interface()) {
			continue
		}
		if sighupKeys[key] {
			reloadable = append(reloadable, key)
		} else {
			bootOnly = append(bootOnly, key)
		}
	}
	return reloadable, bootOnly
}

// Reloaded is the configuration a SIGHUP puts in force: next's reloadable
// keys over boot's boot-only ones, by the same table ReloadDiff uses.
func Reloaded(boot, next *Config) *Config {
	out := *boot
	dst, src := reflect.ValueOf(&out).Elem(), reflect.ValueOf(next).Elem()
	for key, f := range yamlFields(configType) {
		if sighupKeys[key] {
			dst.FieldByIndex(f.Index).Set(src.FieldByIndex(f.Index))
		}
	}
	out.Warnings = next.Warnings
	return &out
}
