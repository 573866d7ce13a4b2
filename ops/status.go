package ops

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/version"
	"github.com/amqpretry/amqpretry/internal/wire"
)

// Defaults of StatusOptions.
const (
	defaultStuckMargin    = 30 * time.Second
	defaultSampleInterval = 2 * time.Second
	// nearLimit is the share of the broker's file descriptor or socket limit past which
	// Status flags it (FlagNearLimit): 80%.
	nearLimitPercent = 80
)

// StatusOptions configures Status.
type StatusOptions struct {
	// WorkQueues are application queues to report on too: their ready messages and
	// consumers, and, with Counts, the retries RabbitMQ 4.3 holds in them (delayed
	// retry; QueueStatus.Held). A missing one is flagged. They are never peeked.
	WorkQueues []string
	// StuckMargin: a delay queue is stuck when its head message is this much past its
	// due time (its TTL). Default (0): 30s.
	StuckMargin time.Duration
	// Peek says how much Status reads of the queues (see the package documentation):
	// "auto" (the default, ""): every message of the parking and poison queues, to
	// find the oldest, and of the delay queues nothing; "always": also the head of
	// each delay queue, at the risk of a late retry; "never": nothing.
	Peek string
	// Counts, if set, reads the broker's own counts (BrokerCounts), which show what
	// AMQP cannot: the expired messages a quorum delay queue keeps for at-least-once
	// dead lettering, and the retries a RabbitMQ 4.3 work queue holds (both
	// have left the ready list: a passive declare counts them as 0 and basic.get cannot
	// see them), the unacked messages, and the broker's file descriptors and sockets.
	// With Counts, Status samples twice, SampleInterval apart, when a delay queue keeps
	// expired messages for dead lettering, and flags it stuck when they did not shrink;
	// and when a work queue has both unacked and ready messages, to tell whether its
	// counts moved (QueueStatus.Stalled).
	Counts func(ctx context.Context) (BrokerCounts, error)
	// SampleInterval is the time between the two samples of Counts. Default (0): 2s.
	SampleInterval time.Duration
}

// BrokerCounts are what the broker's management side reports (rabbitmqctl status and
// list_queues, or the management API), for StatusOptions.Counts.
type BrokerCounts struct {
	// Messages, Ready and Unacked count each queue's messages, by queue name: every
	// message in it, those ready for delivery, those delivered and not yet acked.
	// What Messages counts beyond the other two is set aside: for dead lettering
	// (quorum queues, at-least-once) or held for delayed retry (RabbitMQ 4.3).
	Messages, Ready, Unacked map[string]int
	// Members and Online count, by queue name, each quorum queue's members and those
	// of them online (rabbitmqctl list_queues members online); a queue of another type
	// is absent. Fewer online than members: a node is down, or a member has not started.
	Members, Online map[string]int
	// FileDescriptors and Sockets the broker uses, and their limits; a limit of 0 is
	// unknown (RabbitMQ 4.0 and later report neither in rabbitmqctl status).
	FileDescriptors, FileDescriptorLimit int
	Sockets, SocketLimit                 int
}

