package e2e

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/a2aproject/a2a-go/v2/a2a"
	"github.com/gorilla/websocket"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// max_client_frame: a client → instance frame larger than the instance may
// be sent (a stock nexus instance reads at most 32 KiB, and drops its
// socket on more) is refused with 1009, never relayed to be lost.

// ioFrameOf is the io envelope for leaseID carrying an input of exactly n
// bytes as a whole frame (the broker forwards such a frame as it was sent).
func ioFrameOf(t *testing.T, leaseID string, n int) []byte {
	t.Helper()
	frame := func(content string) []byte {
		payload, _ := json.Marshal(brokerframe.IO{Type: brokerframe.IOInput, Content: content})
		data, err := brokerframe.Encode(brokerframe.Frame{LeaseID: leaseID, Signal: brokerframe.SignalIO, Payload: payload})
		if err != nil {
			t.Fatal(err)
		}
		return data
	}
	data := frame(strings.Repeat("x", n-len(frame("x"))+1))
	if len(data) != n {
		t.Fatalf("built a %d-byte frame, want %d", len(data), n)
	}
	return data
}

// bareInput is a bare io payload ({"type":"input",…}, which the broker
// wraps) of exactly n bytes.
func bareInput(t *testing.T, n int) []byte {
	t.Helper()
	one, _ := json.Marshal(brokerframe.IO{Type: brokerframe.IOInput, Content: "y"})
	data, _ := json.Marshal(brokerframe.IO{Type: brokerframe.IOInput, Content: strings.Repeat("y", n-len(one)+1)})
	if len(data) != n {
		t.Fatalf("built a %d-byte payload, want %d", len(data), n)
	}
	return data
}

// refusedWith1009 writes data on conn and wants the socket closed with 1009
// and reason, nothing answered before.
func refusedWith1009(t *testing.T, conn *brokerclient.Conn, data []byte, reason string) {
	t.Helper()
	if err := conn.WriteRaw(data); err != nil {
		t.Fatalf("writing a %d-byte frame: %v", len(data), err)
	}
	_ = conn.Underlying().SetReadDeadline(time.Now().Add(30 * time.Second))
	for {
		f, err := conn.Next()
		if err == nil {
			if f.Signal == brokerframe.SignalIO {
				var p brokerframe.IO
				if json.Unmarshal(f.Payload, &p) == nil && (p.Type == brokerframe.IOOutput || p.Type == brokerframe.IOStreamDelta) {
					t.Fatalf("a %d-byte frame reached the instance (answered %s), want it refused", len(data), p.Type)
				}
			}
			continue
		}
		var ce *websocket.CloseError
		if !errors.As(err, &ce) || ce.Code != websocket.CloseMessageTooBig || ce.Text != reason {
			t.Fatalf("a %d-byte frame ended the socket with %v, want close 1009 %q", len(data), err, reason)
		}
		return
	}
}

// redial connects to the lease again and wants a normal input to reach its
// instance, answered as turn n.
func redial(t *testing.T, b *Broker, c *brokerclient.Claim, n int) {
	t.Helper()
	if l, ok := b.lease(c.LeaseID); !ok || l.State != "active" {
		t.Fatalf("after the refusal the lease is %+v (listed %v), want it active", l, ok)
	}
	conn := b.dial(c, brokerclient.DialOptions{})
	if got, want := say(t, conn, "still here"), fmt.Sprintf("echo #%d: still here", n); !strings.HasPrefix(got, want) {
		t.Fatalf("after reconnecting: %.80q, want %q… (the refused frames never reached the instance)", got, want)
	}
}

// TestClientFrameOverMaxClientFrameIs1009: with the default limit a frame
// of 32768 bytes as the instance is written it reaches the instance; one
// byte more, and a bare payload under the limit that its envelope takes
// over it, are refused with 1009 naming the limit and the key, and the
// lease stays claimed and active: a reconnect is answered. The instance's
// count of turns shows the refused frames never reached it.
func TestClientFrameOverMaxClientFrameIs1009(t *testing.T) {
	b := startBroker(t, Options{})
	c := b.claim(brokerclient.ClaimRequest{})
	conn := b.dial(c, brokerclient.DialOptions{})
	if err := conn.WriteRaw(ioFrameOf(t, c.LeaseID, 32768)); err != nil {
		t.Fatal(err)
	}
	_ = conn.Underlying().SetReadDeadline(time.Now().Add(30 * time.Second))
	if got, err := conn.Answer(); err != nil || !strings.HasPrefix(got, "echo #1: xxx") {
		t.Fatalf("a frame of exactly max_client_frame: %.40q, %v; want it answered", got, err)
	}
	refusedWith1009(t, conn, ioFrameOf(t, c.LeaseID, 32769), "frame of 32769 bytes exceeds max_client_frame (32768 bytes)")
	b.GatewayLog.wait(t, regexp.MustCompile(`level=WARN msg="client frame refused: larger than the instance may be sent;[^"]*" lease_id=`+c.LeaseID+` frame_bytes=32769 max_client_frame=32768`), 10*time.Second)
	redial(t, b, c, 2)

	// Measured as written: the bare payload is 32700 bytes, its envelope more.
	conn = b.dial(c, brokerclient.DialOptions{})
	bare := bareInput(t, 32700)
	wrapped := len(bare) + len(fmt.Sprintf(`{"version":1,"lease_id":%q,"signal":"io","payload":}`, c.LeaseID))
	refusedWith1009(t, conn, bare, fmt.Sprintf("frame of %d bytes exceeds max_client_frame (32768 bytes)", wrapped))
	redial(t, b, c, 3)
}

