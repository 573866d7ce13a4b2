package ops

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os/exec"
	"strconv"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/xdeath"
)

// Queue roles in a Status.
const (
	RoleDelay   = "delay"
	RoleParking = "parking"
	RolePoison  = "poison"
)

// PeekMode says whether Status reads the head message of the delay queues.
//
// Why it matters: AMQP 0-9-1 cannot browse a queue. The only way to learn the age of a
// queue's head is to take it (basic.get) and give it back (basic.nack with requeue),
// which puts it back at the head. On a quorum queue every such return counts as a
// delivery on RabbitMQ up to 4.2 (x-delivery-count grows by one), and RabbitMQ 4.0+
// gives every quorum queue a delivery-limit of 20 by default: after 20 returns the
// broker dead-letters the message, which for a delay queue means the retry goes back to
// its work queue early. From 4.3 on, basic.nack (unlike basic.reject) is not counted.
// The delay queues are quorum queues, so:
//
//   - a peek is one basic.get and one basic.nack(requeue) on a channel of its own,
//     never a reject and never a closed channel (both count as failed deliveries on 4.3);
//   - at most one message per delay queue per Status call, and only of a non-empty queue;
//   - PeekAuto (the default) skips the delay queues on RabbitMQ 4.0 to 4.2, where each
//     peek spends one of the head's 20 deliveries; their age is then unknown and a
//     stall cannot be seen. Everywhere else a peek costs nothing that matters (3.x has
//     no default delivery limit; 4.3+ does not count nacks);
//   - a peeked head whose x-delivery-count has reached half the default limit is
//     reported (QueueStatus.Note), so that a status loop run too often shows up.
//
// The parking and poison queues are classic queues, without a delivery limit: they
// are always peeked.
type PeekMode string

// Values of PeekMode.
const (
	PeekAuto   PeekMode = "auto"
	PeekAlways PeekMode = "always"
	PeekNever  PeekMode = "never"
)

// DefaultStuckMargin is how long past its due time a message may stay at the head of a
// delay queue before Status calls the queue stuck.
const DefaultStuckMargin = 30 * time.Second

// peekDeliveryBudget is half of RabbitMQ 4.0+'s default quorum delivery-limit (20).
const peekDeliveryBudget = 10

// StatusOptions configures Status.
type StatusOptions struct {
	// StuckMargin: a delay queue is stuck when its head message is this much past its
	// due time (its TTL). Default: DefaultStuckMargin.
	StuckMargin time.Duration
	// Peek says whether to read the head of the delay queues. Default: PeekAuto.
	Peek PeekMode
	// Now is the current time. Default: time.Now.
	Now func() time.Time
	// Counts, if set, reads the broker's own message counts (see QueueCounts), which
	// show what AMQP cannot: messages a quorum delay queue holds for at-least-once dead
	// lettering. Such messages have left the ready list, so a passive declare counts
	// them as 0 and basic.get cannot see them; when their destination refuses them
	// (a full work queue with x-overflow reject-publish, for example) they pile up
	// there unseen. With Counts, Status samples twice, BacklogInterval apart, and flags
	// a delay queue STUCK whose backlog did not shrink. RabbitmqctlCounts is one.
	Counts func(ctx context.Context) (map[string]QueueCounts, error)
	// BacklogInterval is the time between the two samples of Counts. Default: 2s.
	BacklogInterval time.Duration
}

// QueueCounts are one queue's message counts as the broker's management side reports
// them (rabbitmqctl list_queues, or the management API).
type QueueCounts struct {
	// Messages is every message the queue holds; Ready and Unacked are what AMQP sees.
	// For a quorum queue, Messages - Ready - Unacked are held for dead lettering.
	Messages, Ready, Unacked int
}

// Backlog is the number of messages held for (at-least-once) dead lettering.
func (c QueueCounts) Backlog() int { return max(c.Messages-c.Ready-c.Unacked, 0) }