// QueueStatus is what Status found about one queue.
type QueueStatus struct {
	// Name of the queue.
	Name string `json:"name"`
	// Role is "delay", "parking", "poison" or "work".
	Role string `json:"role"`
	// Exists is false when the queue is not declared; every count is then 0.
	Exists bool `json:"exists"`
	// Ready messages (what a passive declare reports) and Consumers (a delay queue
	// must have none).
	Ready     int `json:"ready"`
	Consumers int `json:"consumers"`
	// TTL of a delay queue.
	TTL time.Duration `json:"ttl_ns,omitempty"`
	// Counted tells that the broker's counts (StatusOptions.Counts) include the queue:
	// Messages in all and Unacked, and, of the messages set aside, Expired (a delay
	// queue: expired messages waiting to be dead-lettered) or Held (a work queue:
	// retries RabbitMQ 4.3 holds in delayed retry, counted in neither Ready nor
	// Unacked).
	Counted  bool `json:"counted"`
	Messages int  `json:"messages"`
	Unacked  int  `json:"unacked"`
	Expired  int  `json:"expired"`
	Held     int  `json:"held"`
	// Members and Online, for a quorum queue the counts include: its members and those
	// online (FlagUnderReplicated when fewer).
	Members int `json:"members,omitempty"`
	Online  int `json:"members_online,omitempty"`
	// Peeked tells whether messages were read: the head of a delay queue, every message
	// of a parking or poison queue (unless it has over 1,000). When one carries a
	// time, AgeKnown is set and OldestAge is the age of the oldest (since it was handed
	// over, for a delay queue's head; since it came due, for parking; since it failed,
	// for the poison queue).
	Peeked    bool          `json:"peeked"`
	AgeKnown  bool          `json:"age_known"`
	OldestAge time.Duration `json:"oldest_age_ns,omitempty"`
	// HeadDue is the head's due time, for a delay or parking queue.
	HeadDue time.Time `json:"head_due,omitzero"`
	// HeadDeliveryCount is the head's x-delivery-count when read (quorum queues):
	// RabbitMQ 4.0+ dead-letters a message after 20 deliveries unless the queue says
	// otherwise (the poison and parking queues allow a million).
	HeadDeliveryCount int64 `json:"head_delivery_count,omitempty"`
	// Waiting, for a work queue, counts the retries that wait to come back to it (Source
	// Waiting: in the delay queues under the prefix, of any backend, and in RabbitMQ
	// 4.3's delayed retry), and for a delay queue those that wait in it; NextDue and
	// LastDue are the first and last of their due times, and Overdue those past their
	// due time by more than StuckMargin, of the first 1,000 of each delay queue (the
	// peek costs N²: 2,000 took 21 s on a loaded machine; List(Waiting) reads more).
	// Read (without changing anything) only with Config.Rabbitmqctl and Peek other than
	// "never"; WaitingRead tells they were.
	WaitingRead bool      `json:"waiting_read,omitempty"`
	Waiting     int       `json:"waiting,omitempty"`
	Overdue     int       `json:"overdue,omitempty"`
	NextDue     time.Time `json:"next_due,omitzero"`
	LastDue     time.Time `json:"last_due,omitzero"`
	// Old marks a delay queue of another backend than the configured one, found under
	// the prefix (Config.Rabbitmqctl): storage left by a change of Backend, Tiers or
	// Levels. It keeps delivering until it is empty; Teardown removes it then.
	Old bool `json:"old,omitempty"`
	// Stuck: a delay queue whose head is more than StuckMargin past its due time, or
	// whose expired messages did not shrink between two samples: dead lettering out
	// of it has stalled.
	Stuck bool `json:"stuck"`
	// Stalled, for a work queue with consumers, unacked and ready messages in both
	// samples of the broker's counts (StatusOptions.Counts), is the time between the
	// samples (SampleInterval) when none of its counts (messages, ready, unacked)
	// moved: its consumers keep deliveries unacked and took nothing more, so nothing was acked
	// or nacked, unless exactly as many were published meanwhile. That is what a
	// consumer in an outage shows from outside (see PossibleOutage); 0 when the counts
	// moved or were not read twice. The broker counts no acks (no message rates
	// without the management plugin): this is all it shows.
	Stalled time.Duration `json:"stalled_ns,omitempty"`
}

// PossibleOutage tells a work queue whose consumers keep deliveries without acking
// any (Stalled): their application may be in an outage, its handlers failing as if
// something they depend on is down (amqpretry.Config.Outage keeps its messages in the
// process meanwhile), or its handlers take longer than Stalled a message. Only the
// application knows for sure (its metrics, amqpretry_in_outage).
func (q QueueStatus) PossibleOutage() bool {
	return q.Role == "work" && q.Exists && q.Consumers > 0 && q.Stalled > 0
}

