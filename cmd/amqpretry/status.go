package main

import (
	"fmt"
	"net/url"
	"os/exec"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/spf13/cobra"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/cmd/amqpretry/internal/format"
	"github.com/amqpretry/amqpretry/ops"
)

// peekBudget is the head's delivery count past which status notes that peeks add up:
// half of RabbitMQ 4.0+'s default quorum delivery-limit (20).
const peekBudget = 10

func (a *app) statusCmd() *cobra.Command {
	var (
		check   bool
		verbose bool
		peek    string
		margin  = 30 * time.Second
		src     countsSource
		queues  []string
	)
	c := &cobra.Command{
		Use:   "status",
		Short: "Depth and oldest message of the delay, parking, poison and work queues; what needs attention",
		Long: `status reports every delay queue, the parking queue, the poison queue and the work queues
named with --queue: ready messages, consumers, the age of the oldest message, and, with
the broker's own counts, what AMQP cannot see: the expired messages a delay queue keeps
for dead lettering (EXPIRED) and the retries RabbitMQ 4.3 holds in a work queue
(HELD). It flags a missing queue, a STUCK delay queue (its head past its due time, or
expired messages that do not shrink), a non-empty parking queue, a consumer on a delay queue, the
delayed-exchange backend where its plugin cannot run, a quorum queue with fewer members
online than it has (UNDER-REPLICATED: a cluster node down), and a broker near its file
descriptor or socket limit (80%).

The broker's counts come from rabbitmqctl (status and list_queues, each bounded by
--ctl-timeout): --rabbitmqctl auto (the default) uses rabbitmqctl when it is on PATH and
the broker on this host; give a command line for another (for a node in a chroot, say),
or off. Before it reads anything, it asks the node the command reaches for its name and
AMQP ports (rabbitmqctl eval), and reads nothing from a node that does not listen on the
URI's port (a host may run several brokers). With auto, or a rabbitmqctl that names no
node (-n), it then looks for the node of this host that listens there (the name the
broker gives itself, the nodes this host's epmd lists; at most 3 asked, only which node
they are) and runs rabbitmqctl -n that node; status prints which node it read. Or from the management API: --management-url http://host:15672, with the
credentials of AMQP_URI. RabbitMQ 4.0+ reports no file descriptors in rabbitmqctl status:
they are then read from /proc/<pid> of the broker, when this host can see it.

AMQP cannot browse: to learn the age of a message status takes it and gives it back
(basic.get, basic.nack). A quorum queue may put a message given back alone behind the
others (RabbitMQ 3.10.8 always, 4.3.6 from its second return), and 4.0-4.2 count each
return against its delivery-limit. So --peek auto (the default) reads every message of
the parking and poison queues (up to 1,000) and gives them all back at once, which keeps
their order, and reads no delay queue: a stalled delay queue shows in EXPIRED.
--peek always also reads the head of each delay queue, at the risk of a late retry (the
head moved to the end expires late); never reads nothing.

With the broker's counts and --queue, a work queue whose consumers keep unacked
messages while more wait ready is read twice, 2s apart: when none of its counts moved,
nothing was acked (unless exactly as many were published), and status says POSSIBLE
OUTAGE, with what it is based on: the application's handlers may fail as if something
they depend on is down (amqpretry waits out an outage keeping its messages), or take
longer than 2s a message. The broker counts no acks (no message rates without the
management plugin): only the application knows for sure. It is not flagged (the exit
status does not change). Without the broker's counts, nothing is said of it.

It shows first what may need a person: the poison and parking queues, the work queues
in a POSSIBLE OUTAGE, those with a backlog and no consumer (NO CONSUMER), what is
flagged; then the other work queues, and the delay queues in one line (how many, what waits in them, the next due,
with rabbitmqctl). --verbose lists each delay queue too.

Exit status 1 whenever something is flagged, with or without --check; --check prints
only what is flagged (nothing when all is well), for scripts and health checks.

` + exitHelp,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			switch peek {
			case "auto", "always", "never":
			default:
				return usagef("--peek: want auto, always or never, got %q", peek)
			}
			if margin <= 0 {
				return usagef("--stuck-margin: want a positive duration, got %s", margin)
			}
			counts, explicit, err := src.counts(a.uri)
			if err != nil {
				return err
			}
			var ctl ctlRunner
			if src.mgmt == "" {
				ctl = src.ctlRunner(a.uri)
			}
			o, cfg, err := a.openWith(ctl)
			if err != nil {
				return err
			}
			defer o.Close()
			opts := ops.StatusOptions{WorkQueues: queues, StuckMargin: margin, Peek: peek}
			if counts != nil {
				opts.Counts = counts
			}
			s, err := o.Status(a.ctx, opts)
			if err != nil {
				return err
			}
			countsFailed := s.CountsError != "" && explicit
			if a.json {
				if err := a.emit(s); err != nil {
					return err
				}
			} else {
				a.printStatus(s, cfg, queues, peek, check, verbose, explicit)
				if src.reached() != "" && !check {
					a.printf("\nbroker counts: %s\n", src.reached())
				}
			}
			switch {
			case countsFailed:
				return fmt.Errorf("broker counts: %s", s.CountsError)
			case len(s.Flags) > 0:
				return errFlagged
			}
			return nil
		},
	}
	f := c.Flags()
	f.BoolVar(&check, "check", false, "print only what is flagged (the exit status is the same without it)")
	f.BoolVarP(&verbose, "verbose", "v", false, "list each delay queue too (else one line sums them up)")
	f.StringVar(&peek, "peek", "auto", "read messages for their age: auto (parking and poison queues), always (also each delay queue's head: may delay a retry), never")
	f.DurationVar(&margin, "stuck-margin", margin, "a delay queue whose head is this much past its due time is STUCK")
	src.flags(c)
	f.StringArrayVar(&queues, "queue", nil, "a work queue to report on too (repeat for more)")
	return c
}