// RabbitmqctlCounts returns a StatusOptions.Counts that runs command (for example
// []string{"rabbitmqctl"}) with `-q list_queues -p vhost name messages messages_ready
// messages_unacknowledged --no-table-headers`. It needs a rabbitmqctl that reaches the
// broker (the same node, its Erlang cookie).
func RabbitmqctlCounts(command []string, vhost string) func(ctx context.Context) (map[string]QueueCounts, error) {
	return func(ctx context.Context) (map[string]QueueCounts, error) {
		if len(command) == 0 {
			return nil, errors.New("rabbitmqctl: no command")
		}
		args := append(command[1:len(command):len(command)], "-q", "list_queues", "-p", vhost, "name", "messages", "messages_ready", "messages_unacknowledged", "--no-table-headers")
		out, err := exec.CommandContext(ctx, command[0], args...).Output()
		if err != nil {
			return nil, fmt.Errorf("%s list_queues: %w", strings.Join(command, " "), err)
		}
		counts := map[string]QueueCounts{}
		for _, line := range strings.Split(string(out), "\n") {
			f := strings.Split(strings.TrimSpace(line), "\t")
			if len(f) != 4 {
				continue
			}
			var c QueueCounts
			var errs [3]error
			c.Messages, errs[0] = strconv.Atoi(f[1])
			c.Ready, errs[1] = strconv.Atoi(f[2])
			c.Unacked, errs[2] = strconv.Atoi(f[3])
			if errors.Join(errs[:]...) == nil {
				counts[f[0]] = c
			}
		}
		return counts, nil
	}
}

// VHost returns the virtual host a broker URI names ("/" when it names none).
func VHost(uri string) string {
	u, err := url.Parse(uri)
	if err != nil || u.Path == "" || u.Path == "/" {
		return "/"
	}
	return strings.TrimPrefix(u.Path, "/")
}

// QueueStatus is what Status found about one queue.
type QueueStatus struct {
	// Name of the queue.
	Name string `json:"name"`
	// Role is RoleDelay, RoleParking or RolePoison.
	Role string `json:"role"`
	// Exists is false when the queue is not declared.
	Exists bool `json:"exists"`
	// Messages ready in the queue, and its consumers (a delay queue must have none).
	Messages  int `json:"messages"`
	Consumers int `json:"consumers"`
	// TTL of a delay queue.
	TTL time.Duration `json:"ttl_ns,omitempty"`
	// OldestAge is the age of the head message (since it was handed over, for a delay
	// queue; since it failed, for the poison queue; since it came due, for parking),
	// when the head was peeked and carries a time. AgeKnown tells whether it is set.
	OldestAge time.Duration `json:"oldest_age_ns,omitempty"`
	AgeKnown  bool          `json:"age_known"`
	// HeadDue is the head's due time (amqpretry-due), for a delay or parking queue.
	HeadDue time.Time `json:"head_due,omitzero"`
	// HeadDeliveryCount is the head's x-delivery-count after the peek (quorum queues).
	HeadDeliveryCount int64 `json:"head_delivery_count,omitempty"`
	// Peeked tells whether the head was read.
	Peeked bool `json:"peeked"`
	// Stuck: a delay queue whose head is more than StuckMargin past its due time: dead
	// lettering out of it has stalled.
	Stuck bool `json:"stuck"`
	// DeadLetterBacklog is the number of messages the queue holds for dead lettering
	// (invisible over AMQP), when StatusOptions.Counts is set (BacklogKnown).
	DeadLetterBacklog int  `json:"dead_letter_backlog"`
	BacklogKnown      bool `json:"backlog_known"`
	// Note explains an unknown age or a peek that was skipped.
	Note string `json:"note,omitempty"`
}

