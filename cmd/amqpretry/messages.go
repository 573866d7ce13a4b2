package main

import (
	"context"
	"fmt"
	"github.com/amqpretry/amqpretry/cmd/amqpretry/internal/format"
	"io"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/ops"
	"github.com/amqpretry/amqpretry/xdeath"
)

// reasons are the poison reasons --reason takes: every amqpretry.Reason.
var reasons = []amqpretry.Reason{
	amqpretry.ReasonPermanent, amqpretry.ReasonMaxAttempts, amqpretry.ReasonDelayTooLong,
	amqpretry.ReasonHandoffFailed, amqpretry.ReasonTooLarge, amqpretry.ReasonDeliveryLimit,
}

func reasonList() string {
	s := make([]string, len(reasons))
	for i, r := range reasons {
		s[i] = string(r)
	}
	return strings.Join(s, ", ")
}

// filterFlags adds the filter flags to fs; check validates them.
func filterFlags(fs *pflag.FlagSet, f *ops.Filter) (check func() error) {
	fs.StringVar(&f.Queue, "queue", "", "only messages that failed on this queue (or, in the parking queue, were due back to it)")
	reason := fs.String("reason", "", "only this poison reason: "+reasonList())
	fs.StringVar(&f.Error, "error", "", "only messages whose error contains this text")
	fs.Var(nonNegativeDuration{&f.OlderThan}, "older-than", "only messages that failed (in the parking queue: came due) longer ago than this")
	fs.Var(nonNegativeDuration{&f.NewerThan}, "newer-than", "only messages that failed (in the parking queue: came due) more recently than this")
	fs.StringArrayVar(&f.IDs, "id", nil, "only this message (Watermill UUID or AMQP message id); repeat for more")
	return func() error {
		if *reason == "" {
			return nil
		}
		for _, r := range reasons {
			if string(r) == *reason {
				f.Reason = r
				return nil
			}
		}
		return usagef("--reason: unknown reason %q (known: %s)", *reason, reasonList())
	}
}

func (a *app) poisonCmd() *cobra.Command {
	return group("poison", "The poison queue: messages that failed for good, with their failure envelope",
		a.listCmd(ops.Poison), a.showCmd(), a.moveCmd(ops.Poison, false), a.moveCmd(ops.Poison, true))
}

func (a *app) parkingCmd() *cobra.Command {
	return group("parking", "The parking queue: retries whose work queue was gone when they came due",
		a.listCmd(ops.Parking), a.moveCmd(ops.Parking, false), a.moveCmd(ops.Parking, true))
}

const readingHelp = `Messages are read with basic.get and kept unacknowledged, then given back with one
basic.nack(requeue), which puts them back in their places, in order: nothing changes. At
most --window messages are kept at once; the run stops when the window is full.`

