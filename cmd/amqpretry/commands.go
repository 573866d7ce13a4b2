package main

import (
	"fmt"
	"net/url"
	"os/exec"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/ops"
	"github.com/amqpretry/amqpretry/topology"
	"github.com/amqpretry/amqpretry/xdeath"
)

func (c *cli) status(args []string) (int, error) {
	fs := c.flags("status")
	check := fs.Bool("check", false, "exit with status 1 when something is flagged")
	margin := fs.Duration("stuck-margin", ops.DefaultStuckMargin, "a delay queue whose head is this much past its due time is STUCK")
	peek := fs.String("peek", string(ops.PeekAuto), "read the head of the delay queues: auto (not on RabbitMQ 4.0-4.2, where a peek spends a delivery), always, never")
	ctl := fs.String("rabbitmqctl", "auto", "command that runs rabbitmqctl for the broker, to see expired messages held for dead lettering (invisible over AMQP): auto (rabbitmqctl, if on PATH and the broker is on this host), off, or a command line")
	mgmt := fs.String("management-url", "", "RabbitMQ management API (http://host:15672) to read the broker's counts from instead of rabbitmqctl; credentials from AMQP_URI")
	if _, err := parse(fs, args); err != nil {
		return exitUsage, err
	}
	o, err := c.open()
	if err != nil {
		return exitFlagged, err
	}
	defer o.Close()
	opts := ops.StatusOptions{StuckMargin: *margin, Peek: ops.PeekMode(*peek)}
	switch words := c.rabbitmqctl(*ctl); {
	case *mgmt != "":
		u, err := url.Parse(c.uri)
		if err != nil {
			return exitUsage, fmt.Errorf("%w: AMQP_URI cannot be parsed", errUsage)
		}
		pass, _ := u.User.Password()
		opts.Counts = ops.ManagementCounts(*mgmt, u.User.Username(), pass, ops.VHost(c.uri), nil)
	case len(words) > 0:
		opts.Counts = ops.RabbitmqctlCounts(words, ops.VHost(c.uri))
	}
	s, err := o.Status(c.ctx, opts)
	if err != nil {
		return exitFlagged, err
	}
	if c.json {
		if err := c.emit(s); err != nil {
			return exitFlagged, err
		}
	} else {
		c.printStatus(s)
	}
	if *check && s.Flagged() {
		return exitFlagged, nil
	}
	return exitOK, nil
}

// rabbitmqctl resolves the --rabbitmqctl flag to a command line, or nil.
func (c *cli) rabbitmqctl(flagValue string) []string {
	switch flagValue {
	case "off", "":
		return nil
	case "auto":
		u, err := url.Parse(c.uri)
		if err != nil {
			return nil
		}
		switch u.Hostname() {
		case "127.0.0.1", "localhost", "::1":
		default:
			return nil
		}
		if _, err := exec.LookPath("rabbitmqctl"); err != nil {
			return nil
		}
		return []string{"rabbitmqctl"}
	}
	return strings.Fields(flagValue)
}