// countsSource is where status and topology verify read the broker's counts: the
// flags --rabbitmqctl, --management-url and --ctl-timeout.
type countsSource struct {
	ctl, mgmt string
	timeout   time.Duration
	// check is whether rabbitmqctl reaches the broker at the URI: asked once per run.
	check *nodeCheck
}

// nodeCheck returns the run's one check of the rabbitmqctl command words; find: look
// for the node of this host at the URI when words reaches another (--rabbitmqctl auto).
func (src *countsSource) nodeCheck(words []string, uri string, find bool) *nodeCheck {
	if src.check == nil {
		src.check = newNodeCheck(words, uri, src.timeout, find)
	}
	return src.check
}

// reached says which node rabbitmqctl reached, once checked, or "".
func (src *countsSource) reached() string {
	if src.check == nil {
		return ""
	}
	return src.check.reached
}

func (src *countsSource) flags(c *cobra.Command) {
	f := c.Flags()
	f.StringVar(&src.ctl, "rabbitmqctl", "auto", "rabbitmqctl command for the broker's counts: auto (rabbitmqctl on PATH, -n the node of this host on the URI's port), off, or a command line")
	f.StringVar(&src.mgmt, "management-url", "", "read the broker's counts from the management API at this URL instead (credentials from AMQP_URI)")
	f.DurationVar(&src.timeout, "ctl-timeout", 30*time.Second, "bound of each rabbitmqctl run")
	c.MarkFlagsMutuallyExclusive("rabbitmqctl", "management-url")
}