// Status is the state of the retry topology.
type Status struct {
	// Broker is the RabbitMQ version from the server properties.
	Broker string `json:"broker_version"`
	// Backend and Prefix, as configured.
	Backend string `json:"backend"`
	Prefix  string `json:"prefix"`
	// DelayedMessagePlugin tells whether the plugin is enabled; PluginKnown is false
	// when the probe could not tell (PluginNote says why).
	DelayedMessagePlugin bool   `json:"delayed_message_plugin"`
	PluginKnown          bool   `json:"plugin_known"`
	PluginNote           string `json:"plugin_note,omitempty"`
	// Warnings of the capability check.
	Warnings []string `json:"warnings,omitempty"`
	// Queues: the delay queues, the parking queue and the poison queue.
	Queues []QueueStatus `json:"queues"`
	// Flags: one line per problem (a stuck delay queue, a non-empty parking queue, a
	// missing queue, a consumer on a delay queue). Empty when all is well.
	Flags []string `json:"flags"`
}

// Flagged tells whether anything was flagged (the command's --check exits non-zero).
func (s Status) Flagged() bool { return len(s.Flags) > 0 }

// Status reports the depth and the age of the oldest message of every delay queue, the
// parking queue and the poison queue, the broker's version, the delayed-message plugin
// and the capability warnings, and flags what needs attention. See PeekMode for how
// the head of a delay queue is read.
func (o *Ops) Status(ctx context.Context, opts StatusOptions) (Status, error) {
	if opts.StuckMargin <= 0 {
		opts.StuckMargin = DefaultStuckMargin
	}
	if opts.Peek == "" {
		opts.Peek = PeekAuto
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.BacklogInterval <= 0 {
		opts.BacklogInterval = 2 * time.Second
	}
	switch opts.Peek {
	case PeekAuto, PeekAlways, PeekNever:
	default:
		return Status{}, fmt.Errorf("invalid options: Peek: unknown mode %q (known: auto, always, never)", opts.Peek)
	}
	s := Status{Backend: o.cfg.Delay.Backend, Prefix: o.cfg.Delay.Prefix, Flags: []string{}}
	c, err := delay.Probe(o.handoff)
	s.Broker = c.Version
	switch {
	case err != nil:
		s.PluginNote = "probe could not tell: " + redactString(err.Error(), o.cfg.URI)
	default:
		s.PluginKnown, s.DelayedMessagePlugin = true, c.DelayedMessagePlugin
	}
	if w := delay.VersionWarning(c.Version); w != "" {
		s.Warnings = append(s.Warnings, w)
	}
	if s.Backend == delay.BackendDelayedExchange && s.PluginKnown && !s.DelayedMessagePlugin {
		s.Warnings = append(s.Warnings, "the delayed-exchange backend needs the rabbitmq_delayed_message_exchange plugin, which is not enabled")
		s.Flags = append(s.Flags, "plugin rabbitmq_delayed_message_exchange not enabled for the delayed-exchange backend")
	}
	countedNacks := countsNacks(c.Version)
	if countedNacks && opts.Peek == PeekAuto {
		s.Warnings = append(s.Warnings, fmt.Sprintf("RabbitMQ %s counts a requeued peek as a delivery on quorum queues (default delivery-limit 20): delay queues are not peeked, their age is unknown (use peek mode always to read them anyway)", c.Version))
	}

	delayQueues, err := delay.DelayQueues(o.cfg.Delay)
	if err != nil {
		return s, err
	}
	backlog, err := o.backlog(ctx, opts)
	if err != nil {
		s.Warnings = append(s.Warnings, "dead-letter backlog unknown: "+redactString(err.Error(), o.cfg.URI))
	}
	for _, dq := range delayQueues {
		if err := ctx.Err(); err != nil {
			return s, err
		}
		qs := QueueStatus{Name: dq.Name, Role: RoleDelay, TTL: dq.TTL}
		peek := opts.Peek == PeekAlways || opts.Peek == PeekAuto && !countedNacks
		if err := o.queueStatus(&qs, peek, opts); err != nil {
			return s, err
		}
		if b, ok := backlog[dq.Name]; ok {
			qs.DeadLetterBacklog, qs.BacklogKnown = b.now, true
			if b.stuck {
				qs.Stuck = true
			}
		}
		switch {
		case !qs.Exists:
			s.Flags = append(s.Flags, fmt.Sprintf("MISSING delay queue %s", qs.Name))
		case qs.Stuck && qs.DeadLetterBacklog > 0:
			s.Flags = append(s.Flags, fmt.Sprintf("STUCK delay queue %s: %d expired messages waiting to be dead-lettered did not move for %s; dead lettering out of it has stalled (does the work queue refuse publishes, x-max-length with reject-publish?)",
				qs.Name, qs.DeadLetterBacklog, opts.BacklogInterval))
		case qs.Stuck:
			s.Flags = append(s.Flags, fmt.Sprintf("STUCK delay queue %s: its head is %s past its due time (TTL %s); dead lettering out of it has stalled (is its dead-letter exchange refusing publishes?)",
				qs.Name, round(opts.Now().Sub(qs.HeadDue)), dq.TTL))
		}
		if qs.Consumers > 0 {
			s.Flags = append(s.Flags, fmt.Sprintf("CONSUMED delay queue %s has %d consumers: a delivered message never expires", qs.Name, qs.Consumers))
		}
		s.Queues = append(s.Queues, qs)
	}
	if o.cfg.Delay.Backend != delay.BackendDelayedExchange {
		qs := QueueStatus{Name: o.ParkingQueue(), Role: RoleParking}
		if err := o.queueStatus(&qs, opts.Peek != PeekNever, opts); err != nil {
			return s, err
		}
		switch {
		case !qs.Exists:
			s.Flags = append(s.Flags, fmt.Sprintf("MISSING parking queue %s", qs.Name))
		case qs.Messages > 0:
			s.Flags = append(s.Flags, fmt.Sprintf("PARKED %d messages in %s: retries whose work queue was gone when they came due; re-create the queue and run `amqpretry parking redrive`", qs.Messages, qs.Name))
		}
		s.Queues = append(s.Queues, qs)
	}
	qs := QueueStatus{Name: o.PoisonQueue(), Role: RolePoison}
	if err := o.queueStatus(&qs, opts.Peek != PeekNever, opts); err != nil {
		return s, err
	}
	if !qs.Exists {
		s.Flags = append(s.Flags, fmt.Sprintf("MISSING poison queue %s", qs.Name))
	}
	s.Queues = append(s.Queues, qs)
	return s, nil
}

// backlogSample is a delay queue's dead-letter backlog over two samples.
type backlogSample struct {
	now   int
	stuck bool
}

// backlog samples opts.Counts twice and tells, per queue, the backlog and whether it
// stayed and did not shrink.
func (o *Ops) backlog(ctx context.Context, opts StatusOptions) (map[string]backlogSample, error) {
	if opts.Counts == nil {
		return nil, nil
	}
	if opts.BacklogInterval <= 0 {
		opts.BacklogInterval = 2 * time.Second
	}
	first, err := opts.Counts(ctx)
	if err != nil {
		return nil, err
	}
	out := map[string]backlogSample{}
	waiting := false
	for name, c := range first {
		out[name] = backlogSample{now: c.Backlog()}
		waiting = waiting || c.Backlog() > 0
	}
	if !waiting {
		return out, nil
	}
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-time.After(opts.BacklogInterval):
	}
	second, err := opts.Counts(ctx)
	if err != nil {
		return nil, err
	}
	for name, c := range second {
		before := first[name].Backlog()
		out[name] = backlogSample{now: c.Backlog(), stuck: before > 0 && c.Backlog() >= before}
	}
	return out, nil
}

