// Package inotify reads the events of an inotify descriptor (spawnd capping
// instance logs, the gateway awaiting spawnd.json).
//
// Both nexus-broker and nexus-spawnd link it, so it may import none of
// the gateway's layers nor anything else gateway-side
// (internal/gateway/layers_test.go and cmd/nexus-spawnd's deps test check
// it).
package inotify

import (
	"bytes"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Events yields the name and mask of each whole event in buf, as read(2)
// returned them from an inotify descriptor.
func Events(buf []byte) func(yield func(string, uint32) bool) {
	return func(yield func(string, uint32) bool) {
		for off := 0; off+unix.SizeofInotifyEvent <= len(buf); {
			ev := (*unix.InotifyEvent)(unsafe.Pointer(&buf[off]))
			end := off + unix.SizeofInotifyEvent + int(ev.Len)
			if end > len(buf) {
				return
			}
			name := string(bytes.TrimRight(buf[off+unix.SizeofInotifyEvent:end], "\x00"))
			if !yield(name, ev.Mask) {
				return
			}
			off = end
		}
	}
}