// Status is the state of the retry topology.
type Status struct {
	// Broker is the RabbitMQ version from the server properties.
	Broker string `json:"broker_version"`
	// Backend and Prefix, as configured.
	Backend string `json:"backend"`
	Prefix  string `json:"prefix"`
	// Warning warns about a broker release that loses retries (RabbitMQ 3.13.0 to
	// 3.13.2: rabbitmq-server #11159), or is empty.
	Warning string `json:"warning,omitempty"`
	// NacksCounted tells that the broker counts each message given back, and so each
	// peek of a delay queue's head (Peek "always"), against a quorum queue's
	// delivery-limit (20 by default): RabbitMQ 4.0 to 4.2, or a version not known.
	NacksCounted bool `json:"nacks_counted,omitempty"`
	// DelayedExchange, for the delayed-exchange backend, tells whether its exchange
	// (DelayedExchangeName) exists, and so that the plugin runs; otherwise false.
	DelayedExchange     bool   `json:"delayed_exchange"`
	DelayedExchangeName string `json:"delayed_exchange_name,omitempty"`
	// PluginWaiting, for the delayed-exchange backend, is how many messages the
	// plugin keeps for its exchange, as the plugin itself reports (rabbitmq eval of its
	// messages_delayed, with Config.Rabbitmqctl); PluginCounted tells it was read.
	// When it cannot be, CountsError says why: it is never guessed.
	PluginCounted bool `json:"plugin_counted,omitempty"`
	PluginWaiting int  `json:"plugin_waiting,omitempty"`
	// Queues: the delay queues, the parking queue, the poison queue, the work queues.
	Queues []QueueStatus `json:"queues"`
	// Counted tells that StatusOptions.Counts answered: the broker's file descriptors
	// and sockets used, and their limits (0: unknown). CountsError is its error, when
	// it failed, or that of reading the waiting retries or the delayed-message plugin's
	// count (Status still reports what AMQP shows).
	Counted             bool   `json:"counted"`
	FileDescriptors     int    `json:"file_descriptors"`
	FileDescriptorLimit int    `json:"file_descriptor_limit"`
	Sockets             int    `json:"sockets"`
	SocketLimit         int    `json:"socket_limit"`
	CountsError         string `json:"counts_error,omitempty"`
	// Flags: what needs attention. Empty when all is well.
	Flags []Flag `json:"flags"`
}

// FlagKind says what a Flag is about.
type FlagKind string

// Values of FlagKind.
const (
	// FlagMissing: a queue (Flag.Role delay, parking, poison or work) or the
	// delayed-exchange backend's exchange (Role "exchange") does not exist: not
	// applied yet, or deleted; or (Role "plugin") the broker cannot run the
	// rabbitmq_delayed_message_exchange plugin that backend needs (RabbitMQ 4.3+).
	FlagMissing FlagKind = "missing"
	// FlagStuck: dead lettering out of a delay queue has stalled: its head is
	// Flag.Late past its due time, or Flag.Count expired messages waiting to be
	// dead-lettered did not move between two samples (does the work queue refuse
	// publishes: x-max-length with reject-publish?).
	FlagStuck FlagKind = "stuck"
	// FlagParkingQueue: Flag.Count retries wait in the parking queue: their work queue
	// was gone when they came due. Re-create it, then redrive them. Its value stays
	// "parked" (the JSON of Status).
	FlagParkingQueue FlagKind = "parked"
	// FlagConsumed: a delay queue has Flag.Count consumers: a delivered message never
	// expires.
	FlagConsumed FlagKind = "consumed"
	// FlagUnderReplicated: a quorum queue has Flag.Count of its Flag.Limit members
	// online: a node is down or its member has not started. It works while a majority
	// is online, and stalls (nothing lost) without one.
	FlagUnderReplicated FlagKind = "under-replicated"
	// FlagQueueType: a work queue is of type Flag.QueueType ("classic", or "not
	// quorum" when only the broker's counts tell) where delayed retries (Backend delayed-retry,
	// delay.HeldRetries) need a quorum queue: the broker redelivers its nacked messages at
	// once. A queue's type cannot change: move to a new quorum queue, or use a copying
	// backend.
	FlagQueueType FlagKind = "queue-type"
	// FlagNearLimit: the broker uses Flag.Count of its Flag.Limit file descriptors
	// (Name "file_descriptors") or sockets (Name "sockets"), 80% or more: past the
	// limit every new connection hangs in its handshake (on RabbitMQ 3.x each quorum
	// queue uses 3 of them).
	FlagNearLimit FlagKind = "near-limit"
)

// Flag is one thing Status found that needs attention.
type Flag struct {
	Kind FlagKind `json:"kind"`
	// Name is the queue, exchange or plugin flagged; for FlagNearLimit
	// "file_descriptors" or "sockets".
	Name string `json:"name"`
	// Role of the queue (QueueStatus.Role), or "exchange" or "plugin".
	Role string `json:"role,omitempty"`
	// Count: the messages in the parking queue, the consumers, the messages stuck waiting to be
	// dead-lettered, the members online, or the file descriptors or sockets used.
	Count int `json:"count,omitempty"`
	// Limit: the broker's limit (FlagNearLimit), or the queue's members
	// (FlagUnderReplicated).
	Limit int `json:"limit,omitempty"`
	// Late: how far past its due time a stuck delay queue's head is.
	Late time.Duration `json:"late_ns,omitempty"`
	// Interval: how long a stuck delay queue's expired messages did not shrink.
	Interval time.Duration `json:"interval_ns,omitempty"`
	// QueueType: the type of a work queue flagged FlagQueueType.
	QueueType string `json:"queue_type,omitempty"`
	// Fix is how to repair it, when the usual fix (Apply) cannot: for FlagQueueType,
	// how to move to a quorum queue, as a queue's type cannot change.
	Fix string `json:"fix,omitempty"`
}

