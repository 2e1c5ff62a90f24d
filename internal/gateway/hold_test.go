package gateway

import (
	"bytes"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/nexus-broker/nexus-broker/internal/config"
	"github.com/nexus-broker/nexus-broker/internal/config/core"
)

// bareGateway is a gateway with the default config and no spawnd, for tests
// of its lease bookkeeping.
func bareGateway() *Gateway {
	return New(Options{Config: config.Default(), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
}

// TestHeldFramesAreBounded: while no instance is attached, client frames are
// held up to holdFrames and holdBytes, and every frame past either bound is
// counted as a no_instance drop, never lost silently.
func TestHeldFramesAreBounded(t *testing.T) {
	g := bareGateway()
	l := g.newLease("L", "", core.ReservedEntry, time.Now())

	for i := 0; i < holdFrames+3; i++ {
		l.sendToInstance([]byte(`{"version":1,"lease_id":"L","signal":"io","payload":{"type":"echo"}}`), false)
	}
	if len(l.held) != holdFrames || g.m.FramesDropped.Get("no_instance") != 3 {
		t.Fatalf("held %d frames, dropped %d; want %d held and 3 dropped", len(l.held), g.m.FramesDropped.Get("no_instance"), holdFrames)
	}

	l2 := g.newLease("L2", "", core.ReservedEntry, time.Now())
	big := bytes.Repeat([]byte("x"), holdBytes/2+1)
	l2.sendToInstance(big, false)
	l2.sendToInstance(big, false) // would pass the byte bound
	if len(l2.held) != 1 || l2.heldBytes != len(big) || g.m.FramesDropped.Get("no_instance") != 4 {
		t.Fatalf("held %d frames (%d bytes), dropped %d; want 1 held and one more dropped", len(l2.held), l2.heldBytes, g.m.FramesDropped.Get("no_instance"))
	}
}