// counts returns the counts function the flags name, or nil for none; explicit tells
// whether the user asked for it (its failure then fails the command). Bad flags are a
// usage error.
func (src *countsSource) counts(uri string) (countsFunc, bool, error) {
	if src.timeout <= 0 {
		return nil, false, usagef("--ctl-timeout: want a positive duration, got %s", src.timeout)
	}
	words, explicit := rabbitmqctlWords(src.ctl, uri)
	if src.ctl != "" && len(words) == 0 && src.ctl != "off" && src.ctl != "auto" {
		return nil, false, usagef("--rabbitmqctl: empty command")
	}
	switch {
	case src.mgmt != "":
		u, err := url.Parse(src.mgmt)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return nil, false, usagef("--management-url: want http(s)://host:port, got %s", redactString(src.mgmt, uri))
		}
		return managementCounts(src.mgmt, uri, nil), true, nil
	case len(words) > 0:
		return ctlCounts(uri, src.timeout, src.nodeCheck(words, uri, mayFind(words, explicit))), explicit, nil
	}
	return nil, false, nil
}

// rabbitmqctlWords resolves --rabbitmqctl to a command line, or nil; explicit tells
// whether the user asked for it (a failure then fails the command).
func rabbitmqctlWords(flagValue, uri string) (words []string, explicit bool) {
	switch flagValue {
	case "off", "":
		return nil, false
	case "auto":
		u, err := url.Parse(uri)
		if err != nil {
			return nil, false
		}
		switch u.Hostname() {
		case "127.0.0.1", "localhost", "::1":
		default:
			return nil, false
		}
		if _, err := exec.LookPath("rabbitmqctl"); err != nil {
			return nil, false
		}
		return []string{"rabbitmqctl"}, false
	}
	return strings.Fields(flagValue), true
}

// vhost returns the virtual host a broker URI names ("/" when it names none).
func vhost(uri string) string {
	u, err := amqp.ParseURI(uri)
	if err != nil {
		return "/"
	}
	return u.Vhost
}

