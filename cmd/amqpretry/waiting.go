package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/ops"
	"github.com/amqpretry/amqpretry/topology"
)

// ctlRunner runs rabbitmqctl args (ops.Config.Rabbitmqctl).
type ctlRunner = func(ctx context.Context, args ...string) ([]byte, error)

// ctlRunner returns the rabbitmqctl the flags name, or nil: each run is bounded by the
// timeout, and none runs before the command is known to reach the node listening on
// the URI's port (the check shared with the counts, which may find that node: -n), so
// that an eval meant for the broker at the URI never runs on another one.
func (src *countsSource) ctlRunner(uri string) ctlRunner {
	words, explicit := rabbitmqctlWords(src.ctl, uri)
	if len(words) == 0 {
		return nil
	}
	check := src.nodeCheck(words, uri, mayFind(words, explicit))
	return func(ctx context.Context, args ...string) ([]byte, error) {
		if err := check.do(ctx); err != nil {
			return nil, err
		}
		return runCtl(ctx, check.words, src.timeout, args...)
	}
}

// ctlFlags adds --rabbitmqctl and --ctl-timeout to a command that needs rabbitmqctl.
func (src *countsSource) ctlFlags(c *cobra.Command) {
	f := c.Flags()
	f.StringVar(&src.ctl, "rabbitmqctl", "auto", "rabbitmqctl command of the broker at AMQP_URI (needs admin rights: rabbitmqctl eval): auto (rabbitmqctl on PATH for a broker on this host, -n the node on the URI's port), off, or a command line")
	f.DurationVar(&src.timeout, "ctl-timeout", time.Minute, "bound of each rabbitmqctl run")
}

// openCtl is open with rabbitmqctl (ops.Config.Rabbitmqctl).
func (a *app) openCtl(ctl ctlRunner) (*ops.Ops, error) {
	o, _, err := a.openWith(ctl)
	return o, err
}

const waitingHelp = `Waiting retries are those in the delay queues of ttl-tiers and binary-levels under the
prefix (of the configured backend, and any other delay queue found under the prefix: left
by a change of backend, tiers or levels), and, on RabbitMQ 4.3, those a work queue holds
in delayed retry (delayed-retry backend, --held-retries; name it with --queue).

They are read with rabbitmqctl eval (admin rights on the broker's node), through the
quorum queue's own read-only peek: no basic.get, no return, so their order, due times and
the broker's counters (x-delivery-count, x-acquired-count) stay as they are. AMQP 0-9-1
offers only take-and-give-back, which changes them. On delayed-exchange they wait in the
delayed-message plugin, which offers no way to list them, bring them back early or drop
them: list, retry-now and purge refuse (exit status 1); status shows the plugin's count.
See docs/waiting.md.`

func (a *app) waitingCmd() *cobra.Command {
	return group("waiting", "Retries waiting in the delay backend: list, retry now, purge",
		a.waitingListCmd(), a.waitingMoveCmd(false), a.waitingMoveCmd(true))
}

// waitingFilterFlags adds the filter flags for waiting retries (no poison reason: a
// waiting retry has none; its last error is --error).
func waitingFilterFlags(c *cobra.Command, f *ops.Filter) func() error {
	check := filterFlags(c.Flags(), f)
	_ = c.Flags().MarkHidden("reason")
	c.Flags().Lookup("queue").Usage = "only the retries of this work queue"
	c.Flags().Lookup("error").Usage = "only retries whose last error contains this text (the reason they wait)"
	c.Flags().Lookup("older-than").Usage = "only retries whose last failure is older than this"
	c.Flags().Lookup("newer-than").Usage = "only retries whose last failure is more recent than this"
	return func() error {
		if c.Flags().Changed("reason") {
			return usagef("--reason: a waiting retry has no poison reason; match its last error with --error")
		}
		return check()
	}
}