// countsNacks: RabbitMQ 4.0 to 4.2 count a basic.nack with requeue against a quorum
// queue's default delivery-limit of 20 (3.x has no default limit, 4.3 does not count
// nacks). An unknown version counts as 4.0.
func countsNacks(version string) bool {
	major, minor, ok := majorMinor(version)
	return !ok || major == 4 && minor < 3
}

func majorMinor(v string) (major, minor int, ok bool) {
	if _, err := fmt.Sscanf(v, "%d.%d", &major, &minor); err != nil {
		return 0, 0, false
	}
	return major, minor, true
}

// queueStatus fills qs: depth, consumers, and (if peek) the head's age.
func (o *Ops) queueStatus(qs *QueueStatus, peek bool, opts StatusOptions) error {
	q, exists, err := o.queueDepth(qs.Name)
	if err != nil {
		return err
	}
	qs.Exists, qs.Messages, qs.Consumers = exists, q.Messages, q.Consumers
	switch {
	case !exists || q.Messages == 0:
		return nil
	case !peek:
		qs.Note = "head not peeked"
		return nil
	}
	d, ok, err := o.peek(qs.Name)
	if err != nil {
		return err
	}
	if !ok {
		return nil // emptied meanwhile
	}
	qs.Peeked = true
	now := opts.Now()
	if n, ok := xdeath.Integer(d.Headers["x-delivery-count"]); ok {
		qs.HeadDeliveryCount = n
		if qs.Role == RoleDelay && n >= peekDeliveryBudget {
			qs.Note = fmt.Sprintf("head delivered %d times: peeks count as deliveries on this broker; on RabbitMQ 4.0+ a quorum queue dead-letters a message after 20 (an early retry)", n)
		}
	}
	due, dueOK := headerTime(d.Headers, middleware.DueKey)
	if dueOK {
		qs.HeadDue = due
	}
	switch qs.Role {
	case RoleDelay:
		if !dueOK {
			qs.Note = strings.TrimPrefix(qs.Note+"; head has no "+middleware.DueKey+" header: age unknown", "; ")
			return nil
		}
		effective, _ := time.ParseDuration(headerString(d.Headers, middleware.EffectiveDelayKey))
		qs.OldestAge, qs.AgeKnown = now.Sub(due.Add(-effective)), true
		qs.Stuck = now.Sub(due) > opts.StuckMargin
	case RoleParking:
		if dueOK {
			qs.OldestAge, qs.AgeKnown = now.Sub(due), true
		} else if !d.Timestamp.IsZero() {
			qs.OldestAge, qs.AgeKnown = now.Sub(d.Timestamp), true
		}
	case RolePoison:
		if t, ok := headerTime(d.Headers, middleware.LastFailureKey); ok {
			qs.OldestAge, qs.AgeKnown = now.Sub(t), true
		} else if !d.Timestamp.IsZero() {
			qs.OldestAge, qs.AgeKnown = now.Sub(d.Timestamp), true
		}
	}
	return nil
}

