// Command nexus-client is a small interactive client of nexus-broker: it
// claims an instance, sends each line you type as input, prints the
// streamed answer, and releases on exit. A dropped socket is reconnected
// with a fresh ticket and ?from_seq=, so nothing is lost.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sync/atomic"

	"github.com/nexus-broker/nexus-broker/pkg/brokerclient"
	"github.com/nexus-broker/nexus-broker/pkg/brokerframe"
)

func main() {
	broker := flag.String("broker", "http://127.0.0.1:8080", "the broker's http:// address")
	binary := flag.String("binary", "", "binaries: entry to claim (default: the reserved nexus entry)")
	session := flag.String("session", "", "resume this session id")
	configText := flag.String("engine-config", "engine:\n  name: example\n", "the nexus config (YAML text) the claim carries")
	keep := flag.Bool("keep", false, "do not release the lease on exit")
	token := flag.String("token", os.Getenv("NEXUS_BROKER_TOKEN"), "bearer token, when the broker has an auth: block")
	flag.Parse()
	if err := run(*broker, *binary, *session, *configText, *token, *keep); err != nil {
		fmt.Fprintln(os.Stderr, "nexus-client:", err)
		os.Exit(1)
	}
}

func run(broker, binary, session, configText, token string, keep bool) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	c := &brokerclient.Client{Base: broker, Token: token}
	claim, err := c.Claim(ctx, brokerclient.ClaimRequest{Config: configText, SessionID: session, Binary: binary})
	if err != nil {
		return err
	}
	fmt.Printf("claimed lease %s, session %s\nws_url %s\ntype a line and press enter; Ctrl-D to finish\n", claim.LeaseID, claim.SessionID, claim.WSURL)
	if !keep {
		defer func() {
			if err := c.Release(context.Background(), claim.LeaseID); err == nil {
				fmt.Println("released", claim.LeaseID)
			}
		}()
	}
	sess, err := c.Open(ctx, claim)
	if err != nil {
		return err
	}
	var done atomic.Bool // we closed the socket ourselves: not an error to report
	defer func() {
		done.Store(true)
		sess.Close()
	}()
	go printFrames(ctx, sess, &done)
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		if err := sess.Send(ctx, brokerframe.IO{Type: brokerframe.IOInput, Content: in.Text()}); err != nil {
			return err
		}
	}
	return nil
}

func printFrames(ctx context.Context, sess *brokerclient.Session, done *atomic.Bool) {
	for {
		f, err := sess.Next(ctx)
		if err != nil {
			if !done.Load() {
				fmt.Println("\nconnection closed:", err)
			}
			return
		}
		var p brokerframe.IO
		if f.Signal != brokerframe.SignalIO || json.Unmarshal(f.Payload, &p) != nil {
			continue
		}
		switch p.Type {
		case brokerframe.IOStreamDelta:
			fmt.Print(p.Content)
		case brokerframe.IOStreamEnd:
			fmt.Println()
		case brokerframe.IOOutput:
			fmt.Println(p.Content)
		case brokerframe.IOHITLRequest:
			fmt.Printf("[question %s] %s\n", p.RequestID, p.Prompt)
		}
	}
}