func (a *app) printStatus(s ops.Status, cfg amqpretry.Config, queues []string, peek string, check, verbose, explicit bool) {
	if !check {
		a.printf("RabbitMQ %s at %s, backend %s, prefix %s\n", s.Broker, redactURI(a.uri), s.Backend, s.Prefix)
		if s.Counted {
			a.printf("broker: %s file descriptors, %s sockets\n", ofLimit(s.FileDescriptors, s.FileDescriptorLimit), ofLimit(s.Sockets, s.SocketLimit))
		}
		if s.DelayedExchangeName != "" { // the backend's retries wait in the delayed-message plugin
			state := "its exchange " + s.DelayedExchangeName + " exists, so the plugin runs"
			switch {
			case hasFlag(s, ops.FlagMissing, "plugin"):
				state = "cannot run on RabbitMQ " + s.Broker
			case !s.DelayedExchange:
				state = "unknown: its exchange " + s.DelayedExchangeName + " does not exist (not applied yet, or the plugin is not enabled)"
			}
			a.printf("delayed-message plugin: %s\n", state)
			switch {
			case s.PluginCounted:
				a.printf("waiting in the plugin: %d retries, by its own count (they come back to their work queues when due; the plugin offers no way to list, retry now or purge them)\n", s.PluginWaiting)
			case s.DelayedExchange:
				a.printf("waiting in the plugin: unknown (its count is read with rabbitmqctl eval: --rabbitmqctl)\n")
			}
		}
		if s.Warning != "" {
			a.printf("warning: %s\n", s.Warning)
		}
		if peek == "always" && s.NacksCounted && hasRole(s, "delay") {
			a.printf("note: RabbitMQ %s counts each peek against the delivery-limit of a delay queue's head (20 by default): past it the retry comes back early\n", s.Broker)
		}
		if s.CountsError != "" {
			word := "note"
			if explicit {
				word = "error"
			}
			a.printf("%s: broker counts unavailable (EXPIRED, HELD and the broker's limits unknown): %s\n", word, a.redact(s.CountsError))
		}
		a.printf("\n")
		ov := s.Overview()
		shown := append(slices.Clone(ov.First), ov.Work...)
		if verbose {
			shown = append(shown, ov.DelayQueues...)
		}
		tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "QUEUE\tROLE\tREADY\tUNACKED\tEXPIRED\tHELD\tCONSUMERS\tTTL\tOLDEST\tSTATE")
		for _, q := range shown {
			ready, unacked, expired, held, consumers, ttl, oldest := "-", "-", "-", "-", "-", "-", "-"
			if q.Exists {
				ready, consumers = fmt.Sprint(q.Ready), fmt.Sprint(q.Consumers)
				if q.Counted {
					unacked = fmt.Sprint(q.Unacked)
					switch q.Role {
					case "delay":
						expired = fmt.Sprint(q.Expired)
					case "work":
						held = fmt.Sprint(q.Held)
					}
				}
				switch {
				case q.AgeKnown:
					oldest = format.Duration(q.OldestAge)
				case q.Ready > 0 && q.Role == "delay" && !q.Peeked:
					oldest = "unread"
				case q.Ready > 0 && q.Role != "work":
					oldest = "unknown"
				}
			}
			if q.TTL > 0 {
				ttl = format.Configured(q.TTL)
			}
			role := q.Role
			if q.Old {
				role = "delay (old)" // another backend's, left under the prefix
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", q.Name, role, ready, unacked, expired, held, consumers, ttl, oldest, queueState(s, q))
		}
		_ = tw.Flush()
		for _, q := range ov.First {
			if q.PossibleOutage() {
				a.printf("\n%s\n", format.PossibleOutage(q))
			}
		}
	}
	switch {
	case len(s.Flags) > 0:
		if !check {
			a.printf("\nflagged:\n")
		}
		for _, f := range s.Flags {
			a.printf("  %s\n", a.describe(f, s, cfg, queues))
		}
	case check:
	case s.PluginCounted && s.PluginWaiting > 0:
		// Retries wait, out of sight of the table: "nothing" would hide them.
		a.printf("\nno problem flagged; %d retries wait in the delayed-message plugin (exchange %s) until due\n", s.PluginWaiting, s.DelayedExchangeName)
	default:
		a.printf("\nnothing flagged\n")
	}
	if check {
		return
	}
	if d := s.Overview().Delay; d.Queues > 0 {
		each := "; each queue: status --verbose"
		if verbose {
			each = ""
		}
		a.printf("\n%s%s\n", format.Delay(d), each)
	}
	a.printWaiting(s)
}