func (c *cli) printStatus(s ops.Status) {
	plugin := "not enabled"
	switch {
	case !s.PluginKnown:
		plugin = "unknown (" + s.PluginNote + ")"
	case s.DelayedMessagePlugin:
		plugin = "enabled"
	}
	c.printf("RabbitMQ %s at %s, backend %s, prefix %s\ndelayed-message plugin: %s\n", s.Broker, delay.Redact(c.uri), s.Backend, s.Prefix, plugin)
	for _, w := range s.Warnings {
		c.printf("warning: %s\n", w)
	}
	c.printf("\n")
	tw := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "QUEUE\tROLE\tREADY\tDLX-BACKLOG\tCONSUMERS\tTTL\tOLDEST\tSTATE")
	for _, q := range s.Queues {
		ttl, oldest, state := "-", "-", "ok"
		if q.TTL > 0 {
			ttl = delay.TierName(q.TTL)
		}
		if q.AgeKnown {
			oldest = short(q.OldestAge)
		} else if q.Messages > 0 {
			oldest = "unknown"
		}
		switch {
		case !q.Exists:
			state = "MISSING"
		case q.Stuck:
			state = "STUCK"
		case q.Role == ops.RoleParking && q.Messages > 0:
			state = "PARKED"
		}
		if q.Note != "" {
			state += " (" + q.Note + ")"
		}
		backlog := "-"
		if q.BacklogKnown {
			backlog = fmt.Sprint(q.DeadLetterBacklog)
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%d\t%s\t%s\t%s\n", q.Name, q.Role, q.Messages, backlog, q.Consumers, ttl, oldest, state)
	}
	_ = tw.Flush()
	if len(s.Flags) == 0 {
		c.printf("\nnothing flagged\n")
		return
	}
	c.printf("\nflagged:\n")
	for _, f := range s.Flags {
		c.printf("  %s\n", f)
	}
}

// topologyFlags are the flags of topology plan, apply and verify.
func (c *cli) topologyFlags(name string) (fsArgs func([]string) ([]string, error), queues *[]string, bind, noCompare *bool) {
	fs := c.flags("topology " + name)
	queues = new([]string)
	fs.Func("queue", "a work queue retries come back to (its delivery binding); repeat for more", func(s string) error {
		*queues = append(*queues, s)
		return nil
	})
	bind = fs.Bool("bind", false, "verify: assert the bindings (idempotent; needs write on the queue and read on the exchange, no configure); without it bindings are reported unchecked")
	noCompare = fs.Bool("no-compare", false, "verify: do not compare arguments (which redeclares existing objects on a throwaway channel and needs configure permission)")
	return func(args []string) ([]string, error) { return parse(fs, args) }, queues, bind, noCompare
}

func (c *cli) topologyPlan(args []string) (int, error) {
	parseArgs, queues, _, _ := c.topologyFlags("plan")
	if _, err := parseArgs(args); err != nil {
		return exitUsage, err
	}
	cfg, err := c.config()
	if err != nil {
		return exitUsage, err
	}
	p, err := ops.PlanTopology(cfg, *queues...)
	if err != nil {
		return exitFlagged, err
	}
	if c.json {
		return exitOK, c.emit(p)
	}
	c.printPlan(p)
	return exitOK, nil
}

func (c *cli) printPlan(p ops.Plan) {
	c.printf("backend %s, prefix %s\n", p.Backend, p.Prefix)
	tw := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
	for _, e := range p.Topology.Exchanges {
		fmt.Fprintf(tw, "exchange\t%s\t%s\t%s\n", e.Name, e.Kind, args(e.Args))
	}
	for _, q := range p.Topology.Queues {
		fmt.Fprintf(tw, "queue\t%s\t%s\t%s\n", q.Name, queueKind(q.Args), args(q.Args))
	}
	for _, b := range p.Topology.Bindings {
		dest := "queue " + b.Destination
		if b.ToExchange {
			dest = "exchange " + b.Destination
		}
		fmt.Fprintf(tw, "binding\t%s -> %s\tkey %q\t%s\n", b.Exchange, dest, b.Key, args(b.Args))
	}
	for _, q := range p.WorkQueues {
		fmt.Fprintf(tw, "work queue\t%s\t\tmust exist; apply creates it durable if missing\n", q)
	}
	_ = tw.Flush()
	c.printf("apply with: %s\n", p.ApplyCommand)
}

func queueKind(a amqp.Table) string {
	if t, ok := a[topology.QueueTypeArg].(string); ok {
		return t
	}
	return "classic"
}

