package cluster

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"strconv"
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
	n, err := New(Options{
		Config:   &config.Cluster{URLs: config.Strings{url}, Secret: "handler-test-secret-0123456789abcdef", SubjectPrefix: config.DefaultSubjectPrefix, HeartbeatInterval: core.Duration(100 * time.Millisecond)},
		BrokerID: id,
		Log:      slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	register(n)
	if err := n.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.Close)
	return n
}

// TestHandlerDeadlineIsReadPerRequest: the deadline a handler answers
// within is its timeout function's value when each request arrives, so a
// reload of the keys it derives from (the resume offer's ready_timeout and
// queue_wait_timeout, say) applies to the next request.
func TestHandlerDeadlineIsReadPerRequest(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	ns, err := natsserver.NewServer(&natsserver.Options{Host: "127.0.0.1", Port: port, NoLog: true, NoSigs: true})
	if err != nil {
		t.Fatal(err)
	}
	go ns.Start()
	if !ns.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats-server did not become ready")
	}
	t.Cleanup(ns.Shutdown)
	url := "nats://127.0.0.1:" + strconv.Itoa(port)

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
		if err := b.CallFor(context.Background(), 10*time.Second, "a", "op", nil, &left); err != nil {
			t.Fatal(err)
		}
		if left > want || left < want-10*time.Second {
			t.Fatalf("with the timeout now %v, the handler had %v left", want, left)
		}
	}
}