func (a *app) listCmd(source ops.Source) *cobra.Command {
	var opts ops.ListOptions
	limit, window := 100, 10_000
	var check func() error
	c := &cobra.Command{
		Use:   "list",
		Short: fmt.Sprintf("List the messages of the %s queue that match the filters", source),
		Long: fmt.Sprintf(`list prints the messages of the %s queue that match the filters, in queue order.

%s

%s`, source, readingHelp, exitHelp),
		Args: noArgs,
		RunE: func(*cobra.Command, []string) error {
			if err := check(); err != nil {
				return err
			}
			opts.Limit, opts.Window = limit, window
			if limit == 0 {
				opts.Limit = -1
			}
			o, _, err := a.open()
			if err != nil {
				return err
			}
			defer o.Close()
			r, err := o.List(a.ctx, source, opts)
			if err != nil {
				return err
			}
			if a.json {
				return a.emit(r)
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			if source == ops.Parking {
				fmt.Fprintln(tw, "UUID\tQUEUE\tATTEMPT\tDUE\tERROR")
			} else {
				fmt.Fprintln(tw, "UUID\tQUEUE\tREASON\tATTEMPT\tLAST FAILURE\tERROR")
			}
			for _, m := range r.Messages {
				if source == ops.Parking {
					fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", m.UUID, orDash(m.Queue), attempt(m), stamp(m.Due), orDash(clip(m.Error, 60)))
				} else {
					fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", m.UUID, orDash(m.Queue), orDash(string(m.Reason)), attempt(m), stamp(m.LastFailure), orDash(clip(m.Error, 60)))
				}
			}
			_ = tw.Flush()
			more := ""
			if !r.Complete {
				more = " (stopped early: --limit or --window reached)"
			}
			a.printf("%d of %d messages in %s shown, %d scanned%s\n", len(r.Messages), r.Depth, r.Queue, r.Scanned, more)
			return nil
		},
	}
	check = filterFlags(c.Flags(), &opts.Filter)
	c.Flags().Var(boundedInt{&limit, 0}, "limit", "at most this many messages (0: all)")
	c.Flags().Var(boundedInt{&window, 1}, "window", "at most this many messages read and kept unacked while scanning")
	return c
}

func (a *app) showCmd() *cobra.Command {
	var opts ops.ListOptions
	limit, window := 1, 10_000
	var check func() error
	c := &cobra.Command{
		Use:   "show [ID]...",
		Short: "Show poisoned messages in full: envelope, headers, payload",
		Long: `show prints the messages of the poison queue named by their Watermill UUID or AMQP
message id, or, without IDs, the first --limit that match the filters, in full: the
failure envelope, every other header, and the payload. With IDs it shows every message
that has one of them (the whole queue is read, up to --window messages): an ID may name
several (a message poisoned again after a redrive, a copy published twice), and each is
shown, numbered ("1 of 2 with this id").

` + readingHelp + `

` + exitHelp,
		RunE: func(_ *cobra.Command, ids []string) error {
			if err := check(); err != nil {
				return err
			}
			opts.IDs = append(opts.IDs, ids...)
			opts.Limit, opts.Window, opts.Full = limit, window, true
			if len(opts.IDs) > 0 {
				opts.Limit = -1 // every message with the IDs, not the first
			}
			o, _, err := a.open()
			if err != nil {
				return err
			}
			defer o.Close()
			r, err := o.List(a.ctx, ops.Poison, opts)
			if err != nil {
				return err
			}
			if len(r.Messages) == 0 {
				return fmt.Errorf("no matching message in queue %q (%d scanned)", r.Queue, r.Scanned)
			}
			if a.json {
				return a.emit(r.Messages)
			}
			// Messages that share an ID are numbered, in queue order.
			idOf := func(m ops.Message) string {
				for _, id := range opts.IDs {
					if id == m.UUID || id == m.MessageID {
						return id
					}
				}
				return ""
			}
			count, seen := map[string]int{}, map[string]int{}
			for _, m := range r.Messages {
				count[idOf(m)]++
			}
			for i, m := range r.Messages {
				if i > 0 {
					a.printf("\n")
				}
				id := idOf(m)
				seen[id]++
				note := ""
				switch {
				case id == "" || count[id] < 2:
				case id == m.UUID:
					note = fmt.Sprintf(" (%d of %d with this id)", seen[id], count[id])
				default: // its AMQP message id
					note = fmt.Sprintf(" (%d of %d with id %s)", seen[id], count[id], id)
				}
				a.printEnvelope(m, note)
			}
			if len(opts.IDs) > 0 && !r.Complete {
				a.printf("\nread %d of the %d messages in %s (--window %d): more may have these ids\n", r.Scanned, r.Depth, r.Queue, window)
			}
			return nil
		},
	}
	check = filterFlags(c.Flags(), &opts.Filter)
	c.Flags().Var(boundedInt{&limit, 1}, "limit", "without IDs: show this many matching messages (with IDs: every message that has one)")
	c.Flags().Var(boundedInt{&window, 1}, "window", "at most this many messages read and kept unacked while scanning")
	return c
}

// moveFlags defines the flags every move (redrive, retry now, purge) shares, for what
// it moves (noun: "messages", "retries").
func moveFlags(f *pflag.FlagSet, opts *ops.MoveOptions, rate *rateFlag, window *int, noun string) {
	f.Var(boundedInt{&opts.Limit, 0}, "limit", "act on at most this many matching "+noun+" (0: all)")
	f.BoolVar(&opts.DryRun, "dry-run", false, "report what would be done, change nothing")
	f.Var(rate, "rate", "at most this many "+noun+" per second: N/s or N/m (default: as fast as confirms come)")
	f.Var(boundedInt{window, 1}, "window", "at most this many "+noun+" kept (not matching, unroutable, dry run) before the run stops")
}

// shown are the metadata keys printEnvelope prints itself, or leaves out.
var shown = shownKeys()

// shownKeys returns the keys of the envelope fields printEnvelope prints (as
// middleware.Envelope.Write writes them), the key in which the library's marshaler
// (ops reads with it, as xdeath.Marshaler does) lists the headers it encoded, and
// RabbitMQ's counts of the poison queue's own deliveries of the message (quorum
// queues), the listings among them.
func shownKeys() map[string]bool {
	out := map[string]bool{"x-delivery-count": true, "x-acquired-count": true}
	t := time.Unix(1, 0)
	md := map[string]string{}
	middleware.Envelope{
		Attempt: 1, MaxAttempts: 1, Reason: amqpretry.ReasonPermanent, Error: "e", ErrorTypes: []string{"t"}, Stack: "s",
		FirstFailure: t, LastFailure: t, Handler: "h", Topic: "t", Queue: "q", RedrivenAt: t, Redriven: 1, RedrivenFrom: "f",
	}.Write(md)
	for k := range md {
		out[k] = true
	}
	// What the marshaler adds to a delivery with one typed header: its list.
	const probe = "probe"
	if msg, err := (xdeath.Marshaler{}).Unmarshal(amqp.Delivery{Headers: amqp.Table{probe: int64(1)}}); err == nil {
		for k := range msg.Metadata {
			if k != probe {
				out[k] = true
			}
		}
	}
	return out
}

// printEnvelope prints m in full, note after its first line.
func (a *app) printEnvelope(m ops.Message, note string) {
	tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
	row := func(k, v string) { fmt.Fprintf(tw, "  %s\t%s\n", k, v) }
	a.printf("message %s%s\n", m.UUID, note)
	row("queue:", orDash(m.Queue))
	row("reason:", orDash(string(m.Reason)))
	row("error:", orDash(m.Error))
	row("error types:", orDash(strings.Join(m.ErrorTypes, " > ")))
	if m.Stack != "" {
		// The function that panicked: the stack's first line (the console shows it whole).
		frame, _, _ := strings.Cut(m.Stack, "\n")
		row("panicked in:", frame)
	}
	attempts := attempt(m)
	if m.MaxAttempts > 0 {
		attempts += " of " + strconv.Itoa(m.MaxAttempts)
	}
	row("attempts:", attempts)
	row("first failure:", ago(m.FirstFailure))
	row("last failure:", ago(m.LastFailure))
	row("handler:", orDash(m.Handler))
	row("topic:", orDash(m.Topic))
	if m.Redriven > 0 {
		row("redriven:", fmt.Sprintf("%d times, last %s from %s", m.Redriven, ago(m.RedrivenAt), m.RedrivenFrom))
	}
	row("amqp message id:", orDash(m.MessageID))
	row("payload:", fmt.Sprintf("%d bytes: %q", m.Size, clip(string(m.Payload), 200)))
	ks := make([]string, 0, len(m.Metadata))
	for k := range m.Metadata {
		if !shown[k] {
			ks = append(ks, k)
		}
	}
	sort.Strings(ks)
	for _, k := range ks {
		row(k+":", clip(m.Metadata[k], 200))
	}
	_ = tw.Flush()
}

// moveCmd is redrive (purge false) and purge.
func (a *app) moveCmd(source ops.Source, purge bool) *cobra.Command {
	var opts ops.MoveOptions
	window := 10_000
	var rate rateFlag
	var yes bool
	var check func() error
	name, doing := "redrive", "redriving"
	short := fmt.Sprintf("Send matching messages of the %s queue back to the queue each failed on", source)
	long := `redrive sends each matching message back to the queue it failed on (for a retry in the
parking queue, the queue it was due back to) through the library's confirmed hand-off: persistent,
mandatory, confirm awaited, and only then acked here: at-least-once, nothing lost. A
message whose queue does not exist stays where it is, reported (exit status 1).
--dry-run checks each queue the same way, passively (a passive queue.declare, nothing
published): it reports the messages the run would leave, and why, with the run's exit
status. Killed
mid-run, a message is back on its queue or still here (the one whose confirm arrived
just before the kill may be in both); Ctrl-C stops between two messages.`
	if source == ops.Parking {
		short = "Send matching retries of the parking queue to the queue each was due back to, once it exists again"
	}
	if purge {
		name, doing = "purge", "purging"
		short = fmt.Sprintf("Delete matching messages of the %s queue (asks first; no filter: needs --all)", source)
		long = "purge deletes (acks) each matching message. Without a filter it needs --all.\n\n" + confirmHelp
	}
	kind := moveKind{source: source, purge: purge}
	c := &cobra.Command{
		Use:   name,
		Short: short,
		Long: long + `

` + readingHelp + ` The others stay in place, in order. Long runs show
a progress bar on a terminal, a line of counts a second otherwise (stderr).

` + exitHelp,
		Args: noArgs,
		RunE: func(*cobra.Command, []string) error {
			if err := check(); err != nil {
				return err
			}
			if purge && opts.Filter.Queue == "" && opts.Filter.Reason == "" && opts.Filter.Error == "" &&
				opts.Filter.OlderThan == 0 && opts.Filter.NewerThan == 0 && len(opts.Filter.IDs) == 0 && !opts.All {
				return usagef("%s purge: no filter given; pass --all to purge every message", source)
			}
			if purge && !opts.DryRun {
				if err := a.mayDestroy(fmt.Sprintf("%s purge deletes messages for good", source), yes); err != nil {
					return err
				}
			}
			opts.Rate, opts.Window = float64(rate), window
			o, _, err := a.open()
			if err != nil {
				return err
			}
			defer o.Close()
			if !purge {
				prog := newProgress(a.stderr, doing, kind.done())
				opts.Progress = prog.update
				r, err := o.Redrive(a.ctx, source, opts)
				prog.done()
				if err != nil {
					return err
				}
				return a.reportMove(r, kind, opts)
			}
			return a.purge(o, kind, yes, opts)
		},
	}
	f := c.Flags()
	check = filterFlags(f, &opts.Filter)
	moveFlags(f, &opts, &rate, &window, "messages")
	if purge {
		f.BoolVar(&opts.All, "all", false, "purge every message when no filter is given")
		yesFlag(c, &yes)
	} else {
		def := source == ops.Poison
		f.BoolVar(&opts.ResetAttempts, "reset-attempts", def,
			"remove the attempt count so the message gets the policy's full attempts again (poison: default true, else a message left at its last attempt is poisoned again at its next failure; parking: default false, a retry of the parking queue keeps its place in its schedule)")
	}
	return c
}

// purge runs a purge of kind.source, confirmed (confirmMove), and reports it.
func (a *app) purge(o *ops.Ops, kind moveKind, yes bool, opts ops.MoveOptions) error {
	r, confirmed, err := a.confirmMove(yes, opts,
		func(opts ops.MoveOptions, progress bool) (ops.MoveResult, error) {
			if !progress {
				return o.Purge(a.ctx, kind.source, opts)
			}
			prog := newProgress(a.stderr, "purging", kind.done())
			opts.Progress = prog.update
			defer prog.done()
			return o.Purge(a.ctx, kind.source, opts)
		},
		func(r ops.MoveResult) string {
			return fmt.Sprintf("purge these %d %s for good?", r.Matched, kind.noun())
		},
		func(r ops.MoveResult) { a.printMove(a.stderr, r, kind, opts) })
	if err != nil {
		return err
	}
	kind.confirmed = confirmed
	return a.reportMove(r, kind, opts)
}

// moveKind is what a move does (redrive or retry now, or purge) and to which source:
// the words of its output.
type moveKind struct {
	source ops.Source
	purge  bool
	// confirmed: the run acted on what the prompt showed, and stopped there.
	confirmed bool
}

// noun is what the move acts on.
func (k moveKind) noun() string {
	if k.source == ops.Waiting {
		return "retries" // each line says where they wait
	}
	return "messages"
}

// verb is the move in the infinitive: purge, retry now, redrive.
func (k moveKind) verb() string {
	switch {
	case k.purge:
		return "purge"
	case k.source == ops.Waiting:
		return "retry now"
	}
	return "redrive"
}

// done is the move's past participle: purged, retried now, redriven.
func (k moveKind) done() string {
	switch {
	case k.purge:
		return "purged"
	case k.source == ops.Waiting:
		return "retried now"
	}
	return "redriven"
}

// reportMove prints r (as JSON with --json) and returns the exit it calls for: an
// interrupted run, or messages left unrouted, are not a success.
func (a *app) reportMove(r ops.MoveResult, kind moveKind, opts ops.MoveOptions) error {
	if a.json {
		if err := a.emit(r); err != nil {
			return err
		}
	} else {
		a.printMove(a.stdout, r, kind, opts)
	}
	switch {
	case r.Stopped == "interrupted":
		return context.Canceled
	case len(r.Unrouted) > 0:
		return errFlagged
	}
	return nil
}

// printMove prints r as text on w. For waiting retries every line names where they
// wait (the delay queues) and the work queue they come back to.
func (a *app) printMove(w io.Writer, r ops.MoveResult, kind moveKind, opts ops.MoveOptions) {
	printf := func(format string, args ...any) { fmt.Fprintf(w, format, args...) }
	from := r.Queue
	if kind.source == ops.Waiting {
		where := "no delay queue"
		if len(r.DelayQueues) > 0 {
			where = a.nameList(r.DelayQueues)
		}
		work := "their work queues"
		if opts.Queue != "" {
			work = "work queue " + opts.Queue
		}
		from = "waiting in " + where
		if kind.purge {
			from += ", due back to " + work
		} else {
			from += ", back to " + work
		}
	} else {
		from = "in " + from
	}
	if r.DryRun {
		unroutable := ""
		if !kind.purge {
			// As the run would: a message whose queue does not exist stays (routable).
			unroutable = fmt.Sprintf(", %d unroutable", r.Unroutable)
		}
		printf("dry run: would %s %d of %d %s %s (%d scanned, %d not matching%s); nothing changed\n",
			kind.verb(), r.Matched-r.Unroutable, r.Depth, kind.noun(), from, r.Scanned, r.Skipped, unroutable)
		for _, m := range r.Messages {
			printf("  %s\n", moveLine(m, kind))
		}
	} else {
		printf("%s %d of %d %s %s (%d scanned, %d not matching, %d unroutable)\n",
			kind.done(), r.Done, r.Depth, kind.noun(), from, r.Scanned, r.Skipped, r.Unroutable)
	}
	for _, m := range r.Unrouted {
		stays := "left in place"
		if kind.source == ops.Waiting {
			stays = "left waiting in " + m.DelayQueue
		}
		if m.Queue == "" {
			printf("  %s, its queue is unknown (no envelope, no queue in its routing key): %s\n", stays, messageID(m))
			continue
		}
		printf("  %s, queue %q does not exist: %s\n", stays, m.Queue, messageID(m))
	}
	switch r.Stopped {
	case "interrupted":
		rest := r.Queue
		if kind.source == ops.Waiting {
			rest = a.nameList(r.DelayQueues)
		}
		printf("interrupted: stopped between two messages; the rest is still in %s\n", rest)
	case "window":
		printf("stopped: %d messages kept (--window); run again to continue\n", opts.Window)
	case "limit":
		if kind.confirmed {
			break // it acted on what the prompt showed: the limit is that, not --limit
		}
		printf("stopped at --limit %d\n", opts.Limit)
	}
}

// moveLine is the line of one message of a dry run: where it goes (redrive, retry now)
// and, for a waiting retry, where it waits.
func moveLine(m ops.Message, kind moveKind) string {
	switch {
	case kind.source == ops.Waiting && kind.purge:
		return fmt.Sprintf("%s in %s, due back to %s (%s)", m.UUID, m.DelayQueue, orUnknown(m.Queue), about(m))
	case kind.source == ops.Waiting:
		return fmt.Sprintf("%s in %s -> %s (%s)", m.UUID, m.DelayQueue, orUnknown(m.Queue), about(m))
	case kind.purge:
		return fmt.Sprintf("%s (%s)", m.UUID, about(m))
	}
	return fmt.Sprintf("%s -> %s (%s)", m.UUID, orUnknown(m.Queue), about(m))
}

// about describes a message in a few words: why it failed, or, for a retry of the
// parking queue, where it stood in its schedule.
func about(m ops.Message) string {
	if m.Reason != "" {
		if m.Error == "" {
			return string(m.Reason)
		}
		return string(m.Reason) + ": " + clip(m.Error, 60)
	}
	var parts []string
	if m.Attempt > 0 {
		parts = append(parts, "attempt "+strconv.Itoa(m.Attempt))
	}
	if !m.Due.IsZero() {
		parts = append(parts, "due "+stamp(m.Due))
	}
	if m.Error != "" {
		parts = append(parts, "last error: "+clip(m.Error, 60))
	}
	if len(parts) == 0 {
		return "no failure envelope"
	}
	return strings.Join(parts, ", ")
}

// messageID names m: its Watermill UUID, else its AMQP message id, else "-".
func messageID(m ops.Message) string {
	if m.UUID != "" {
		return m.UUID
	}
	return orDash(m.MessageID)
}

func attempt(m ops.Message) string {
	if m.Attempt == 0 {
		return "-"
	}
	return strconv.Itoa(m.Attempt)
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func orUnknown(s string) string {
	if s == "" {
		return "(unknown queue)"
	}
	return s
}

func stamp(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format(time.RFC3339)
}

// ago formats the time since t.
func ago(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format(time.RFC3339) + " (" + format.Duration(time.Since(t)) + " ago)"
}

// clip cuts s to n runes, on one line.
func clip(s string, n int) string {
	r := []rune(strings.ReplaceAll(s, "\n", " "))
	if len(r) <= n {
		return string(r)
	}
	return string(r[:n-1]) + "…"
}

// rateFlag parses "N/s", "N/m" or "N" (per second).
type rateFlag float64

func (r *rateFlag) String() string {
	if *r == 0 {
		return "unlimited"
	}
	return strconv.FormatFloat(float64(*r), 'f', -1, 64) + "/s"
}

func (r *rateFlag) Set(s string) error {
	per, n := time.Second, s
	switch {
	case strings.HasSuffix(s, "/s"):
		n = strings.TrimSuffix(s, "/s")
	case strings.HasSuffix(s, "/m"):
		n, per = strings.TrimSuffix(s, "/m"), time.Minute
	}
	v, err := strconv.ParseFloat(n, 64)
	if err != nil || v <= 0 || v != v || v > 1e9 {
		return fmt.Errorf("want N/s or N/m with N > 0, got %q", s)
	}
	*r = rateFlag(v / per.Seconds())
	return nil
}

func (r *rateFlag) Type() string { return "rate" }
