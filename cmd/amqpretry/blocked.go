package main

import (
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"

	"github.com/spf13/cobra"

	"github.com/amqpretry/amqpretry/cmd/amqpretry/internal/format"
	"github.com/amqpretry/amqpretry/ops"
)

const blockedHelp = `An order key (amqpretry.Config.OrderKey) is blocked while a message of it, its head,
waits for its retry, or was poisoned with Config.BlockOnPoison: its later messages wait
on the broker, in order, in a queue of its own, <prefix>.behind.<hash of the work
queue>.<key>. Listing those queues needs rabbitmqctl (--rabbitmqctl): AMQP cannot list
queues. A poisoned head is read from the poison queue as poison list reads it (taken and
given back, in place), up to its first 10,000 messages. See docs/ordering.md.`

func (a *app) blockedCmd() *cobra.Command {
	return group("blocked", "Order keys blocked behind their head: list, release",
		a.blockedListCmd(), a.blockedReleaseCmd())
}

// blockedJSON is blocked list's --json output.
type blockedJSON struct {
	Keys []ops.BlockedKey `json:"keys"`
	// Behind sums the messages behind the keys; PoisonedHeads counts the keys whose
	// head is in the poison queue.
	Behind        int `json:"behind"`
	PoisonedHeads int `json:"poisoned_heads"`
}

func (a *app) blockedListCmd() *cobra.Command {
	var src countsSource
	var queue string
	c := &cobra.Command{
		Use:   "list",
		Short: "List the blocked order keys: what waits behind each, and its poisoned head",
		Long: `list prints the blocked order keys: the work queue, the key, how many messages wait
behind it, and its head when that is in the poison queue: its UUID, how long ago it was
poisoned, the reason and the error. A key whose head is not in the poison queue waits
for its head's retry, which releases the key when it succeeds (or its head is gone:
purged, or redriven as any other message). amqpretry blocked release releases a key.

` + blockedHelp + `

` + exitHelp,
		Args: noArgs,
		RunE: func(*cobra.Command, []string) error {
			ctl := src.ctlRunner(a.uri)
			if ctl == nil {
				return usagef("blocked list needs rabbitmqctl (--rabbitmqctl): each blocked key has a queue of its own, and AMQP cannot list queues")
			}
			o, err := a.openCtl(ctl)
			if err != nil {
				return err
			}
			defer o.Close()
			all, err := o.Blocked(a.ctx)
			if err != nil {
				return err
			}
			keys := []ops.BlockedKey{}
			for _, k := range all {
				if queue == "" || k.Queue == queue {
					keys = append(keys, k)
				}
			}
			if a.json {
				out := blockedJSON{Keys: keys}
				for _, k := range keys {
					out.Behind += k.Behind
					if k.Head != nil {
						out.PoisonedHeads++
					}
				}
				return a.emit(out)
			}
			a.printBlocked(keys, time.Now())
			return nil
		},
	}
	c.Flags().StringVar(&queue, "queue", "", "only the keys of this work queue")
	src.ctlFlags(c)
	return c
}

// printBlocked prints the blocked keys as a table, then one line of totals and how
// to release one.
func (a *app) printBlocked(keys []ops.BlockedKey, now time.Time) {
	if len(keys) == 0 {
		a.printf("no blocked key\n")
		return
	}
	tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "QUEUE\tKEY\tBEHIND\tHEAD\tPOISONED\tREASON\tERROR")
	for _, k := range keys {
		if k.Head == nil {
			fmt.Fprintf(tw, "%s\t%s\t%d\t(waits for its retry)\t-\t-\t-\n", k.Queue, shownKey(k.Key), k.Behind)
			continue
		}
		age := "-"
		if !k.Head.LastFailure.IsZero() {
			age = format.Duration(now.Sub(k.Head.LastFailure)) + " ago"
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\t%s\n", k.Queue, shownKey(k.Key), k.Behind, messageID(*k.Head), age,
			orDash(string(k.Head.Reason)), orDash(clip(k.Head.Error, 60)))
	}
	_ = tw.Flush()
	a.printf("%s\n", format.Blocked(keys))
	a.printf("release one: amqpretry blocked release --queue QUEUE --key KEY (--redrive-head: its poisoned head runs first)\n")
}

// shownKey writes a key as it is, or quoted when it has spaces or control characters
// (--json has it exactly).
func shownKey(k string) string {
	if k == "" || strings.IndexFunc(k, func(r rune) bool { return unicode.IsSpace(r) || unicode.IsControl(r) || r == '"' }) >= 0 {
		return strconv.Quote(k)
	}
	return k
}