// Status reports the depth and the age of the oldest message of every delay queue, of
// the parking queue, the poison queue and opts.WorkQueues, the broker's version, and
// flags what needs attention. It changes nothing (see the package documentation for
// how a head is peeked). It fails only when it cannot look at all.
func (o *Ops) Status(ctx context.Context, opts StatusOptions) (Status, error) {
	if opts.StuckMargin <= 0 {
		opts.StuckMargin = defaultStuckMargin
	}
	if opts.SampleInterval <= 0 {
		opts.SampleInterval = defaultSampleInterval
	}
	switch opts.Peek {
	case "":
		opts.Peek = "auto"
	case "auto", "always", "never":
	default:
		return Status{}, fmt.Errorf("status: invalid options: Peek: unknown mode %q (known: auto, always, never)", opts.Peek)
	}
	v := o.handoff.Version()
	s := Status{Broker: v, Backend: o.retry.Backend.Name(), Prefix: o.retry.Prefix, Queues: []QueueStatus{}, Flags: []Flag{},
		Warning: version.Warning(v), NacksCounted: version.CountsNacks(v)}
	flag := func(f Flag) { s.Flags = append(s.Flags, f) }

	var pluginErr error
	if sealed, ok := o.backend.(backend.Sealed); ok {
		x := sealed.SealedIn()
		gate, gated := o.backend.(backend.VersionGate)
		runs := !gated || gate.CheckVersion(v) == nil
		if !runs {
			name, role := sealed.Requirement()
			flag(Flag{Kind: FlagMissing, Name: name, Role: role})
		}
		// Only the backend's own exchange tells: its passive declaration.
		s.DelayedExchangeName = x.Name
		ok, err := o.exchangeExists(x.Name, x.Kind)
		if err != nil {
			return s, err
		}
		s.DelayedExchange = ok
		if !ok && runs {
			flag(Flag{Kind: FlagMissing, Name: x.Name, Role: "exchange"})
		}
		if ok && o.ctl != nil {
			n, err := o.sealedWaitingIn(ctx, sealed, x.Name)
			pluginErr = err
			s.PluginCounted, s.PluginWaiting = err == nil, n
		}
	}

	samples, err := o.sample(ctx, opts, &s)
	if err != nil {
		if ctx.Err() != nil {
			return s, ctx.Err()
		}
		s.CountsError = o.redact(err).Error()
	}
	if pluginErr != nil {
		s.CountsError = strings.TrimPrefix(s.CountsError+"; ", "; ") + o.redact(pluginErr).Error()
	}
	waiting, old, err := o.statusWaiting(ctx, opts)
	if err != nil {
		if ctx.Err() != nil {
			return s, ctx.Err()
		}
		// Reported as the counts are: Status still shows what AMQP does.
		s.CountsError = strings.TrimPrefix(s.CountsError+"; ", "; ") + "waiting retries: " + o.redact(err).Error()
	}
	// A returned delay-queue message may go behind the others (quorum queues: see
	// readAll), where it expires late: only "always" peeks a delay queue.
	peekDelay := opts.Peek == "always"
	for _, dq := range o.backend.DelayQueues() {
		if err := ctx.Err(); err != nil {
			return s, err
		}
		qs := QueueStatus{Name: dq.Name, Role: "delay", TTL: dq.TTL}
		if err := o.queueStatus(&qs, peekDelay, opts); err != nil {
			return s, err
		}
		tally(&qs, waiting, func(m Message) bool { return m.DelayQueue == qs.Name }, opts.StuckMargin)
		if b, ok := samples[dq.Name]; ok {
			count(&qs, b.now)
			qs.Expired = b.now.aside()
			qs.Stuck = qs.Stuck || b.stuck
		}
		switch {
		case !qs.Exists:
			flag(Flag{Kind: FlagMissing, Name: qs.Name, Role: qs.Role})
		case qs.Stuck && samples[dq.Name].stuck:
			flag(Flag{Kind: FlagStuck, Name: qs.Name, Role: qs.Role, Count: qs.Expired, Interval: opts.SampleInterval})
		case qs.Stuck:
			flag(Flag{Kind: FlagStuck, Name: qs.Name, Role: qs.Role, Late: time.Since(qs.HeadDue)})
		}
		if qs.Consumers > 0 {
			flag(Flag{Kind: FlagConsumed, Name: qs.Name, Role: qs.Role, Count: qs.Consumers})
		}
		underReplicated(qs, flag)
		s.Queues = append(s.Queues, qs)
	}
	for _, name := range old {
		qs := QueueStatus{Name: name, Role: "delay", Old: true}
		if err := o.queueStatus(&qs, false, opts); err != nil {
			return s, err
		}
		tally(&qs, waiting, func(m Message) bool { return m.DelayQueue == qs.Name }, opts.StuckMargin)
		if b, ok := samples[name]; ok {
			count(&qs, b.now)
			qs.Expired = b.now.aside()
		}
		s.Queues = append(s.Queues, qs)
	}
	var others []QueueStatus
	if o.parking {
		others = append(others, QueueStatus{Name: o.names.Parking(), Role: "parking"})
	}
	others = append(others, QueueStatus{Name: o.retry.PoisonQueue, Role: "poison"})
	for _, q := range opts.WorkQueues {
		others = append(others, QueueStatus{Name: q, Role: "work"})
	}
	for _, qs := range others {
		if err := ctx.Err(); err != nil {
			return s, err
		}
		peek := opts.Peek != "never" && qs.Role != "work"
		if err := o.queueStatus(&qs, peek, opts); err != nil {
			return s, err
		}
		if b, ok := samples[qs.Name]; ok {
			count(&qs, b.now)
			if qs.Role == "work" {
				qs.Held = b.now.aside()
				if b.still {
					qs.Stalled = opts.SampleInterval
				}
			}
		}
		if qs.Role == "work" {
			tally(&qs, waiting, func(m Message) bool { return m.Queue == qs.Name }, opts.StuckMargin)
		}
		switch {
		case !qs.Exists:
			flag(Flag{Kind: FlagMissing, Name: qs.Name, Role: qs.Role})
		case qs.Role == "parking" && qs.Ready > 0:
			flag(Flag{Kind: FlagParkingQueue, Name: qs.Name, Role: qs.Role, Count: qs.Ready})
		case qs.Role == "work" && o.holdsRetries():
			t, err := o.workQueueType(qs)
			if err != nil {
				return s, err
			}
			if t != "" && t != declare.QueueTypeQuorum {
				flag(Flag{Kind: FlagQueueType, Name: qs.Name, Role: qs.Role, QueueType: t, Fix: declare.WrongQueueTypeFix(qs.Name, t)})
			}
		}
		underReplicated(qs, flag)
		s.Queues = append(s.Queues, qs)
	}
	for _, r := range []struct {
		name        string
		used, limit int
	}{{"file_descriptors", s.FileDescriptors, s.FileDescriptorLimit}, {"sockets", s.Sockets, s.SocketLimit}} {
		if r.limit > 0 && r.used*100 >= r.limit*nearLimitPercent {
			flag(Flag{Kind: FlagNearLimit, Name: r.name, Count: r.used, Limit: r.limit})
		}
	}
	return s, nil
}