func (a *app) waitingListCmd() *cobra.Command {
	var opts ops.ListOptions
	limit, window := 100, 10_000
	var src countsSource
	var check func() error
	c := &cobra.Command{
		Use:   "list",
		Short: "List waiting retries in due order, with a histogram of their due times",
		Long: `list prints the waiting retries that match the filters, in due order: the work queue,
attempt, due time, the queue it waits in and its position there, and the broker's
counters; then a histogram of their due times.

` + waitingHelp + `

` + exitHelp,
		Args: noArgs,
		RunE: func(*cobra.Command, []string) error {
			if err := check(); err != nil {
				return err
			}
			opts.Limit, opts.Window = limit, window
			if limit == 0 {
				opts.Limit = -1
			}
			ctl := src.ctlRunner(a.uri)
			// On delayed-exchange ops refuses, with the plugin's reason (and its count,
			// when rabbitmqctl reads it): no retry can be listed there. Elsewhere,
			// without rabbitmqctl, the fix is the flag, given before anything is dialled.
			if ctl == nil && !a.pluginWaiting() {
				return usagef("waiting list needs rabbitmqctl (--rabbitmqctl): AMQP cannot read waiting retries without changing them")
			}
			o, err := a.openCtl(ctl)
			if err != nil {
				return err
			}
			defer o.Close()
			r, err := o.List(a.ctx, ops.Waiting, opts)
			if err != nil {
				return err
			}
			if a.json {
				return a.emit(r)
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "UUID\tQUEUE\tATTEMPT\tDUE\tWAITS IN\tPOS\tDELIVERIES\tACQUIRED")
			for _, m := range r.Messages {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%d\t%d\n", orDash(m.UUID), orDash(m.Queue), attempt(m),
					stamp(waitingDue(m)), m.DelayQueue, m.Position, m.DeliveryCount, m.AcquiredCount)
			}
			_ = tw.Flush()
			more := ""
			if !r.Complete {
				more = " (stopped early: --limit or --window reached)"
			}
			a.printf("%d of %d waiting retries shown%s\n", len(r.Messages), r.Depth, more)
			a.histogram(r.Messages, time.Now())
			return nil
		},
	}
	check = waitingFilterFlags(c, &opts.Filter)
	c.Flags().Var(boundedInt{&limit, 0}, "limit", "at most this many retries (0: all)")
	c.Flags().Var(boundedInt{&window, 1}, "window", "read at most this many retries of each delay queue")
	src.ctlFlags(c)
	return c
}

// waitingDue is when a waiting retry is due: its envelope's due time, else when the
// broker releases it.
func waitingDue(m ops.Message) time.Time {
	if !m.Due.IsZero() {
		return m.Due
	}
	return m.Release
}

// dueBuckets are the histogram's bounds, from now.
var dueBuckets = []struct {
	label string
	upTo  time.Duration
}{
	{"overdue", 0}, {"< 1m", time.Minute}, {"< 10m", 10 * time.Minute}, {"< 1h", time.Hour},
	{"< 1d", 24 * time.Hour}, {">= 1d", 1<<63 - 1},
}

// histogram prints how many retries come due in each bucket from now.
func (a *app) histogram(msgs []ops.Message, now time.Time) {
	if len(msgs) == 0 {
		return
	}
	counts := make([]int, len(dueBuckets))
	most := 0
	for _, m := range msgs {
		in := waitingDue(m).Sub(now)
		for i, b := range dueBuckets {
			if in < b.upTo || i == len(dueBuckets)-1 {
				counts[i]++
				most = max(most, counts[i])
				break
			}
		}
	}
	a.printf("due:\n")
	for i, b := range dueBuckets {
		bar := strings.Repeat("#", (counts[i]*40+most-1)/most)
		a.printf("  %-8s %6d %s\n", b.label, counts[i], bar)
	}
}

