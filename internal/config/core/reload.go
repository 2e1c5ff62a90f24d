package core

import (
	"maps"
	"reflect"
	"slices"
)

// ReloadDiff names the top-level keys whose values differ between cur (in
// force) and next (just re-read), two values of one schema, split into those
// a SIGHUP applies (tagged reload:"sighup") and boot-only ones: untagged is
// the safe mistake. nexus_binary_path shows as binaries, into which
// validation folds it. Keys come in the schema's order, which is the spec's
// broker.yaml order (its reload WARN reads keys=listen_addr,auth).
func ReloadDiff[T any](cur, next *T) (reloadable, bootOnly []string) {
	c, n := reflect.ValueOf(cur).Elem(), reflect.ValueOf(next).Elem()
	fields := YAMLFields(c.Type())
	keys := slices.SortedFunc(maps.Keys(fields), func(a, b string) int {
		return slices.Compare(fields[a].Index, fields[b].Index)
	})
	for _, key := range keys {
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

// Reloaded is the configuration a SIGHUP puts in force: next's reloadable
// keys (tagged reload:"sighup") over the boot-only ones in force, so that a
// boot-only edit the reload ignored is still told apart from what runs.
func Reloaded[T any](inForce, next *T) *T {
	out := *inForce
	dst, src := reflect.ValueOf(&out).Elem(), reflect.ValueOf(next).Elem()
	for _, f := range YAMLFields(dst.Type()) {
		if f.Tag.Get("reload") == "sighup" {
			dst.FieldByIndex(f.Index).Set(src.FieldByIndex(f.Index))
		}
	}
	return &out
}