// args formats arguments as sorted key=value pairs.
func args(a amqp.Table) string {
	keys := make([]string, 0, len(a))
	for k := range a {
		if k != topology.QueueTypeArg {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s=%v", k, a[k])
	}
	return strings.Join(parts, " ")
}

func (c *cli) topologyApply(args []string) (int, error) {
	parseArgs, queues, _, _ := c.topologyFlags("apply")
	if _, err := parseArgs(args); err != nil {
		return exitUsage, err
	}
	o, err := c.open()
	if err != nil {
		return exitFlagged, err
	}
	defer o.Close()
	r, err := o.Apply(c.ctx, *queues...)
	if err != nil {
		return exitFlagged, err
	}
	if c.json {
		return exitOK, c.emit(r)
	}
	t := r.Plan.Topology
	c.printf("applied: %d exchanges, %d queues, %d bindings (backend %s, prefix %s)\n",
		len(t.Exchanges), len(t.Queues), len(t.Bindings), r.Plan.Backend, r.Plan.Prefix)
	for _, q := range r.CreatedWorkQueues {
		c.printf("created work queue %s (durable, classic)\n", q)
	}
	return exitOK, nil
}

func (c *cli) topologyVerify(args []string) (int, error) {
	parseArgs, queues, bind, noCompare := c.topologyFlags("verify")
	if _, err := parseArgs(args); err != nil {
		return exitUsage, err
	}
	o, err := c.open()
	if err != nil {
		return exitFlagged, err
	}
	defer o.Close()
	r, err := o.Verify(c.ctx, ops.VerifyOptions{Bind: *bind, NoCompare: *noCompare}, *queues...)
	if err != nil {
		return exitFlagged, err
	}
	problems := r.Report.Problems()
	if c.json {
		out := struct {
			OK           bool               `json:"ok"`
			ApplyCommand string             `json:"apply_command"`
			Findings     []topology.Finding `json:"findings"`
		}{len(problems) == 0, r.Plan.ApplyCommand, r.Report.Findings}
		if err := c.emit(out); err != nil {
			return exitFlagged, err
		}
	} else {
		counts := map[topology.Status]int{}
		for _, f := range r.Report.Findings {
			counts[f.Status]++
			if f.Status != topology.StatusOK && f.Status != topology.StatusUnchecked {
				c.printf("%s\n", f)
			}
		}
		c.printf("%d ok, %d missing, %d mismatched, %d errors, %d unchecked\n",
			counts[topology.StatusOK], counts[topology.StatusMissing], counts[topology.StatusMismatch], counts[topology.StatusError], counts[topology.StatusUnchecked])
		if counts[topology.StatusUnchecked] > 0 {
			c.printf("bindings are not checked: AMQP 0-9-1 cannot read them (--bind asserts them, idempotently)\n")
		}
		if len(problems) > 0 {
			c.printf("create what is missing with: %s\n", r.Plan.ApplyCommand)
		}
	}
	if len(problems) > 0 {
		return exitFlagged, nil
	}
	return exitOK, nil
}

// list is poison list and parking list.
func (c *cli) list(name string, args []string, parking bool) (int, error) {
	fs := c.flags(name + " list")
	var opts ops.ListOptions
	filterFlags(fs, &opts.Filter)
	fs.IntVar(&opts.Limit, "limit", 100, "at most this many messages (-1: all)")
	fs.IntVar(&opts.Window, "window", ops.DefaultWindow, "at most this many messages held while scanning")
	if _, err := parse(fs, args); err != nil {
		return exitUsage, err
	}
	o, err := c.open()
	if err != nil {
		return exitFlagged, err
	}
	defer o.Close()
	queue := o.PoisonQueue()
	if parking {
		queue = o.ParkingQueue()
	}
	r, err := o.List(c.ctx, queue, opts)
	if err != nil {
		return exitFlagged, err
	}
	if c.json {
		return exitOK, c.emit(r)
	}
	tw := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
	if parking {
		fmt.Fprintln(tw, "UUID\tQUEUE\tATTEMPT\tDUE\tERROR")
	} else {
		fmt.Fprintln(tw, "UUID\tQUEUE\tREASON\tATTEMPT\tLAST FAILURE\tERROR")
	}
	for _, m := range r.Messages {
		if parking {
			fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\n", m.UUID, m.Queue, m.Attempt, stamp(m.Due), clip(m.Error, 60))
		} else {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\n", m.UUID, m.Queue, m.Reason, m.Attempt, stamp(m.LastFailure), clip(m.Error, 60))
		}
	}
	_ = tw.Flush()
	more := ""
	if !r.Complete {
		more = " (stopped early: limit or window reached)"
	}
	c.printf("%d of %d messages in %s shown, %d scanned%s\n", len(r.Messages), r.Depth, r.Queue, r.Scanned, more)
	return exitOK, nil
}

func stamp(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format(time.RFC3339)
}

func (c *cli) poisonList(args []string) (int, error)  { return c.list("poison", args, false) }
func (c *cli) parkingList(args []string) (int, error) { return c.list("parking", args, true) }

func (c *cli) poisonShow(args []string) (int, error) {
	fs := c.flags("poison show")
	var opts ops.ListOptions
	filterFlags(fs, &opts.Filter)
	fs.IntVar(&opts.Limit, "limit", 1, "without IDs: show this many matching messages")
	ids, err := parse(fs, args)
	if err != nil {
		return exitUsage, err
	}
	opts.IDs = append(opts.IDs, ids...)
	if len(ids) > 0 && opts.Limit < len(opts.IDs) {
		opts.Limit = len(opts.IDs)
	}
	opts.Full = true
	o, err := c.open()
	if err != nil {
		return exitFlagged, err
	}
	defer o.Close()
	r, err := o.ListPoison(c.ctx, opts)
	if err != nil {
		return exitFlagged, err
	}
	if c.json {
		return exitOK, c.emit(r.Messages)
	}
	if len(r.Messages) == 0 {
		return exitFlagged, fmt.Errorf("no matching message in queue %q (%d scanned)", r.Queue, r.Scanned)
	}
	for i, m := range r.Messages {
		if i > 0 {
			c.printf("\n")
		}
		c.printEnvelope(m)
	}
	return exitOK, nil
}

// envelopeKeys are printed by printEnvelope itself, not among the other metadata.
var envelopeKeys = map[string]bool{
	"amqpretry-queue": true, "amqpretry-poison-reason": true, "amqpretry-error": true, "amqpretry-error-types": true,
	"amqpretry-attempt": true, "amqpretry-max-attempts": true, "amqpretry-first-failure": true, "amqpretry-last-failure": true,
	"amqpretry-handler": true, "amqpretry-topic": true, "_watermill_message_uuid": true,
	// where the poison queue delivered it, not where it failed
	xdeath.DeliveryExchangeKey: true, xdeath.DeliveryRoutingKeyKey: true, xdeath.TypedHeadersKey: true,
}

func (c *cli) printEnvelope(m ops.Message) {
	tw := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
	row := func(k, v string) { fmt.Fprintf(tw, "  %s\t%s\n", k, v) }
	c.printf("message %s\n", m.UUID)
	row("queue:", m.Queue)
	row("reason:", m.Reason)
	row("error:", m.Error)
	row("error types:", strings.Join(m.ErrorTypes, " > "))
	attempts := fmt.Sprint(m.Attempt)
	if m.MaxAttempts > 0 {
		attempts += " of " + fmt.Sprint(m.MaxAttempts)
	}
	row("attempts:", attempts)
	row("first failure:", ago(m.FirstFailure))
	row("last failure:", ago(m.LastFailure))
	row("handler:", m.Handler)
	row("topic:", m.Topic)
	if m.Redriven > 0 {
		row("redriven:", fmt.Sprintf("%d times", m.Redriven))
	}
	row("amqp message id:", m.MessageID)
	row("payload:", fmt.Sprintf("%d bytes: %q", m.Size, clip(string(m.Payload), 200)))
	keys := make([]string, 0, len(m.Metadata))
	for k := range m.Metadata {
		if !envelopeKeys[k] {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	for _, k := range keys {
		row(k+":", clip(m.Metadata[k], 200))
	}
	_ = tw.Flush()
}

// move is redrive and purge.
func (c *cli) move(name string, args []string, parking, purge bool) (int, error) {
	fs := c.flags(name)
	var opts ops.MoveOptions
	filterFlags(fs, &opts.Filter)
	fs.IntVar(&opts.Limit, "limit", 0, "act on at most this many matching messages (0: all)")
	fs.BoolVar(&opts.DryRun, "dry-run", false, "report what would be done, change nothing")
	var rate rateFlag
	fs.Var(&rate, "rate", "at most this many messages per second: N/s or N/m (default: unlimited)")
	fs.IntVar(&opts.Window, "window", ops.DefaultWindow, "at most this many messages held (not matching, unroutable) before the run stops")
	if purge {
		fs.BoolVar(&opts.All, "all", false, "purge every message when no filter is given")
	} else {
		fs.BoolVar(&opts.ResetAttempts, "reset-attempts", !parking,
			"remove the attempt count so the message gets the policy's full attempts again (default true for poison: a message left at its last attempt is poisoned again at its next failure; false for parking: a parked retry keeps its place in its schedule)")
	}
	if _, err := parse(fs, args); err != nil {
		return exitUsage, err
	}
	opts.Rate = float64(rate)
	o, err := c.open()
	if err != nil {
		return exitFlagged, err
	}
	defer o.Close()
	queue := o.PoisonQueue()
	if parking {
		queue = o.ParkingQueue()
	}
	verb := "redriven"
	if purge {
		verb = "purged"
	}
	prog := c.progress(verb)
	if !opts.DryRun {
		opts.Progress = prog.update
	}
	var r ops.MoveResult
	if purge {
		r, err = o.Purge(c.ctx, queue, opts)
	} else {
		r, err = o.Redrive(c.ctx, queue, opts)
	}
	prog.done()
	if err != nil {
		return exitFlagged, err
	}
	code := exitOK
	switch {
	case r.Stopped == ops.StoppedInterrupted:
		code = exitInterrupted
	case len(r.Unrouted) > 0:
		code = exitFlagged
	}
	if c.json {
		return code, c.emit(r)
	}
	if r.DryRun {
		c.printf("dry run: would have %s %d of %d messages in %s (%d scanned, %d not matching); nothing changed\n",
			verb, r.Matched, r.Depth, r.Queue, r.Scanned, r.Skipped)
		for _, m := range r.Messages {
			c.printf("  %s -> %s (%s: %s)\n", m.UUID, m.Queue, m.Reason, clip(m.Error, 60))
		}
	} else {
		c.printf("%s %d of %d messages in %s (%d scanned, %d not matching, %d unroutable)\n",
			verb, r.Done, r.Depth, r.Queue, r.Scanned, r.Skipped, r.Unroutable)
	}
	for _, u := range r.Unrouted {
		c.printf("  left in place, queue %q does not exist: %s\n", u.Queue, u.UUID)
	}
	switch r.Stopped {
	case ops.StoppedInterrupted:
		c.printf("interrupted: stopped between two messages; the rest is still in %s\n", r.Queue)
	case ops.StoppedWindow:
		c.printf("stopped: %d messages held (--window); run again to continue\n", opts.Window)
	case ops.StoppedLimit:
		c.printf("stopped at --limit %d\n", opts.Limit)
	}
	return code, nil
}

func (c *cli) poisonRedrive(args []string) (int, error) {
	return c.move("poison redrive", args, false, false)
}
func (c *cli) poisonPurge(args []string) (int, error) {
	return c.move("poison purge", args, false, true)
}
func (c *cli) parkingRedrive(args []string) (int, error) {
	return c.move("parking redrive", args, true, false)
}