// waitingMoveCmd is retry-now (purge false) and purge of the waiting retries.
func (a *app) waitingMoveCmd(purge bool) *cobra.Command {
	var opts ops.MoveOptions
	window := 10_000
	var rate rateFlag
	var src countsSource
	var yes bool
	var check func() error
	kind := moveKind{source: ops.Waiting, purge: purge}
	name := "retry-now"
	short := "Bring the matching waiting retries of one work queue back to it now, before they are due"
	long := `retry-now takes each matching retry waiting for the work queue --queue out of its delay
queue and sends it to that work queue now, as it is (its attempt count kept): persistent,
mandatory, confirm awaited, and only then acked in its delay queue: nothing is removed
before the broker has confirmed its copy. Killed mid-run, a retry is back in its work
queue or still waiting (the one whose confirm arrived just before the kill may be in
both). The retries it does not take keep their place; taken and given back, each counts
one more delivery (x-delivery-count on RabbitMQ 3.x, x-acquired-count on 4.x; 4.0-4.2
count it against the delivery-limit, 20 by default). Its output names the delay queues
the retries wait in (the first ` + fmt.Sprint(shownNames) + ` and how many more; --verbose names them
all) and the work queue they come back to. A retry whose work queue does not exist
stays waiting, reported (exit status 1); --dry-run checks that the same way, passively
(a passive queue.declare, nothing published), and exits as the run would.

On RabbitMQ 4.3, what the work queue holds in delayed retry comes back through the
broker's internal rabbit_quorum_queue:retry_delayed, run with rabbitmqctl eval (admin
rights, the node of AMQP_URI): all of it, or the --limit due first; it takes no other
filter and says so.`
	if purge {
		name = "purge"
		short = "Drop matching waiting retries (asks first; no filter: needs --all)"
		long = `purge drops (acks) each matching waiting retry: it never comes back. Without a filter it
needs --all. What RabbitMQ 4.3 holds in delayed retry cannot be dropped: RabbitMQ offers
no way to, and purge says so. Its output names the delay queues the retries wait in
(the first ` + fmt.Sprint(shownNames) + ` and how many more; --verbose names them all).

` + confirmHelp
	}
	c := &cobra.Command{
		Use:   name,
		Short: short,
		Long: long + `

` + waitingHelp + `

` + exitHelp,
		Args: noArgs,
		RunE: func(*cobra.Command, []string) error {
			if err := check(); err != nil {
				return err
			}
			f := opts.Filter
			if !purge && f.Queue == "" {
				return usagef("waiting retry-now: --queue is required: the work queue whose retries to bring back")
			}
			if purge && f.Queue == "" && f.Error == "" && f.OlderThan == 0 && f.NewerThan == 0 && len(f.IDs) == 0 && !opts.All {
				return usagef("waiting purge: no filter given; pass --all to purge every waiting retry")
			}
			if purge && !opts.DryRun {
				if err := a.mayDestroy("waiting purge drops retries for good", yes); err != nil {
					return err
				}
			}
			opts.Rate, opts.Window = float64(rate), window
			o, err := a.openCtl(src.ctlRunner(a.uri))
			if err != nil {
				return err
			}
			defer o.Close()
			if purge {
				return a.purge(o, kind, yes, opts)
			}
			prog := newProgress(a.stderr, "retrying", kind.done())
			opts.Progress = prog.update
			r, err := o.Redrive(a.ctx, ops.Waiting, opts)
			prog.done()
			if err != nil {
				return err
			}
			return a.reportMove(r, kind, opts)
		},
	}
	f := c.Flags()
	check = waitingFilterFlags(c, &opts.Filter)
	moveFlags(f, &opts, &rate, &window, "retries")
	if purge {
		f.BoolVar(&opts.All, "all", false, "purge every waiting retry when no filter is given")
		yesFlag(c, &yes)
	}
	a.verboseFlag(c)
	src.ctlFlags(c)
	return c
}