// peek takes the head of queue and gives it back with basic.nack(requeue) on a channel
// of its own (see PeekMode).
func (o *Ops) peek(queue string) (amqp.Delivery, bool, error) {
	ch, err := o.channel()
	if err != nil {
		return amqp.Delivery{}, false, err
	}
	defer ch.Close() //nolint:errcheck // after the nack
	d, ok, err := ch.Get(queue, false)
	if err != nil || !ok {
		if err != nil {
			err = fmt.Errorf("peek queue %q: %w", queue, err)
		}
		return d, false, err
	}
	if err := ch.Nack(d.DeliveryTag, false, true); err != nil {
		return d, false, fmt.Errorf("give back the head of queue %q: %w", queue, err)
	}
	return d, true, nil
}

func headerString(h amqp.Table, key string) string {
	s, _ := h[key].(string)
	return s
}

func headerTime(h amqp.Table, key string) (time.Time, bool) {
	t, err := time.Parse(time.RFC3339Nano, headerString(h, key))
	return t, err == nil
}

func round(d time.Duration) time.Duration {
	if d > time.Minute {
		return d.Round(time.Second)
	}
	return d.Round(10 * time.Millisecond)
}

// redactString hides the password of uri wherever it appears in s.
func redactString(s, uri string) string {
	u, err := url.Parse(uri)
	if err != nil || u.User == nil {
		return s
	}
	const mark = "\x00uri\x00"
	s = strings.ReplaceAll(s, uri, mark)
	if p, ok := u.User.Password(); ok && p != "" {
		s = strings.ReplaceAll(s, p, "xxxxx")
	}
	return strings.ReplaceAll(s, mark, delay.Redact(uri))
}

// RedactIn hides the password of uri wherever it appears in s (an error text, for
// example), and the whole uri behind delay.Redact.
func RedactIn(s, uri string) string { return redactString(s, uri) }