func (a *app) blockedReleaseCmd() *cobra.Command {
	var opts ops.ReleaseOptions
	var src countsSource
	var yes bool
	c := &cobra.Command{
		Use:   "release --queue QUEUE --key KEY",
		Short: "Let the messages behind a blocked key run, or redrive its poisoned head first (asks first)",
		Long: `release lets the messages waiting behind a blocked order key run, in order, without its
poisoned head: it sends a release to the key's work queue (a message the retry
middleware takes for one, confirmed), and the application consuming that queue runs
them and unblocks the key. The head stays in the poison queue (redriven later, it runs
after them, as any message of its key).

With --redrive-head it sends the poisoned head back to its work queue instead, its
attempts reset, as the key's head: the messages behind the key run once it succeeds
(poisoned again, it blocks the key again with Config.BlockOnPoison).

Either way nothing runs until the application consumes the work queue: a release sent
while it is stopped waits in the queue for it.

It refuses a key that is not blocked, and one whose head is not in the poison queue:
that head waits for its retry, which releases the key when it succeeds, and the
messages behind it would overtake it. --force releases such a key anyway: its messages
then run before their head, out of the key's order.

` + confirmHelp + `

` + blockedHelp + `

` + exitHelp,
		Args: noArgs,
		RunE: func(*cobra.Command, []string) error {
			if opts.Queue == "" || opts.Key == "" {
				return usagef("blocked release: --queue and --key are both required: the work queue and the key (amqpretry blocked list shows them)")
			}
			if !opts.DryRun {
				if err := a.mayDestroy("blocked release lets a key's messages run, which cannot be undone", yes); err != nil {
					return err
				}
			}
			ctl := src.ctlRunner(a.uri)
			if ctl == nil {
				return usagef("blocked release needs rabbitmqctl (--rabbitmqctl): it finds the key's queue by listing them, which AMQP cannot")
			}
			o, err := a.openCtl(ctl)
			if err != nil {
				return err
			}
			defer o.Close()
			if !opts.DryRun && !yes {
				dry := opts
				dry.DryRun = true
				_, proceed, err := confirmFirst(a, func() (ops.ReleaseResult, error) { return o.Release(a.ctx, dry) }, nil,
					func(r ops.ReleaseResult) { a.printRelease(a.stderr, r) }, releaseQuestion)
				if !proceed {
					return releaseError(err)
				}
			}
			r, err := o.Release(a.ctx, opts)
			if err != nil {
				return releaseError(err)
			}
			if a.json {
				return a.emit(r)
			}
			a.printRelease(a.stdout, r)
			return nil
		},
	}
	f := c.Flags()
	f.StringVar(&opts.Queue, "queue", "", "the work queue of the key (required)")
	f.StringVar(&opts.Key, "key", "", "the blocked order key (required)")
	f.BoolVar(&opts.RedriveHead, "redrive-head", false, "send the key's poisoned head back to its work queue first (attempts reset): the messages behind it run once it succeeds")
	f.BoolVar(&opts.Force, "force", false, "release a key whose head is not in the poison queue (its retry waits): the messages behind it then run before their head, out of order")
	f.BoolVar(&opts.DryRun, "dry-run", false, "report what would be done, change nothing")
	yesFlag(c, &yes)
	src.ctlFlags(c)
	return c
}

// releaseFlags names the CLI's flags in ops.Release's refusals.
var releaseFlags = strings.NewReplacer(
	"set Force to release it anyway", "pass --force to release it anyway (they then run before their head, out of the key's order)",
	"release without it, with Force,", "release without --redrive-head, with --force,",
)

// releaseError is ops.Release's error in the command's words; a key not blocked
// points at the list.
func releaseError(err error) error {
	if err == nil || errors.Is(err, errDeclined) {
		return err
	}
	msg := releaseFlags.Replace(err.Error())
	if strings.Contains(msg, ": not blocked (") {
		msg += "; amqpretry blocked list shows the blocked keys"
	}
	return fmt.Errorf("%s", msg)
}

// releaseQuestion is release's prompt for what its dry run r showed.
func releaseQuestion(r ops.ReleaseResult) string {
	n, key := messages(r.Key.Behind), shownKey(r.Key.Key)
	switch {
	case r.Redriven != nil:
		return fmt.Sprintf("redrive head %s, then run the %s behind key %s?", messageID(*r.Redriven), n, key)
	case r.Key.Head == nil:
		return fmt.Sprintf("run the %s behind key %s now, before its head?", n, key)
	}
	return fmt.Sprintf("run the %s behind key %s, without its head?", n, key)
}

// messages is "1 message" or "N messages".
func messages(n int) string {
	if n == 1 {
		return "1 message"
	}
	return strconv.Itoa(n) + " messages"
}

// printRelease prints what a release did (would do, in a dry run) on w.
func (a *app) printRelease(w io.Writer, r ops.ReleaseResult) {
	line := format.Release(r, shownKey(r.Key.Key), a.poisonQueueName())
	switch {
	case r.DryRun:
		fmt.Fprintf(w, "dry run: %s; nothing changed\n", line)
	case r.Released:
		fmt.Fprintf(w, "%s\n  a release went to %s: the application consuming it runs what waits behind the key, then unblocks it (amqpretry blocked list no longer shows it)\n", line, r.Key.Queue)
	default:
		fmt.Fprintf(w, "%s\n  the key stays blocked until then (amqpretry blocked list shows it)\n", line)
	}
}

// poisonQueueName is the poison queue the flags name.
func (a *app) poisonQueueName() string {
	cfg, err := a.retryConfig()
	if err != nil {
		return "the poison queue"
	}
	return cfg.WithDefaults().PoisonQueue
}