func (a *app) teardownCmd() *cobra.Command {
	var (
		opts                  ops.TeardownOptions
		src                   countsSource
		keepBackend           string
		keepTiers             durationList
		keepLevels, keepRetry int
		yes                   bool
	)
	c := &cobra.Command{
		Use:   "teardown",
		Short: "Remove what the library declared under the prefix, for every backend: refuses while messages wait",
		Long: `teardown removes what the library declared under --prefix, for every backend: the
delay queues and exchanges, the delivery exchanges and the bindings that go with them
(binary-levels' levels whatever their number, the delayed-exchange backend's exchange,
and, with rabbitmqctl, every delay queue found under the prefix, of any tiers): the old
storage after a change of backend, tiers, levels or prefix, or the whole prefix, removed
in one run. --backend is not needed: each backend is asked what it declares (--backend,
--tiers and --levels, when given, add what that configuration declares).
Without rabbitmqctl (--rabbitmqctl off) the delay queues of tiers other than --tiers
and the default ones cannot be listed: the output says so. The parking exchange and
queue and the poison queue, which every backend under the prefix shares, stay unless
--shared; so do the behind queues of the blocked order keys (<prefix>.behind.*, found
with rabbitmqctl), which belong to the configuration in use whatever its backend: an
empty one still blocks its key.

Work queues and the exchanges the application binds to them (its topics) are the
application's: teardown never removes them. The bindings from a delivery exchange to
the work queues go with that exchange; with rabbitmqctl (list_bindings) teardown lists
every binding that goes, and names, as left, the work queues bound from an exchange
that goes and the exchanges bound to them. Its output names everything it left and
why; a dry run lists everything it would remove (--verbose: each queue, exchange and
binding).

When the configuration in use now shares the prefix, name it with --keep-backend (and
--keep-tiers, --keep-levels, --keep-held-retries): what its plan declares stays. Without
it, teardown removes that storage too (refusing only while messages wait there).

It counts and removes only what it finds; when it finds nothing under the prefix (a
typo in --prefix), or only what stays, it says so and exits 1.

It refuses, removing nothing (exit status 1), while any message waits there (the
broker's own counts, rabbitmqctl list_queues, which see the expired messages a quorum
queue keeps for dead lettering; for a delayed-message exchange, the plugin's own
count), or while that is unknown, unless --force: those messages are then lost. The
refusal names the fix for each kind of queue where they wait: in a delay queue, wait
for them to come due (` + "`amqpretry status`" + `) or bring them back with ` + "`amqpretry waiting retry-now`" + `;
in the poison queue (--shared), ` + "`amqpretry poison redrive`" + ` or ` + "`amqpretry poison purge`" + `; in the
parking queue (--shared), ` + "`amqpretry parking redrive`" + ` once their work queues exist, or
` + "`amqpretry parking purge`" + `; behind a blocked order key (--shared), release the key
(` + "`amqpretry blocked release`" + `: the application consuming its work queue runs them); on
delayed-exchange only waiting works: the plugin's count, in ` + "`amqpretry status`" + `,
reaches 0 as they come due. Stop every application instance still on the old
configuration first: a retry parked between the count and the delete would be lost
(quorum queues cannot be deleted "if empty"). --force only lifts that refusal:
it asks like any other teardown.

` + confirmHelp + `
Every teardown that removes something asks, --force or not, as a purge does; confirmed,
it removes what it showed and nothing found since (named as left).

Its output names the first ` + fmt.Sprint(shownNames) + ` queues and exchanges of each list and how many
more; --verbose names them all.

` + exitHelp,
		Args: noArgs,
		RunE: func(*cobra.Command, []string) error {
			cfg, err := a.retryConfig()
			if err != nil {
				return err
			}
			if keepBackend != "" {
				settings := delay.Settings{Levels: keepLevels}
				if len(keepTiers) > 0 {
					settings.Tiers = keepTiers
				}
				kb, err := delay.Parse(keepBackend, settings)
				if err != nil {
					return usagef("invalid --keep-backend: %s", err)
				}
				keep := amqpretry.Config{Backend: delay.HeldRetries(keepRetry, 0, kb), Prefix: cfg.Prefix, PoisonQueue: cfg.PoisonQueue}
				plan, err := keep.Plan()
				if err != nil {
					return usagef("invalid --keep-* configuration: %s", strings.TrimPrefix(err.Error(), "invalid config: "))
				}
				opts.Keep = plan
			}
			if !opts.DryRun {
				what := "teardown removes queues and exchanges for good"
				if opts.Force {
					what = "teardown --force removes the storage with the messages waiting there"
				}
				if err := a.mayDestroy(what, yes); err != nil {
					return err
				}
			}
			ctl := src.ctlRunner(a.uri)
			a.unlisted = ctl == nil
			o, err := a.openCtl(ctl)
			if err != nil {
				return err
			}
			defer o.Close()
			if !opts.DryRun && !yes {
				dry := opts
				dry.DryRun = true
				r, proceed, err := confirmFirst(a, func() (ops.TeardownResult, error) { return o.Teardown(a.ctx, dry) }, nil,
					func(r ops.TeardownResult) { a.printTeardown(a.stderr, r, cfg.Prefix) }, teardownQuestion)
				if !proceed {
					if errors.Is(err, errDeclined) {
						return err
					}
					return a.reportTeardown(r, cfg.Prefix, err)
				}
				opts.Only = append(slices.Clone(r.Queues), r.Exchanges...)
			}
			r, err := o.Teardown(a.ctx, opts)
			return a.reportTeardown(r, cfg.Prefix, err)
		},
	}
	f := c.Flags()
	f.BoolVar(&opts.DryRun, "dry-run", false, "list what would be removed and what waits there; remove nothing")
	f.BoolVar(&opts.Force, "force", false, "remove even while messages wait there (they are lost); it still asks first, or needs --yes")
	yesFlag(c, &yes)
	a.verboseFlag(c)
	f.BoolVar(&opts.Shared, "shared", false, "also remove the parking queue and exchange and the poison queue, which every backend under the prefix shares")
	f.StringVar(&keepBackend, "keep-backend", "", "the backend in use now under the same prefix: what its plan declares stays")
	f.Var(&keepTiers, "keep-tiers", "ttl-tiers in use now: its tier ladder")
	f.IntVar(&keepLevels, "keep-levels", 0, "binary-levels in use now: its levels (0: the library's default)")
	f.IntVar(&keepRetry, "keep-held-retries", 0, "the held retries in use now (--held-retries)")
	src.ctlFlags(c)
	return c
}