// workQueueType is the type of work queue qs, which exists, or "" when unknown: over
// AMQP (a declaration with x-queue-type quorum, which needs configure permission and
// changes nothing), else from the broker's counts (only quorum queues have members).
func (o *Ops) workQueueType(qs QueueStatus) (string, error) {
	t, known, err := declare.QueueType(o.conn, qs.Name)
	switch {
	case err != nil:
		return "", fmt.Errorf("status: type of work queue %q: %w", qs.Name, o.redact(err))
	case known:
		return t, nil
	case qs.Counted && qs.Members == 0:
		return declare.NotQuorum, nil
	}
	return "", nil
}

// tally counts in qs the waiting retries that match (none read: waiting is nil).
func tally(qs *QueueStatus, waiting []Message, match func(Message) bool, margin time.Duration) {
	if waiting == nil {
		return
	}
	qs.WaitingRead = true
	now := time.Now()
	for _, m := range waiting {
		if !match(m) {
			continue
		}
		d := due(m)
		qs.Waiting++
		if qs.NextDue.IsZero() || d.Before(qs.NextDue) {
			qs.NextDue = d
		}
		if d.After(qs.LastDue) {
			qs.LastDue = d
		}
		if now.Sub(d) > margin {
			qs.Overdue++
		}
	}
}

