//go:build linux

// Command netdelay delays the packets netfilter queues to it, for the network faults
// of scripts/netcluster.sh on kernels without netem (CONFIG_NET_SCH_NETEM unset, as
// on the CI machines): an iptables rule sends a namespace's outgoing packets to
// NFQUEUE -queue, and netdelay, run in that namespace, gives each its verdict -delay
// after it came: ACCEPT, or DROP for -loss percent of them at random (dropped at
// once). The delay is the same for every packet and verdicts are given in arrival
// order: packets leave in the order they were sent (no reordering).
//
//	ip netns exec NS netdelay -queue 27 -delay 200ms -loss 5
//
// It prints "ready" on stdout once bound to the queue (a rule with --queue-bypass
// lets packets pass until then). On SIGTERM or SIGINT it accepts every packet it
// keeps at once, waits until none came for 100 ms (the caller deletes the rule
// first), and exits 0. Exit codes: 0 after a signal, 1 when it cannot bind the queue
// or the socket fails, 2 on a bad flag. A module of its own: the library's go.mod
// never requires the netlink packages.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/signal"
	"sync/atomic"
	"syscall"
	"time"

	nfqueue "github.com/florianl/go-nfqueue/v2"
	"github.com/mdlayher/netlink"
)

// waiting is a packet waiting for its verdict.
type waiting struct {
	id  uint32
	due time.Time
}

const (
	// maxWaiting is the kernel queue's length and the delayer's buffer: at 200 ms,
	// 65,536 packets are 327,680 packets per second, far more than a test's cluster
	// sends. Past it the kernel accepts packets without delay (fail-open), never drops.
	maxWaiting = 1 << 16
	// quiet is how long, after a signal, no packet must come before netdelay exits.
	quiet = 100 * time.Millisecond
)

func main() {
	queue := flag.Uint("queue", 27, "the NFQUEUE number to read (the iptables rule's --queue-num)")
	delay := flag.Duration("delay", 200*time.Millisecond, "how long each packet is delayed before it is accepted")
	loss := flag.Float64("loss", 0, "the percentage of packets dropped at random, in [0, 100]")
	flag.Parse()
	switch {
	case *queue > 65535:
		usage("-queue %d, must be in [0, 65535]", *queue)
	case *delay < 0:
		usage("-delay %s, must be >= 0", *delay)
	case *loss < 0 || *loss > 100:
		usage("-loss %g, must be in [0, 100]", *loss)
	case flag.NArg() > 0:
		usage("unexpected arguments %q", flag.Args())
	}
	if err := run(uint16(*queue), *delay, *loss); err != nil {
		fmt.Fprintf(os.Stderr, "netdelay: %v\n", err)
		os.Exit(1)
	}
}

func usage(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "netdelay: "+format+"\n", args...)
	flag.Usage()
	os.Exit(2)
}

func run(queue uint16, delay time.Duration, loss float64) error {
	nf, err := nfqueue.Open(&nfqueue.Config{
		NfQueue:     queue,
		MaxQueueLen: maxWaiting,
		// Metadata only: the verdict needs the packet's id, not its bytes.
		Copymode:     nfqueue.NfQnlCopyMeta,
		Flags:        nfqueue.NfQaCfgFlagFailOpen,
		WriteTimeout: time.Second,
	})
	if err != nil {
		return fmt.Errorf("open the netfilter queue socket (needs root and CONFIG_NETFILTER_NETLINK_QUEUE): %w", err)
	}
	defer func() { _ = nf.Close() }()
	if err := nf.SetOption(netlink.NoENOBUFS, true); err != nil {
		return fmt.Errorf("set NETLINK_NO_ENOBUFS on the queue socket: %w", err)
	}
	if err := nf.Con.SetReadBuffer(8 << 20); err != nil {
		return fmt.Errorf("set the queue socket's read buffer: %w", err)
	}

	pending := make(chan waiting, maxWaiting)
	var (
		draining atomic.Bool
		last     atomic.Int64 // when the last packet came (UnixNano)
		failed   = make(chan error, 1)
	)
	verdict := func(id uint32, v int) {
		if err := nf.SetVerdict(id, v); err != nil {
			select {
			case failed <- fmt.Errorf("verdict on packet %d: %w", id, err):
			default:
			}
		}
	}
	hook := func(a nfqueue.Attribute) int {
		if a.PacketID == nil {
			return 0
		}
		now := time.Now()
		last.Store(now.UnixNano())
		if loss > 0 && rand.Float64()*100 < loss {
			verdict(*a.PacketID, nfqueue.NfDrop)
			return 0
		}
		pending <- waiting{id: *a.PacketID, due: now.Add(delay)}
		return 0
	}
	onErr := func(err error) int {
		var op *netlink.OpError
		if errors.As(err, &op) && (op.Timeout() || op.Temporary()) {
			return 0
		}
		if errors.Is(err, syscall.ENOBUFS) {
			return 0
		}
		select {
		case failed <- fmt.Errorf("read the queue: %w", err):
		default:
		}
		return 1
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := nf.RegisterWithErrorFunc(ctx, hook, onErr); err != nil {
		return fmt.Errorf("bind netfilter queue %d (is another netdelay bound to it?): %w", queue, err)
	}

	// One goroutine gives the verdicts, in arrival order: the delay is the same for
	// every packet, so the due times are in order too.
	go func() {
		t := time.NewTimer(0)
		for p := range pending {
			if wait := time.Until(p.due); wait > 0 && !draining.Load() {
				t.Reset(wait)
				<-t.C
			}
			verdict(p.id, nfqueue.NfAccept)
		}
	}()

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	fmt.Println("ready")
	select {
	case err := <-failed:
		return err
	case s := <-sig:
		// Every packet waiting is accepted now; those still coming (the rule is being
		// deleted) too, until none came for a while.
		draining.Store(true)
		for time.Since(time.Unix(0, last.Load())) < quiet || len(pending) > 0 {
			time.Sleep(10 * time.Millisecond)
		}
		fmt.Fprintf(os.Stderr, "netdelay: %s: every packet waiting accepted, exiting\n", s)
		return nil
	}
}