// teardownQuestion is teardown's prompt for what its dry run r showed.
func teardownQuestion(r ops.TeardownResult) string {
	lost := 0
	for _, n := range r.Waiting {
		lost += n
	}
	if lost == 0 {
		return fmt.Sprintf("remove these %d queues and %d exchanges for good?", len(r.Queues), len(r.Exchanges))
	}
	return fmt.Sprintf("remove these %d queues and %d exchanges, and the %d messages waiting there, for good?", len(r.Queues), len(r.Exchanges), lost)
}

// teardownJSON is teardown's --json output: the result, and why it failed.
type teardownJSON struct {
	ops.TeardownResult
	Prefix string `json:"prefix"`
	Error  string `json:"error,omitempty"`
}

// reportTeardown prints what teardown found, removed or refused (as JSON with
// --json, with the error in it), and returns the exit it calls for.
func (a *app) reportTeardown(r ops.TeardownResult, prefix string, err error) error {
	if a.json {
		out := teardownJSON{TeardownResult: r, Prefix: prefix}
		if err != nil {
			out.Error = a.redact(err.Error())
		}
		if e := a.emit(out); e != nil {
			return e
		}
		if err != nil {
			return errFlagged
		}
		return nil
	}
	if err != nil {
		a.printTeardownWaiting(a.stdout, r, false)
		a.printLeft(a.stdout, r)
		return err
	}
	a.printTeardown(a.stdout, r, prefix)
	return nil
}

// printTeardown prints what a teardown removed (would remove, in a dry run) on w:
// the counts, then the names (the first few of each list, all with --verbose), what
// waits there, what it left and why, and what it could not look for.
func (a *app) printTeardown(w io.Writer, r ops.TeardownResult, prefix string) {
	verb := "removed"
	if r.DryRun {
		verb = "dry run: would remove"
	}
	fmt.Fprintf(w, "%s %d queues, %d exchanges, %d bindings under prefix %s\n", verb, len(r.Queues), len(r.Exchanges), r.Bindings, prefix)
	if a.verbose {
		for _, q := range r.Queues {
			fmt.Fprintf(w, "  queue %s%s\n", q, waitingNote(r, q))
		}
		for _, x := range r.Exchanges {
			fmt.Fprintf(w, "  exchange %s%s\n", x, waitingNote(r, x))
		}
		for _, b := range r.BindingList {
			fmt.Fprintf(w, "  binding %s -> %s %s key %q\n", b.Exchange, destinationKind(b), b.Destination, b.Key)
		}
	} else {
		if len(r.Queues) > 0 {
			fmt.Fprintf(w, "  %d queues: %s\n", len(r.Queues), a.nameList(r.Queues))
		}
		if len(r.Exchanges) > 0 {
			fmt.Fprintf(w, "  %d exchanges: %s\n", len(r.Exchanges), a.nameList(r.Exchanges))
		}
		if len(r.BindingList) > 0 {
			var bs []string
			for _, b := range r.BindingList {
				bs = append(bs, b.Exchange+" -> "+b.Destination)
			}
			fmt.Fprintf(w, "  %d bindings: %s\n", len(bs), a.nameList(bs))
		}
		a.printTeardownWaiting(w, r, !r.DryRun)
	}
	a.printLeft(w, r)
}