// TestClientFramePastTheReadLimitNamesIt: a frame over the 16 MiB
// WebSocket read limit is refused with a 1009 whose reason names that
// limit (gorilla's own gives none), and the lease answers a reconnect.
func TestClientFramePastTheReadLimitNamesIt(t *testing.T) {
	b := startBroker(t, Options{})
	c := b.claim(brokerclient.ClaimRequest{})
	conn := b.dial(c, brokerclient.DialOptions{})
	refusedWith1009(t, conn, make([]byte, 16<<20+1), "message exceeds the 16777216-byte WebSocket read limit")
	redial(t, b, c, 1)
}

// TestMaxClientFrameIsReloadable: max_client_frame out of its range
// refuses the boot and a SIGHUP naming the key; a SIGHUP raising it lets a
// 40 KiB frame through on the live lease, and one lowering it refuses a
// 2 KiB frame naming the new limit.
func TestMaxClientFrameIsReloadable(t *testing.T) {
	b := startBroker(t, Options{})
	c := b.claim(brokerclient.ClaimRequest{})
	setLimit := func(v string) {
		t.Helper()
		text, err := os.ReadFile(b.ConfigPath)
		if err != nil {
			t.Fatal(err)
		}
		edited := regexp.MustCompile(`(?m)^max_client_frame: .*\n`).ReplaceAllString(string(text), "") + "max_client_frame: " + v + "\n"
		if err := os.WriteFile(b.ConfigPath, []byte(edited), 0o600); err != nil {
			t.Fatal(err)
		}
	}

	setLimit("16777217")
	if got := b.reload(t); !strings.HasPrefix(got, "rejected") {
		t.Fatalf("a SIGHUP with max_client_frame: 16777217: %s", got)
	}
	b.GatewayLog.wait(t, regexp.MustCompile(`max_client_frame: must be between 1 and 16777216`), time.Second)

	setLimit("65536")
	if got := b.reload(t); got != "applied" {
		t.Fatalf("a SIGHUP with max_client_frame: 65536: %s", got)
	}
	conn := b.dial(c, brokerclient.DialOptions{})
	if err := conn.WriteRaw(ioFrameOf(t, c.LeaseID, 40<<10)); err != nil {
		t.Fatal(err)
	}
	_ = conn.Underlying().SetReadDeadline(time.Now().Add(30 * time.Second))
	if got, err := conn.Answer(); err != nil || !strings.HasPrefix(got, "echo #1: xxx") {
		t.Fatalf("a 40 KiB frame under a raised max_client_frame: %.40q, %v; want it answered", got, err)
	}

	setLimit("1024")
	if got := b.reload(t); got != "applied" {
		t.Fatalf("a SIGHUP with max_client_frame: 1024: %s", got)
	}
	refusedWith1009(t, conn, ioFrameOf(t, c.LeaseID, 2048), "frame of 2048 bytes exceeds max_client_frame (1024 bytes)")
	redial(t, b, c, 2)

	b.KillGateway(syscall.SIGTERM)
	refusedBoot(t, b, "max_client_frame: 0", func(text string) string {
		return strings.Replace(text, "max_client_frame: 1024\n", "max_client_frame: 0\n", 1)
	}, "broker config: max_client_frame: must be between 1 and 16777216")
}

