package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"

	"github.com/nexus-broker/nexus-broker/internal/config"
	"github.com/nexus-broker/nexus-broker/internal/config/core"
)

// startNode connects a node named id to the NATS server at url, with the
// handlers register adds.
func startNode(t *testing.T, id, url string, register func(*Node)) *Node {
	t.Helper()
	n, err := tryNode(t, id, url, "", register)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// tryNode is startNode that returns Start's error, logging as NATS user
// user (password from $TEST_NATS_PASSWORD) when user is set.
func tryNode(t *testing.T, id, url, user string, register func(*Node)) (*Node, error) {
	t.Helper()
	k := &config.Cluster{URLs: config.Strings{url}, Secret: "handler-test-secret-0123456789abcdef", SubjectPrefix: config.DefaultSubjectPrefix, HeartbeatInterval: core.Duration(100 * time.Millisecond)}
	if user != "" {
		k.User, k.PasswordEnv = user, "TEST_NATS_PASSWORD"
	}
	n, err := New(Options{Config: k, BrokerID: id, Advertise: id + ".example:8080", Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	register(n)
	if err := n.Start(); err != nil {
		return nil, err
	}
	t.Cleanup(n.Close)
	return n, nil
}

// startServer runs an in-process nats-server on loopback until the test
// ends and returns its URL.
func startServer(t *testing.T, tweak func(*natsserver.Options)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	o := &natsserver.Options{Host: "127.0.0.1", Port: port, NoLog: true, NoSigs: true}
	if tweak != nil {
		tweak(o)
	}
	ns, err := natsserver.NewServer(o)
	if err != nil {
		t.Fatal(err)
	}
	go ns.Start()
	if !ns.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats-server did not become ready")
	}
	t.Cleanup(ns.Shutdown)
	return "nats://127.0.0.1:" + strconv.Itoa(port)
}

// waitFor polls cond until it holds or 10 s pass.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(10 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// TestHandlerDeadlineIsReadPerRequest: the deadline a handler answers
// within is its timeout function's value when each request arrives, so a
// reload of the keys it derives from (the resume offer's ready_timeout and
// queue_wait_timeout, say) applies to the next request.
func TestHandlerDeadlineIsReadPerRequest(t *testing.T) {
	url := startServer(t, nil)
	var timeout atomic.Int64
	timeout.Store(int64(time.Hour))
	startNode(t, "a", url, func(a *Node) {
		a.HandleFor("op", func() time.Duration { return time.Duration(timeout.Load()) }, func(ctx context.Context, _ string, _ json.RawMessage) (any, error) {
			d, _ := ctx.Deadline()
			return time.Until(d), nil
		})
	})
	b := startNode(t, "b", url, func(*Node) {})
	for _, want := range []time.Duration{time.Hour, 2 * time.Hour, time.Minute} {
		timeout.Store(int64(want))
		var left time.Duration
		if err := b.CallFor(context.Background(), 3*time.Hour, "a", "op", nil, &left); err != nil {
			t.Fatal(err)
		}
		if left > want || left < want-10*time.Second {
			t.Fatalf("with the timeout now %v, the handler had %v left", want, left)
		}
	}
}

// TestLateRequestIsDropped: a request that reaches its owner after the
// deadline its caller sealed into it is not carried out, and is counted.
func TestLateRequestIsDropped(t *testing.T) {
	url := startServer(t, nil)
	var done atomic.Int32
	a := startNode(t, "a", url, func(a *Node) {
		a.Handle("op", func(context.Context, string, json.RawMessage) (any, error) { done.Add(1); return nil, nil })
	})
	b := startNode(t, "b", url, func(*Node) {})
	late, err := b.stampBody("release it", time.Now().Add(-time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	if err := b.publish(b.nc.Load(), forRequest, b.subject("a", "op"), b.inbox+".late", late); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the late request counted", func() bool { return a.Refused(RefusedLate) == 1 })
	if err := b.Call(context.Background(), "a", "op", nil, nil); err != nil || done.Load() != 1 {
		t.Fatalf("a timely request: %v, the handler ran %d times, want once", err, done.Load())
	}
}

// lineCounter is a log destination that counts the lines holding a string.
type lineCounter struct {
	mu    sync.Mutex
	match string
	n     int
}

func (c *lineCounter) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.n += strings.Count(string(p), c.match)
	return len(p), nil
}

func (c *lineCounter) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n
}

// TestRefusalsAreLoggedOncePerReason: a flood of requests a broker refuses
// (unsealed ones any NATS client can send, late ones) writes one "request
// refused" line per subject and reason in the window, not one per request,
// while every refusal is still counted.
func TestRefusalsAreLoggedOncePerReason(t *testing.T) {
	const n = 300
	url := startServer(t, nil)
	lines := &lineCounter{match: `msg="cluster: request refused"`}
	k := &config.Cluster{URLs: config.Strings{url}, Secret: "handler-test-secret-0123456789abcdef", SubjectPrefix: config.DefaultSubjectPrefix, HeartbeatInterval: core.Duration(100 * time.Millisecond)}
	a, err := New(Options{Config: k, BrokerID: "a", Advertise: "a.example:8080", Log: slog.New(slog.NewTextHandler(lines, nil))})
	if err != nil {
		t.Fatal(err)
	}
	a.Handle("op", func(context.Context, string, json.RawMessage) (any, error) { return nil, nil })
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Close)
	b := startNode(t, "b", url, func(*Node) {})
	nc := b.nc.Load()
	for i := range n {
		if err := nc.PublishRequest(b.subject("a", "op"), b.inbox+".x"+strconv.Itoa(i), []byte("not sealed")); err != nil {
			t.Fatal(err)
		}
		late, err := b.stampBody("release it", time.Now().Add(-time.Millisecond))
		if err != nil {
			t.Fatal(err)
		}
		if err := b.publish(nc, forRequest, b.subject("a", "op"), b.inbox+".late"+strconv.Itoa(i), late); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "every refusal counted", func() bool { return a.Refused(RefusedSeal) == n && a.Refused(RefusedLate) == n })
	waitFor(t, "the first refusal of each reason logged", func() bool { return lines.count() >= 2 })
	if got := lines.count(); got != 2 {
		t.Fatalf("%d refusals of each of 2 reasons wrote %d request refused lines, want 2", n, got)
	}
}

// TestNoRespondersOnlyFails: a request to a broker nobody answers for
// fails at once with ErrNoResponders (NATS's unsealed status), and an
// answer sealed by another broker than the one asked is ignored: the
// owner's own answer is the one delivered.
func TestNoRespondersOnlyFails(t *testing.T) {
	url := startServer(t, nil)
	release := make(chan struct{})
	startNode(t, "a", url, func(a *Node) {
		a.Handle("op", func(context.Context, string, json.RawMessage) (any, error) { <-release; return "from a", nil })
	})
	b := startNode(t, "b", url, func(*Node) {})
	c := startNode(t, "c", url, func(*Node) {})
	start := time.Now()
	if err := b.Call(context.Background(), "nobody", "op", nil, nil); !errors.Is(err, ErrNoResponders) || time.Since(start) > time.Second {
		t.Fatalf("a request nobody subscribes to: %v after %s, want ErrNoResponders at once", err, time.Since(start))
	}
	reply := b.inbox + "." + strconv.FormatUint(b.asked.Load()+1, 10)
	got := make(chan string, 1)
	go func() {
		var s string
		if err := b.Call(context.Background(), "a", "op", nil, &s); err != nil {
			s = err.Error()
		}
		got <- s
	}()
	waitFor(t, "b's request out", func() bool { b.wmu.Lock(); defer b.wmu.Unlock(); return len(b.waiting) == 1 })
	forged, _ := json.Marshal("from c")
	c.respond(reply, envelope{Body: forged})
	if err := c.nc.Load().Flush(); err != nil {
		t.Fatal(err)
	}
	close(release)
	if s := <-got; s != "from a" {
		t.Fatalf("b's request to a was answered %q, want a's answer", s)
	}
}

// TestLiveBrokerIDRefusesTheBoot: a second node with a live node's id is
// refused at Start, naming the id and the live one's advertise_addr.
func TestLiveBrokerIDRefusesTheBoot(t *testing.T) {
	url := startServer(t, nil)
	startNode(t, "a", url, func(*Node) {})
	_, err := tryNode(t, "a", url, "", func(*Node) {})
	if err == nil || !strings.Contains(err.Error(), `broker_id "a" is live`) || !strings.Contains(err.Error(), "a.example:8080") {
		t.Fatalf("a second node with id a: %v, want a refusal naming a.example:8080", err)
	}
}

// TestSubscribePermissionViolationIsFatal: a NATS user that may not
// subscribe to the broker's own request subjects refuses the boot,
// naming the subject; granted them, the same user joins and is ready.
func TestSubscribePermissionViolationIsFatal(t *testing.T) {
	perms := func(sub ...string) *natsserver.Permissions {
		return &natsserver.Permissions{
			Publish:   &natsserver.SubjectPermission{Allow: []string{"nexus.broker.hb", "nexus.broker.b.*.*", "_INBOX.>"}},
			Subscribe: &natsserver.SubjectPermission{Allow: sub},
		}
	}
	url := startServer(t, func(o *natsserver.Options) {
		o.Users = []*natsserver.User{
			{Username: "deaf", Password: "pw-0123", Permissions: perms("nexus.broker.hb", "_INBOX.deaf.>")},
			{Username: "ok", Password: "pw-0123", Permissions: perms("nexus.broker.hb", "_INBOX.ok.>", "nexus.broker.b.ok.*")},
		}
	})
	t.Setenv("TEST_NATS_PASSWORD", "pw-0123")
	_, err := tryNode(t, "deaf", url, "deaf", func(*Node) {})
	if err == nil || !strings.Contains(err.Error(), "subscription to nexus.broker.b.deaf.*") {
		t.Fatalf("a broker that may not subscribe to its own subjects: %v, want a refusal naming them", err)
	}
	n, err := tryNode(t, "ok", url, "ok", func(*Node) {})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the permitted node ready", func() bool { return n.Ready() == nil })
}

// TestNATSPasswordsStayOutOfLogs: a password in a cluster.urls entry
// shows as xxxxx in every log line and error of a broker that cannot
// reach NATS, and in a refused boot's error.
func TestNATSPasswordsStayOutOfLogs(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	ln.Close()
	var logs syncBuffer
	k := &config.Cluster{URLs: config.Strings{"nats://broker:hunter2@" + dead}, Secret: "handler-test-secret-0123456789abcdef", SubjectPrefix: config.DefaultSubjectPrefix, HeartbeatInterval: core.Duration(100 * time.Millisecond)}
	n, err := New(Options{Config: k, BrokerID: "a", Log: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	if err := n.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.Close)
	waitFor(t, "three failed attempts logged", func() bool { return strings.Contains(logs.String(), "NATS unreachable after consecutive attempts") })
	ready := n.Ready()
	if ready == nil || strings.Contains(ready.Error(), "hunter2") || strings.Contains(logs.String(), "hunter2") || !strings.Contains(logs.String(), "broker:xxxxx@"+dead) {
		t.Fatalf("readiness %v; log:\n%s", ready, logs.String())
	}

	url := startServer(t, func(o *natsserver.Options) { o.Username, o.Password = "broker", "right-password" })
	k.URLs = config.Strings{strings.Replace(url, "nats://", "nats://broker:hunter2@", 1)}
	bad, err := New(Options{Config: k, BrokerID: "b", Log: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	if err := bad.Start(); err == nil || strings.Contains(err.Error(), "hunter2") || !strings.Contains(err.Error(), "broker:xxxxx@") {
		t.Fatalf("a refused boot: %v", err)
	}
}

// syncBuffer is a log sink safe for concurrent writers.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