// destinationKind is "queue" or "exchange", as a binding's destination is.
func destinationKind(b topology.Binding) string {
	if b.ToExchange {
		return "exchange"
	}
	return "queue"
}

// printLeft prints, on w, what a teardown found and left, by reason, and what it could
// not look for.
func (a *app) printLeft(w io.Writer, r ops.TeardownResult) {
	var whys []string
	left := map[string][]string{}
	for _, l := range r.Left {
		if _, ok := left[l.Why]; !ok {
			whys = append(whys, l.Why)
		}
		left[l.Why] = append(left[l.Why], l.Name+" ("+l.Kind+")")
	}
	for _, why := range whys {
		fmt.Fprintf(w, "  left %d, %s: %s\n", len(left[why]), leftWhy(why), a.nameList(left[why]))
	}
	if len(r.Unsearched) > 0 {
		var patterns []string
		for _, p := range r.Unsearched {
			what := "delay queues of other tiers"
			if strings.HasSuffix(p, ".behind.*") {
				what = "behind queues of blocked order keys"
			}
			patterns = append(patterns, p+" ("+what+")")
		}
		fmt.Fprintf(w, "  not looked for: %s: only rabbitmqctl lists them (--rabbitmqctl)\n", strings.Join(patterns, ", "))
	}
	if a.unlisted && len(r.Exchanges) > 0 {
		fmt.Fprintf(w, "  not listed: the bindings to the work queues (they go with their delivery exchange), the work queues and the application's exchanges bound to them (never removed): only rabbitmqctl lists bindings (--rabbitmqctl)\n")
	}
}

// leftWhy says in the command's words why a teardown left what it found (Left.Why).
func leftWhy(why string) string {
	switch why {
	case ops.LeftKept:
		return "in use (--keep-backend)"
	case ops.LeftShared:
		return "shared by every backend under the prefix (--shared removes them)"
	case ops.LeftNotShown:
		return "not shown at the prompt, found since (run teardown again)"
	case ops.LeftApplication:
		return "the application's (work queues, and the exchanges bound to them): never removed"
	}
	return why
}

// printTeardownWaiting prints, on w, where messages wait in what a teardown found (the first
// few places, all with --verbose), and how many; lost: they went with it.
func (a *app) printTeardownWaiting(w io.Writer, r ops.TeardownResult, lost bool) {
	var places []string
	total := 0
	for _, name := range append(slices.Clone(r.Queues), r.Exchanges...) {
		if n, ok := r.Waiting[name]; ok {
			places = append(places, fmt.Sprintf("%s: %d", name, n))
			total += n
		}
	}
	if len(places) == 0 {
		return
	}
	gone := ""
	if lost {
		gone = ", lost with it"
	}
	fmt.Fprintf(w, "  %d messages waiting%s, in %s\n", total, gone, a.nameList(places))
}

// waitingNote is ": N messages waiting" (removed: "lost") when some wait in name.
func waitingNote(r ops.TeardownResult, name string) string {
	n := r.Waiting[name]
	switch {
	case n == 0:
		return ""
	case r.DryRun:
		return fmt.Sprintf(": %d messages waiting", n)
	}
	return fmt.Sprintf(": %d messages waiting, lost with it", n)
}

// pluginWaiting tells whether the configured backend's waiting retries can only be
// counted (the delayed-message plugin's), as ops answers it (ops.HasPluginWaiting):
// ops then refuses to list or move them, with the reason, and needs no rabbitmqctl to
// say so.
func (a *app) pluginWaiting() bool {
	cfg, err := a.retryConfig()
	return err == nil && ops.HasPluginWaiting(cfg)
}