// TestA2AMessageOverMaxClientFrameIsInvalidParams: over both bindings of
// the official client, a 40 KiB message (its input frame over the default
// max_client_frame) is refused with InvalidParams naming the limit, before
// any task exists; a normal message on the same context then completes,
// and an answer to a question over the limit is refused the same way,
// leaving the task waiting for one that fits.
func TestA2AMessageOverMaxClientFrameIsInvalidParams(t *testing.T) {
	b := a2aBroker(t, "", Options{})
	big := strings.Repeat("z", 40<<10)
	for _, binding := range bindings {
		t.Run(string(binding), func(t *testing.T) {
			c := a2aClient(t, b, "support", binding)
			conv := "big-" + string(binding)
			_, err := c.SendMessage(ctxT(t), userMsg(conv, big))
			if !errors.Is(err, a2a.ErrInvalidParams) || !regexp.MustCompile(`as a frame of \d+ bytes, over this broker's max_client_frame limit of 32768 bytes`).MatchString(err.Error()) {
				t.Fatalf("a 40 KiB message: %v, want InvalidParams naming max_client_frame's 32768 bytes", err)
			}
			if got := answerOf(t, sendTask(t, c, userMsg(conv, "small"))); got != "echo #1: small" {
				t.Fatalf("the next message on the context: %q, want it answered as the instance's first", got)
			}

			ask := sendTask(t, c, userMsg(conv, "/ask proceed?"))
			if ask.Status.State != a2a.TaskStateInputRequired {
				t.Fatalf("ask task %s", ask.Status.State)
			}
			reply := a2a.NewMessage(a2a.MessageRoleUser, a2a.NewTextPart(big))
			reply.TaskID, reply.ContextID = ask.ID, ask.ContextID
			if _, err := c.SendMessage(ctxT(t), &a2a.SendMessageRequest{Message: reply}); !errors.Is(err, a2a.ErrInvalidParams) || !strings.Contains(err.Error(), "max_client_frame limit of 32768 bytes") {
				t.Fatalf("a 40 KiB answer: %v, want InvalidParams naming max_client_frame", err)
			}
			if got, err := c.GetTask(ctxT(t), &a2a.GetTaskRequest{ID: ask.ID}); err != nil || got.Status.State != a2a.TaskStateInputRequired {
				t.Fatalf("after the refused answer the task is %v, %v; want it still INPUT_REQUIRED", got, err)
			}
			reply = a2a.NewMessage(a2a.MessageRoleUser, a2a.NewTextPart("yes"))
			reply.TaskID, reply.ContextID = ask.ID, ask.ContextID
			if done := sendTask(t, c, &a2a.SendMessageRequest{Message: reply}); done.Status.State != a2a.TaskStateCompleted {
				t.Fatalf("the answer that fits left the task %s", done.Status.State)
			}
		})
	}
}

// TestRelayedSocketAppliesTheOwnersMaxClientFrame: in a cluster over a
// real nats-server, A's max_client_frame is 1024 and B's the default. A
// 2 KiB frame sent through B to A's lease is refused with 1009 naming A's
// limit, and the lease, redialed through B, answers the next input; the
// same frame sent through A to B's lease reaches B's instance.
func TestRelayedSocketAppliesTheOwnersMaxClientFrame(t *testing.T) {
	ns := startNATS(t, 0, nil)
	open := openMember(ns.ClientURL())
	bs := startMembers(t, func(id string) (string, []string) {
		y, env := open(id)
		if id == "a" {
			y = "max_client_frame: 1024\n" + y
		}
		return y, env
	}, Options{}, "a", "b")
	onA, onB := bs["a"].claim(brokerclient.ClaimRequest{}), bs["b"].claim(brokerclient.ClaimRequest{})
	if !strings.HasSuffix(onA.LeaseID, "-a") || !strings.HasSuffix(onB.LeaseID, "-b") {
		t.Fatalf("leases %s and %s, want one owned by each broker", onA.LeaseID, onB.LeaseID)
	}

	viaB := dialVia(t, bs["b"], onA.LeaseID, brokerclient.DialOptions{})
	refusedWith1009(t, viaB, ioFrameOf(t, onA.LeaseID, 2048), "frame of 2048 bytes exceeds max_client_frame (1024 bytes)")
	if l, ok := bs["a"].lease(onA.LeaseID); !ok || l.State != "active" {
		t.Fatalf("after the refusal A's lease is %+v (listed %v), want it active", l, ok)
	}
	viaB = dialVia(t, bs["b"], onA.LeaseID, brokerclient.DialOptions{})
	if got := say(t, viaB, "still here"); got != "echo #1: still here" {
		t.Fatalf("A's lease redialed through B: %.80q, want its first answer", got)
	}

	viaA := dialVia(t, bs["a"], onB.LeaseID, brokerclient.DialOptions{})
	if err := viaA.WriteRaw(ioFrameOf(t, onB.LeaseID, 2048)); err != nil {
		t.Fatal(err)
	}
	_ = viaA.Underlying().SetReadDeadline(time.Now().Add(30 * time.Second))
	if got, err := viaA.Answer(); err != nil || !strings.HasPrefix(got, "echo #1: xxx") {
		t.Fatalf("a 2 KiB frame through A to B's lease: %.40q, %v; want B's instance to answer it", got, err)
	}
}
