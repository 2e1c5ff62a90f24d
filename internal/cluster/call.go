package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
)

// RemoteError is a handler's error, as the peer said it.
type RemoteError struct{ Text string }

func (e *RemoteError) Error() string { return e.Text }

// Refused is how many sealed-message checks refused a message for reason
// (one of RefusedReasons) since the start.
func (n *Node) Refused(reason string) uint64 {
	return n.refused[reason].Load()
}

// refuse logs a request that is not answered: the subject and why, never
// its data. Anyone who can publish on NATS can cause it once per message,
// so it is bounded per subject (this broker's, naming the op: who sent a
// message is unknown until its seal is checked) and reason (logbound).
func (n *Node) refuse(subject string, err error) {
	reason := "unreadable"
	if r := (*refusal)(nil); errors.As(err, &r) {
		reason = r.reason
	}
	n.quiet.Warn(subject+" "+reason, "cluster: request refused", "subject", subject, "error", err)
}

// serve takes one request (or one chunk of it: chunks are reassembled
// here, in the order they arrive) and answers it on its own goroutine: a
// stream read may wait up to ReadWait, and must not hold up the requests
// behind it. Requests that must stay in order (a client's frames) are sent
// one at a time. A refused request is not answered: a caller without the
// secret learns nothing, and a replay is not done twice.
func (n *Node) serve(msg *nats.Msg) {
	data, done, err := n.receive(forRequest, msg)
	switch {
	case errors.Is(err, ErrIncomplete):
		n.incomplete(msg.Subject, msg.Reply, err)
		return
	case err != nil:
		n.refuse(msg.Subject, err)
		return
	case !done:
		return
	}
	go func() {
		e, err := n.open(data)
		if err != nil {
			n.refuse(msg.Subject, err)
			return
		}
		now := time.Now()
		if e.Deadline != 0 && now.UnixNano() > e.Deadline {
			n.refuse(msg.Subject, n.count(&refusal{RefusedLate, fmt.Errorf("late: it arrived %s after its caller's deadline, when the caller had already given up on it", now.Sub(time.Unix(0, e.Deadline)).Round(time.Millisecond))}))
			return
		}
		op := msg.Subject[strings.LastIndexByte(msg.Subject, '.')+1:]
		h, ok := n.handlers[op]
		var out any
		if !ok {
			err = fmt.Errorf("unknown op %q", op)
		} else {
			deadline := now.Add(h.timeout())
			if e.Deadline != 0 {
				deadline = time.Unix(0, min(deadline.UnixNano(), e.Deadline))
			}
			ctx, cancel := context.WithDeadline(n.ctx, deadline)
			out, err = h.h(ctx, e.From, e.Body)
			cancel()
		}
		var answer envelope
		if err != nil {
			answer.Error = err.Error()
		} else if answer.Body, err = json.Marshal(out); err != nil {
			answer.Error = err.Error()
		}
		n.respond(msg.Reply, answer)
	}()
}

// respond sends e, sealed as a reply, to a request's reply subject.
func (n *Node) respond(reply string, e envelope) {
	nc := n.nc.Load()
	if reply == "" || nc == nil {
		return
	}
	data, err := n.stamp(e)
	if err == nil {
		err = n.publish(nc, forReply, reply, "", data)
	}
	if err != nil {
		n.quiet.Warn("", "cluster: answering a request failed", "subject", reply, "error", err)
	}
}

// waiter is a request of ours waiting for its answer from broker to.
type waiter struct {
	to string
	ch chan result
}

// result is what a request of ours got: an answer's body, or why none.
type result struct {
	body json.RawMessage
	err  error
}

// answered takes an answer (or a chunk of one) to a request of ours. Only
// an answer sealed as a reply to this very reply subject, fresh, not seen
// before and from the broker asked is delivered; anything else is ignored
// (the real answer may still come). NATS's unsealed "no responders" is
// taken only as what it says, and fails the request.
func (n *Node) answered(msg *nats.Msg) {
	if len(msg.Data) == 0 && msg.Header.Get("Status") == noResponders {
		n.deliver(msg.Subject, "", result{err: ErrNoResponders})
		return
	}
	data, done, err := n.receive(forReply, msg)
	switch {
	case errors.Is(err, ErrIncomplete):
		n.deliver(msg.Subject, "", result{err: err})
		return
	case err != nil || !done:
		return
	}
	e, err := n.open(data)
	var remote *RemoteError
	if err != nil && !errors.As(err, &remote) {
		return
	}
	n.deliver(msg.Subject, e.From, result{body: e.Body, err: err})
}

// deliver hands r to the request waiting on reply subject, once; from,
// unless "", must be the broker it asked.
func (n *Node) deliver(subject, from string, r result) {
	n.wmu.Lock()
	w, ok := n.waiting[subject]
	if ok && (from == "" || from == w.to) {
		delete(n.waiting, subject)
	} else {
		ok = false
	}
	n.wmu.Unlock()
	if ok {
		w.ch <- r
	}
}

// Call sends body to broker to's op and decodes the answer into out. A
// peer that does not answer within CallTimeout (down, partitioned, NATS
// lost) is ErrUnavailable; a handler's error is a *RemoteError.
func (n *Node) Call(ctx context.Context, to, op string, body, out any) error {
	return n.CallFor(ctx, CallTimeout, to, op, body, out)
}

// CallFor is Call with its own deadline (or ctx's, if sooner), which
// travels sealed with the request: the owner drops a request that reaches
// it later. The reply subject is this broker's own, fresh for the request
// and sealed with it, so neither the request nor where its answer goes can
// be re-used.
func (n *Node) CallFor(ctx context.Context, timeout time.Duration, to, op string, body, out any) error {
	nc := n.nc.Load()
	if nc == nil || !nc.IsConnected() {
		return ErrUnavailable
	}
	return n.call(nc, ctx, timeout, to, op, body, out)
}

func (n *Node) call(nc *nats.Conn, ctx context.Context, timeout time.Duration, to, op string, body, out any) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	deadline, _ := ctx.Deadline()
	data, err := n.stampBody(body, deadline)
	if err != nil {
		return err
	}
	reply := n.inbox + "." + strconv.FormatUint(n.asked.Add(1), 10)
	ch := make(chan result, 1)
	n.wmu.Lock()
	n.waiting[reply] = waiter{to: to, ch: ch}
	n.wmu.Unlock()
	defer func() {
		n.wmu.Lock()
		delete(n.waiting, reply)
		n.wmu.Unlock()
	}()
	if err := n.publish(nc, forRequest, n.subject(to, op), reply, data); err != nil {
		if errors.Is(err, nats.ErrConnectionClosed) || errors.Is(err, nats.ErrConnectionReconnecting) || errors.Is(err, nats.ErrReconnectBufExceeded) {
			return ErrUnavailable
		}
		return err
	}
	var r result
	select {
	case r = <-ch:
	case <-ctx.Done():
		return ErrUnavailable
	}
	if r.err != nil || out == nil {
		return r.err
	}
	return json.Unmarshal(r.body, out)
}