// printWaiting prints the waiting retries of each work queue, when status read them.
func (a *app) printWaiting(s ops.Status) {
	tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
	header := false
	for _, q := range s.Queues {
		if !q.WaitingRead || q.Role != "work" {
			continue
		}
		if !header {
			a.printf("\nwaiting retries (read with rabbitmqctl eval; nothing changed; `amqpretry waiting list --queue Q` for each one):\n")
			fmt.Fprintln(tw, "WORK QUEUE\tWAITING\tOVERDUE\tNEXT DUE\tLAST DUE")
			header = true
		}
		next, last := "-", "-"
		if q.Waiting > 0 {
			next, last = stamp(q.NextDue)+" (in "+format.Duration(time.Until(q.NextDue))+")", stamp(q.LastDue)+" (in "+format.Duration(time.Until(q.LastDue))+")"
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%s\t%s\n", q.Name, q.Waiting, q.Overdue, next, last)
	}
	_ = tw.Flush()
}

func hasRole(s ops.Status, role string) bool {
	for _, q := range s.Queues {
		if q.Role == role {
			return true
		}
	}
	return false
}

// hasFlag tells whether s flags something of kind and role.
func hasFlag(s ops.Status, kind ops.FlagKind, role string) bool {
	for _, f := range s.Flags {
		if f.Kind == kind && f.Role == role {
			return true
		}
	}
	return false
}

func ofLimit(used, limit int) string {
	if limit <= 0 {
		return fmt.Sprintf("%d (limit unknown)", used)
	}
	return fmt.Sprintf("%d of %d (%d%%)", used, limit, used*100/limit)
}

// queueState is the STATE column.
func queueState(s ops.Status, q ops.QueueStatus) string {
	var states []string
	for _, f := range s.Flags {
		if f.Name == q.Name && f.Role == q.Role {
			states = append(states, strings.ToUpper(string(f.Kind)))
		}
	}
	if q.PossibleOutage() {
		states = append(states, "POSSIBLE OUTAGE")
	}
	if q.Unconsumed() {
		states = append(states, "NO CONSUMER")
	}
	if q.HeadDeliveryCount >= peekBudget && q.Role == "delay" {
		states = append(states, fmt.Sprintf("head delivered %d times", q.HeadDeliveryCount))
	}
	if len(states) == 0 {
		return "ok"
	}
	return strings.Join(states, ", ")
}

// describe renders a flag as one line, with its fix.
func (a *app) describe(f ops.Flag, s ops.Status, cfg amqpretry.Config, queues []string) string {
	switch f.Kind {
	case ops.FlagMissing:
		if f.Role == "plugin" {
			return fmt.Sprintf("MISSING plugin: RabbitMQ %s cannot run %s, which the delayed-exchange backend needs (4.3 and later keep their metadata in Khepri only); use binary-levels, ttl-tiers or delayed-retry", s.Broker, f.Name)
		}
		if f.Role == "exchange" {
			return fmt.Sprintf("MISSING exchange %s of the delayed-exchange backend: create it with `%s` (it needs the rabbitmq_delayed_message_exchange plugin)", f.Name, applyCommand(cfg, queues))
		}
		return fmt.Sprintf("MISSING %s queue %s: create it with `%s`", f.Role, f.Name, applyCommand(cfg, queues))
	case ops.FlagStuck:
		if f.Count > 0 {
			return fmt.Sprintf("STUCK delay queue %s: %d expired messages waiting to be dead-lettered did not move for %s; dead lettering out of it has stalled (does the work queue refuse publishes, x-max-length with reject-publish?)", f.Name, f.Count, f.Interval)
		}
		return fmt.Sprintf("STUCK delay queue %s: its head is %s past its due time; dead lettering out of it has stalled (is its dead-letter exchange refusing publishes?)", f.Name, format.Duration(f.Late))
	case ops.FlagParkingQueue:
		return fmt.Sprintf("PARKED %d messages in %s: retries whose work queue was gone when they came due; `amqpretry parking list` names their queues: re-create them (`%s`), then run `amqpretry parking redrive`", f.Count, f.Name, applyCommand(cfg, []string{"<queue>"}))
	case ops.FlagConsumed:
		return fmt.Sprintf("CONSUMED delay queue %s has %d consumers: a delivered message never expires; stop them", f.Name, f.Count)
	case ops.FlagUnderReplicated:
		return fmt.Sprintf("UNDER-REPLICATED %s queue %s: %d of its %d members online; a node is down or its member has not started. It works while a majority is online and stalls, losing nothing, without one: bring the node back (rabbitmq-queues grow adds members on other nodes)", f.Role, f.Name, f.Count, f.Limit)
	case ops.FlagQueueType:
		return "QUEUE-TYPE " + f.Fix
	case ops.FlagNearLimit:
		what := strings.ReplaceAll(f.Name, "_", " ")
		return fmt.Sprintf("NEAR-LIMIT: the broker uses %d of its %d %s (%d%%); past the limit every new connection hangs in its handshake; on RabbitMQ 3.x each quorum queue uses 3 of them (docs/broker-resources.md): delete unused quorum queues, or raise the limit (ulimit -n, LimitNOFILE)", f.Count, f.Limit, what, f.Count*100/f.Limit)
	}
	return fmt.Sprintf("%s %s", strings.ToUpper(string(f.Kind)), f.Name)
}
