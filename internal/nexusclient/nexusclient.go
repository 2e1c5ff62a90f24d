// Package nexusclient is nexus-client: claim an instance (or attach to a
// lease claimed elsewhere), send each input line, print the streamed
// answers, and release on exit. cmd/nexus-client only parses flags.
//
// It talks to the broker as any client does: of the project it imports
// only pkg/brokerclient and pkg/brokerframe.
package nexusclient

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path"
	"sync/atomic"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

// Options are nexus-client's flags.
type Options struct {
	Broker, Binary, Session, Config, Token string
	// WSURL attaches to a lease claimed elsewhere: nothing is claimed, and
	// nothing released on exit.
	WSURL string
	// Keep leaves the claimed lease claimed on exit.
	Keep bool
	// In is the input; Piped says it is not a terminal, so each line waits
	// for its turn to settle before the next is sent or the lease released.
	In    io.Reader
	Piped bool
	Out   io.Writer
}

// Run claims or attaches, relays In to the instance and its answers to Out,
// and releases the lease it claimed unless Keep.
func Run(o Options) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	c := &brokerclient.Client{Base: o.Broker, Token: o.Token}
	// Attaching, the lease id is the ws_url's last segment: what a
	// reconnect needs to ask for a fresh ticket.
	claim := &brokerclient.Claim{WSURL: o.WSURL, LeaseID: path.Base(o.WSURL)}
	if o.WSURL == "" {
		var err error
		claim, err = c.Claim(ctx, brokerclient.ClaimRequest{Config: o.Config, SessionID: o.Session, Binary: o.Binary})
		if err != nil {
			return err
		}
		fmt.Fprintf(o.Out, "claimed lease %s, session %s\nws_url %s\n", claim.LeaseID, claim.SessionID, claim.WSURL)
		if o.Keep {
			defer fmt.Fprintf(o.Out, "lease %s stays claimed; attach again with\n  nexus-client -broker %s -ws %s\nrelease it with\n  curl -X POST %s/release/%s\n",
				claim.LeaseID, o.Broker, claim.WSURL, o.Broker, claim.LeaseID)
		} else {
			defer func() {
				if err := c.Release(context.Background(), claim.LeaseID); err == nil {
					fmt.Fprintln(o.Out, "released", claim.LeaseID)
				}
			}()
		}
	} else {
		fmt.Fprintf(o.Out, "attached to %s\n", o.WSURL)
	}
	if !o.Piped {
		fmt.Fprintln(o.Out, "type a line and press enter; Ctrl-D to finish")
	}
	// A dropped socket is reconnected with a fresh ticket and ?from_seq=,
	// so nothing is lost.
	sess, err := c.Open(ctx, claim)
	if err != nil {
		return err
	}
	var done atomic.Bool // we closed the socket ourselves: not an error to report
	defer func() {
		done.Store(true)
		sess.Close()
	}()
	settled, closed := make(chan struct{}, 1), make(chan struct{})
	go func() {
		defer close(closed)
		printFrames(ctx, sess, o.Out, &done, settled)
	}()
	in := bufio.NewScanner(o.In)
	for in.Scan() {
		select {
		case <-settled: // an idle left over from before this turn
		default:
		}
		if err := sess.Send(ctx, brokerframe.IO{Type: brokerframe.IOInput, Content: in.Text()}); err != nil {
			return err
		}
		if o.Piped {
			select {
			case <-settled:
			case <-closed:
				return nil
			case <-ctx.Done():
				return nil
			}
		}
	}
	return in.Err()
}

// printFrames prints what the instance streams, and signals settled each
// time a turn goes back to idle after doing something.
func printFrames(ctx context.Context, sess *brokerclient.Session, out io.Writer, done *atomic.Bool, settled chan<- struct{}) {
	active := false
	for {
		f, err := sess.Next(ctx)
		if err != nil {
			if !done.Load() {
				fmt.Fprintln(out, "\nconnection closed:", err)
			}
			return
		}
		var p brokerframe.IO
		if f.Signal != brokerframe.SignalIO || json.Unmarshal(f.Payload, &p) != nil {
			continue
		}
		switch p.Type {
		case brokerframe.IOStreamDelta:
			fmt.Fprint(out, p.Content)
		case brokerframe.IOStreamEnd:
			fmt.Fprintln(out)
		case brokerframe.IOOutput:
			fmt.Fprintln(out, p.Content)
		case brokerframe.IOHITLRequest:
			fmt.Fprintf(out, "[question %s] %s\n", p.RequestID, p.Prompt)
		case brokerframe.IOStatus:
			if p.State != brokerframe.StateIdle {
				active = true
				continue
			}
			if active {
				active = false
				select {
				case settled <- struct{}{}:
				default:
				}
			}
			continue
		default:
			continue
		}
		active = true
	}
}
