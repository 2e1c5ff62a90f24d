package streamlog

import (
	"encoding/json"
	"fmt"
	"testing"

	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

func appendN(t *testing.T, s *Log, n int) {
	t.Helper()
	for i := 0; i < n; i++ {
		if _, err := s.Append(brokerframe.Frame{Signal: brokerframe.SignalIO, Payload: json.RawMessage(`{"type":"stream.delta","content":"0123456789"}`)}); err != nil {
			t.Fatal(err)
		}
	}
}

func seqs(es []Entry) []uint64 {
	out := make([]uint64, len(es))
	for i, e := range es {
		out[i] = e.Seq
	}
	return out
}

func TestStreamLogSequencesFromOneWithoutHoles(t *testing.T) {
	s := New("L", 1<<20)
	appendN(t, s, 1000)
	c, gap := s.Attach(0)
	if gap != nil {
		t.Fatalf("unexpected gap %+v", gap)
	}
	var got []uint64
	for {
		batch, miss, _, wake := s.ReadBatch(c, nil, 64, true)
		if miss != 0 {
			t.Fatalf("miss at %d", miss)
		}
		if wake != nil {
			break
		}
		got = append(got, seqs(batch)...)
		s.Advance(c, batch[len(batch)-1].Seq)
	}
	if len(got) != 1000 {
		t.Fatalf("read %d frames", len(got))
	}
	for i, q := range got {
		if q != uint64(i+1) {
			t.Fatalf("frame %d has seq %d", i, q)
		}
	}
	var f brokerframe.Frame
	if err := json.Unmarshal(s.entries[0].Data, &f); err != nil || f.Seq != 1 || f.LeaseID != "L" {
		t.Fatalf("stored frame %s", s.entries[0].Data)
	}
}

func TestStreamLogAttachPositions(t *testing.T) {
	frameLen := func() int64 {
		s := New("L", 1<<20)
		appendN(t, s, 1)
		return s.RetainedBytes()
	}()
	s := New("L", 10*(frameLen+1)) // holds 10 frames with two-digit seqs
	appendN(t, s, 30)              // 21..30 retained
	cases := []struct {
		from    int64
		start   uint64
		gap     *brokerframe.StreamGap
		comment string
	}{
		{-1, 30, nil, "absent: live only"},
		{25, 25, nil, "covered"},
		{20, 20, nil, "exactly the oldest retained is next"},
		{19, 20, &brokerframe.StreamGap{Reason: "evicted", RequestedFromSeq: 19, MissingFromSeq: 20, MissingThroughSeq: 20}, "one evicted"},
		{0, 20, &brokerframe.StreamGap{Reason: "evicted", RequestedFromSeq: 0, MissingFromSeq: 1, MissingThroughSeq: 20}, "seen nothing"},
		{30, 30, nil, "up to date"},
		{31, 20, &brokerframe.StreamGap{Reason: "restarted", RequestedFromSeq: 31}, "ahead of the stream"},
	}
	for _, c := range cases {
		cur, gap := s.Attach(c.from)
		if cur.seq != c.start || fmt.Sprint(gap) != fmt.Sprint(c.gap) {
			t.Errorf("%s: attach(%d) = %d %+v, want %d %+v", c.comment, c.from, cur.seq, gap, c.start, c.gap)
		}
		s.Detach(cur)
	}
}

func TestStreamLogPinsTheAttachedClientsSendWindow(t *testing.T) {
	s := New("L", 0) // retain nothing for replay
	c, _ := s.Attach(-1)
	appendN(t, s, SendWindow)
	batch, miss, _, _ := s.ReadBatch(c, nil, 1000, false)
	if miss != 0 || len(batch) != SendWindow {
		t.Fatalf("a live client lost frames within the send window: miss %d, got %d", miss, len(batch))
	}
	lost, _ := s.Append(brokerframe.Frame{Signal: brokerframe.SignalIO})
	if lost != 1 {
		t.Fatalf("past the send window the oldest undelivered frame is lost: lost = %d", lost)
	}
	_, miss, through, _ := s.ReadBatch(c, nil, 1000, false)
	if miss != 1 || through != 1 {
		t.Fatalf("the reader must be told frame 1 is gone: %d..%d", miss, through)
	}
	s.Detach(c)
	appendN(t, s, 1)
	if s.RetainedBytes() != 0 {
		t.Fatalf("with no client and a zero bound nothing is retained, have %d bytes", s.RetainedBytes())
	}
	if s.LastSeq() != SendWindow+2 {
		t.Fatalf("sequencing continues with retention off: last = %d", s.LastSeq())
	}
}

func TestStreamLogDisplacedCursorDoesNotUnpinSuccessor(t *testing.T) {
	s := New("L", 0)
	old, _ := s.Attach(-1)
	next, _ := s.Attach(-1)
	s.Detach(old)
	appendN(t, s, 5)
	if batch, _, _, _ := s.ReadBatch(next, nil, 10, false); len(batch) != 5 {
		t.Fatalf("successor lost its pin: got %d frames", len(batch))
	}
}

func TestStreamLogWakesAWaitingReaderOnly(t *testing.T) {
	s := New("L", 1<<20)
	c, _ := s.Attach(-1)
	if _, _, _, wake := s.ReadBatch(c, nil, 8, false); wake != nil {
		t.Fatal("a reader that does not wait was handed a wake channel")
	}
	appendN(t, s, 3)
	if s.wake != nil {
		t.Fatal("appends nobody waited on made a wake channel")
	}
	batch, _, _, _ := s.ReadBatch(c, nil, 8, true)
	s.Advance(c, batch[len(batch)-1].Seq)
	_, _, _, wake := s.ReadBatch(c, nil, 8, true)
	if wake == nil {
		t.Fatal("a waiting reader with nothing to read got no wake channel")
	}
	select {
	case <-wake:
		t.Fatal("woken before any append")
	default:
	}
	appendN(t, s, 1)
	select {
	case <-wake:
	default:
		t.Fatal("the append did not wake the waiting reader")
	}
}