// underReplicated flags qs if fewer of its members are online than it has.
func underReplicated(qs QueueStatus, flag func(Flag)) {
	if qs.Exists && qs.Online < qs.Members {
		flag(Flag{Kind: FlagUnderReplicated, Name: qs.Name, Role: qs.Role, Count: qs.Online, Limit: qs.Members})
	}
}

// queueCounts are one queue's counts in a BrokerCounts.
type queueCounts struct{ messages, ready, unacked, members, online int }

// aside is what the queue counts beyond ready and unacked messages.
func (c queueCounts) aside() int { return max(c.messages-c.ready-c.unacked, 0) }

func count(qs *QueueStatus, c queueCounts) {
	qs.Counted, qs.Messages, qs.Unacked = true, c.messages, c.unacked
	qs.Members, qs.Online = c.members, c.online
}

// twoSamples is one queue's counts over two samples.
type twoSamples struct {
	now   queueCounts
	stuck bool // set aside at the first sample, and no fewer at the second
	still bool // a work queue with unacked and ready messages whose counts did not move
}

// mayStall tells a work queue's counts that may show a stall: deliveries unacked, and
// more ready that its consumers do not take.
func (c queueCounts) mayStall() bool { return c.unacked > 0 && c.ready > 0 }

// sample reads opts.Counts, and again after SampleInterval when a delay queue keeps
// expired messages for dead lettering; it fills the resource use of s.
func (o *Ops) sample(ctx context.Context, opts StatusOptions, s *Status) (map[string]twoSamples, error) {
	if opts.Counts == nil {
		return nil, nil
	}
	first, err := opts.Counts(ctx)
	if err != nil {
		return nil, err
	}
	s.Counted = true
	s.FileDescriptors, s.FileDescriptorLimit = first.FileDescriptors, first.FileDescriptorLimit
	s.Sockets, s.SocketLimit = first.Sockets, first.SocketLimit
	out := map[string]twoSamples{}
	for _, names := range []map[string]int{first.Messages, first.Members} {
		for name := range names {
			out[name] = twoSamples{now: countsOf(first, name)}
		}
	}
	again := false
	for _, dq := range o.backend.DelayQueues() {
		again = again || out[dq.Name].now.aside() > 0
	}
	for _, q := range opts.WorkQueues {
		again = again || out[q].now.mayStall()
	}
	if !again {
		return out, nil
	}
	t := time.NewTimer(opts.SampleInterval)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-t.C:
	}
	second, err := opts.Counts(ctx)
	if err != nil {
		return nil, err
	}
	for _, dq := range o.backend.DelayQueues() {
		if _, ok := second.Messages[dq.Name]; !ok {
			continue
		}
		before, now := out[dq.Name].now.aside(), countsOf(second, dq.Name)
		out[dq.Name] = twoSamples{now: now, stuck: before > 0 && now.aside() >= before}
	}
	for _, q := range opts.WorkQueues {
		if _, ok := second.Messages[q]; !ok {
			continue
		}
		before, now := out[q].now, countsOf(second, q)
		out[q] = twoSamples{now: now, still: before.mayStall() && now == before}
	}
	return out, nil
}

func countsOf(c BrokerCounts, queue string) queueCounts {
	return queueCounts{messages: c.Messages[queue], ready: c.Ready[queue], unacked: c.Unacked[queue],
		members: c.Members[queue], online: c.Online[queue]}
}

// queueStatus fills qs: depth, consumers, and (if peek) the age of its oldest message.
func (o *Ops) queueStatus(qs *QueueStatus, peek bool, opts StatusOptions) error {
	q, exists, err := o.inspect(qs.Name)
	if err != nil {
		return err
	}
	qs.Exists, qs.Ready, qs.Consumers = exists, q.Messages, q.Consumers
	if !exists || q.Messages == 0 || !peek {
		return nil
	}
	if qs.Role == "delay" {
		return o.peekHead(qs, q.Messages, opts)
	}
	return o.readAll(qs, q.Messages)
}

