package core

import "reflect"

// ReloadDiff names the top-level keys whose values differ between cur (the
// configuration in force) and next (the file just re-read), two values of
// one schema (Config, or the gateway's, which embeds it), split into those
// a SIGHUP applies and those only read at boot. Both lists are sorted.
//
// A key is reloadable when its field is tagged reload:"sighup": the
// registry and its credentials and environment, the per-claim and
// per-lease policy the next claim reads, who may open the console. Every
// other key is boot-only (the listener, the journal and its identity, the
// replay buffers, the queue and per-principal admission caps, the spawnd:
// wiring are built once at boot), so an untagged key is the safe mistake.
// nexus_binary_path is never named: validation folds it into binaries, so
// a change to it shows as binaries.
func ReloadDiff[T any](cur, next *T) (reloadable, bootOnly []string) {
	c, n := reflect.ValueOf(cur).Elem(), reflect.ValueOf(next).Elem()
	fields := YAMLFields(c.Type())
	for _, key := range sortedKeys(fields) {
		if key == "nexus_binary_path" {
			continue
		}
		f := fields[key]
		if reflect.DeepEqual(c.FieldByIndex(f.Index).Interface(), n.FieldByIndex(f.Index).Interface()) {
			continue
		}
		if f.Tag.Get("reload") == "sighup" {
			reloadable = append(reloadable, key)
		} else {
			bootOnly = append(bootOnly, key)
		}
	}
	return reloadable, bootOnly
}