// peekHead reads the head of a delay queue: one basic.get, one basic.nack(requeue) on
// a channel of its own (see the package documentation: Peek "always" only).
func (o *Ops) peekHead(qs *QueueStatus, ready int, opts StatusOptions) error {
	ch, err := o.channel()
	if err != nil {
		return err
	}
	d, ok, err := ch.Get(qs.Name, false)
	if err != nil {
		_ = ch.Close()
		return fmt.Errorf("peek queue %q: %w", qs.Name, o.redact(err))
	}
	if !ok { // emptied meanwhile
		return ch.Close()
	}
	nackErr := ch.Nack(d.DeliveryTag, false, true)
	_ = ch.Close()
	if nackErr != nil {
		return fmt.Errorf("give back the head of queue %q: %w", qs.Name, o.redact(nackErr))
	}
	o.settle(qs.Name, ready)
	qs.Peeked = true
	if n, ok := wire.Integer(d.Headers[keys.XDeliveryCount]); ok {
		qs.HeadDeliveryCount = n
	}
	due, ok := headerTime(d.Headers, keys.Due)
	if !ok {
		return nil // scheduled without a due time: age unknown
	}
	now := time.Now()
	effective, _ := time.ParseDuration(headerString(d.Headers, keys.EffectiveDelay))
	qs.HeadDue = due
	qs.OldestAge, qs.AgeKnown = now.Sub(due.Add(-effective)), true
	qs.Stuck = now.Sub(due) > opts.StuckMargin
	return nil
}

// readLimit is the most messages Status reads from a parking or poison queue to find
// its oldest: past it the age is unknown.
const readLimit = 1000

// readAll finds the oldest message of a parking or poison queue (the earliest due
// time, or last failure, else AMQP timestamp) by taking every message and giving all
// of them back at once, which keeps their order: a quorum queue puts a message it
// gets back behind the others (RabbitMQ 3.10.8 at every return, 4.3.6 from the second
// one: measured), so giving back its head alone would move it to the end.
func (o *Ops) readAll(qs *QueueStatus, ready int) error {
	if ready > readLimit {
		return nil
	}
	sc, err := o.newScan(qs.Name, ready+1)
	if err != nil {
		return err
	}
	defer sc.close()
	now := time.Now()
	for first := true; ; first = false {
		d, ok, err := sc.next()
		if err != nil || !ok {
			return err
		}
		sc.keep(d)
		qs.Peeked = true
		if first {
			qs.HeadDue, _ = headerTime(d.Headers, keys.Due)
			if n, ok := wire.Integer(d.Headers[keys.XDeliveryCount]); ok {
				qs.HeadDeliveryCount = n
			}
		}
		key := keys.LastFailure
		if qs.Role == "parking" {
			key = keys.Due
		}
		t, ok := headerTime(d.Headers, key)
		if !ok {
			t = d.Timestamp
		}
		if !t.IsZero() && (!qs.AgeKnown || now.Sub(t) > qs.OldestAge) {
			qs.OldestAge, qs.AgeKnown = now.Sub(t), true
		}
	}
}

func headerString(h amqp.Table, key string) string {
	s, _ := h[key].(string)
	return s
}

func headerTime(h amqp.Table, key string) (time.Time, bool) {
	t, err := time.Parse(time.RFC3339Nano, headerString(h, key))
	return t, err == nil
}

// statusWaiting reads the waiting retries (nil when it cannot without changing them:
// no Config.Rabbitmqctl, or Peek "never") and the delay queues under the prefix that
// are not the configured backend's (old).
func (o *Ops) statusWaiting(ctx context.Context, opts StatusOptions) (waiting []Message, old []string, err error) {
	if o.ctl == nil || opts.Peek == "never" {
		return nil, nil, nil
	}
	queues, msgs, err := o.peekAll(ctx, readLimit)
	if err != nil {
		return nil, nil, err
	}
	waiting = append([]Message{}, msgs...)
	for _, q := range queues {
		if !slices.ContainsFunc(o.backend.DelayQueues(), func(dq backend.DelayQueue) bool { return dq.Name == q }) {
			old = append(old, q)
		}
	}
	if o.holdsRetries() {
		for _, q := range opts.WorkQueues {
			held, err := o.peekDelayed(ctx, q)
			if err != nil {
				continue // missing, or not a quorum queue of 4.3: flagged elsewhere
			}
			waiting = append(waiting, held...)
		}
	}
	return waiting, old, nil
}
