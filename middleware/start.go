package middleware

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/ctxkey"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/handoff"
	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/marshal"
	"github.com/amqpretry/amqpretry/internal/names"
	"github.com/amqpretry/amqpretry/internal/redact"
	"github.com/amqpretry/amqpretry/internal/version"
	"github.com/amqpretry/amqpretry/internal/wire"
	"github.com/amqpretry/amqpretry/topology"
)

// retry is a started Retry: the engine, the hand-off it publishes through, and the
// queues its transport's subscribers bound. Nothing inside points back at the Retry
// that has it, so that a Retry dropped without Close is found by its finalizer.
type retry struct {
	*engine
	cfg     amqpretry.Config
	t       Transport
	view    backend.Derived // what cfg derives
	handoff backend.Handoff // nil in-process
	id      string
}

// start builds a retry from cfg, valid and with its defaults, v what it derives, and t: it connects
// (unless in-process), refuses a backend the broker cannot run, declares (or checks)
// the poison queue and the backend's topology, and logs what could lose retries.
func start(cfg amqpretry.Config, v backend.Derived, t Transport) (*retry, error) {
	if t.Queue == nil {
		t.Queue = func(topic string) string { return topic }
	}
	r := &retry{cfg: cfg, view: v, t: t}
	e := &engine{cfg: cfg, heldRetries: v.HeldRetries, wiring: wiring{Queue: t.Queue}, outages: newOutages(cfg.Outage), dedup: newDedup(cfg), handoffLimit: backend.HandoffLimit(), debug: debugs(cfg.Logger)}
	r.engine = e
	if t.URI == "" {
		b, err := v.Open(backend.Env{Logger: cfg.Logger})
		if err != nil {
			return nil, fmt.Errorf("invalid config: %w", err)
		}
		e.backend = keep(b)
		e.poisonQ = func(_ context.Context, msg *message.Message) error { return v.Local.Publish(cfg.PoisonQueue, msg) }
		if cfg.OrderKey != nil {
			e.order = newOrder(cfg, &memoryLines{})
			e.toQueue = func(_ context.Context, queue string, msg *message.Message) error { return v.Local.Publish(queue, msg) }
		}
		r.logReady()
		return r, nil
	}
	r.id = watermill.NewShortUUID()
	e.wiring.ID, e.wiring.Bound = r.id, &queueSet{}
	e.reads = &marshal.Reads{Refuse: r.refuseUnread}
	h, err := handoff.Dial(backend.HandoffConfig{URI: t.URI, AMQP: t.AMQP, ConfirmTimeout: backend.DefaultConfirmTimeout,
		Marshal:  marshal.Options{MessageUUIDHeaderKey: t.UUIDHeader, NotPersistentDeliveryMode: t.NotPersistent, PostprocessPublishing: t.Postprocess},
		Topology: cfg.Topology, Logger: cfg.Logger})
	if err != nil {
		return nil, err
	}
	r.handoff = h
	r.view.Fix.Conn = h.Connection // a clashing work queue's arguments are read over it
	if err := r.prepare(); err != nil {
		return nil, errors.Join(err, r.close())
	}
	r.logReady()
	return r, nil
}

func (r *retry) prepare() error {
	cfg, e, v := r.cfg, r.engine, r.handoff.Version()
	held := r.view.Held // the first retries, held in the work queue
	if held != nil {
		// Refuses a broker older than 4.3, before anything is declared.
		if err := backend.Prepare(held, r.handoff, cfg.Topology); err != nil {
			if errors.Is(err, delay.ErrUnsupported) {
				return fmt.Errorf("delay.HeldRetries(n): %d: %w; on this broker drop delay.HeldRetries (Backend %s then takes every retry), or move to RabbitMQ 4.3 or later", r.view.HeldRetries, err, cfg.Backend.Name())
			}
			return err
		}
	}
	if err := r.checkPoisonQueue(); err != nil {
		return err
	}
	b, err := r.view.Open(backend.Env{Handoff: r.handoff, Redeliver: r.t.Redeliver, Logger: cfg.Logger})
	if err != nil {
		return fmt.Errorf("invalid config: %w", err)
	}
	// The backend first: a broker that cannot run it is refused before anything is
	// declared.
	if err := backend.Prepare(b, r.handoff, cfg.Topology); err != nil {
		if errors.Is(err, delay.ErrUnsupported) {
			return fmt.Errorf("Backend: %w; on this broker set Backend to a copying backend, or move to RabbitMQ 4.3 or later", err)
		}
		return r.view.Fix.Hint(err, "")
	}
	if err := r.handoff.Ensure(cfg.Topology, topology.Topology{Queues: []topology.Queue{declare.ReviewQueue(cfg.PoisonQueue, "poison")}}); err != nil {
		return fmt.Errorf("poison queue (topology mode %s): %w", cfg.Topology, r.view.Fix.Hint(err, ""))
	}
	switch {
	case b.Caps().Keeps == backend.KeepsDelivery:
		// Every retry stays in the work queue: no way back to bind.
		e.holder, e.wiring.Bound = keep(b), nil
	default:
		e.backend, e.holder = keep(b), keep(held)
	}
	e.poisonQ = func(ctx context.Context, msg *message.Message) error {
		return r.handoff.ToQueue(ctx, cfg.PoisonQueue, msg)
	}
	e.toQueue = func(ctx context.Context, queue string, msg *message.Message) error {
		return r.handoff.Publish(ctx, "", queue, msg, nil, true, nil)
	}
	if cfg.OrderKey != nil {
		m := marshal.Marshaler{Options: marshal.Options{MessageUUIDHeaderKey: r.t.UUIDHeader, Retry: true}}
		e.order = newOrder(cfg, brokerLines{handoff: r.handoff, names: names.Names{Prefix: cfg.Prefix}, unmarshal: m.Unmarshal})
	}
	e.poisonHint = r.poisonHint
	fields := watermill.LogFields{"rabbitmq_version": v, "delay_backend": cfg.Backend}
	if w := version.Warning(v); w != "" {
		cfg.Logger.Error("RabbitMQ version loses retries", errors.New(w), fields)
	}
	if w := workQueueWarning(v, r.t.QueueArgs, cfg.Policy.MaxAttempts); w != "" {
		cfg.Logger.Error("Work queues may lose retries", errors.New(w), fields)
	}
	// The work queue as the subscriber declares it: with what the backend adds
	// (a quorum queue holding delayed retries).
	workArgs := r.t.QueueArgs
	if extra := r.view.WorkQueueArgs; extra != nil {
		workArgs, _ = backend.MergeWorkQueueArgs(r.t.QueueArgs, extra)
	}
	if w := deadLetterWarning(v, workArgs, cfg.PoisonQueue); w != "" {
		cfg.Logger.Error("Work queues drop what they cannot deliver", errors.New(w), fields)
	}
	if risk := b.Caps().Risk; risk != "" {
		cfg.Logger.Error(risk, errors.New("retries due while the broker stops may be lost"), fields)
	}
	return nil
}

// checkPoisonQueue refuses, in topology mode declare, a poison queue that exists with
// other arguments than a poison queue's: another queue of that name (a work queue,
// say), which New would fail to declare it over, refused before anything is declared.
func (r *retry) checkPoisonQueue() error {
	if r.cfg.Topology != topology.ModeDeclare {
		return nil
	}
	conn, err := r.handoff.Connection()
	if err != nil {
		return nil // the declarations that follow say why
	}
	want := declare.ReviewQueue(r.cfg.PoisonQueue, "poison")
	if o, err := declare.CheckQueue(conn, want, true); err != nil || o.Status != declare.Mismatch {
		return nil
	}
	has := "other arguments"
	if args, ok := declare.QueueArgs(conn, want.Name, nil); ok {
		has = declare.FormatArgs(args)
	}
	return fmt.Errorf("PoisonQueue: %q: %w: a queue of that name exists with %s, where a poison queue has %s, and nothing was declared: "+
		"if it is a work queue, give the poison queue a name of its own (by default %q); if it is a poison queue an earlier version declared, move its messages and delete it",
		want.Name, topology.ErrMismatch, has, declare.FormatArgs(want.Args), names.Names{Prefix: r.cfg.Prefix}.Poison())
}

// logReady logs, once at start, the policy in effect (defaults applied): attempts,
// schedule, the longest delay it can ask for, and the backend's limits; and, at INFO,
// when that delay is longer than the longest tier of ttl-tiers, whose retries are then
// parked again until they are due.
func (r *retry) logReady() {
	cfg, e, longest := r.cfg, r.engine, r.view.Longest
	fields := watermill.LogFields{
		"delay_backend": cfg.Backend, "held_retries": r.view.HeldRetries, "poison_queue": cfg.PoisonQueue,
		"max_attempts": cfg.Policy.MaxAttempts, "schedule": r.view.Schedule, "longest_delay": longest.String(),
	}
	if r.t.URI != "" {
		fields["amqp_uri"] = redact.URI(r.t.URI)
	}
	k := e.backend
	if k == nil {
		k = e.holder
	}
	lim := k.caps
	fields["backend_limits"] = lim.Text
	cfg.Logger.Info("Broker-side retry ready", fields)
	if e.backend != nil && lim.PastLongest == backend.Repark && longest > lim.Longest {
		cfg.Logger.Info("The policy's longest delay is longer than the longest tier; those retries are parked again until they are due", watermill.LogFields{
			"delay_backend": cfg.Backend, "policy_longest_delay": longest.String(), "longest_tier": lim.Longest.String(),
		})
	}
}

// delivered marks msg as delivered by the subscriber of this Retry whose queue-name
// function is number fn (wiring.queue), at attempt (Retry.Delivered).
func (r *retry) delivered(msg *message.Message, attempt, fn int) {
	if r.id != "" {
		msg.Metadata[keys.Subscriber] = mark(r.id, fn)
		// A subscriber's guard not attached yet (marshal.NewGuard) gets this Retry's
		// record of reads.
		if g, ok := msg.Context().Value(ctxkey.Guard{}).(*marshal.Guard); ok {
			g.Attach(r.engine.reads)
		}
	}
	if attempt > 0 {
		msg.Metadata[keys.Attempt] = strconv.Itoa(attempt)
	}
	r.engine.sweep(false)
	r.engine.arrive(msg, true)
}

// scheduler is a message.Publisher that schedules a delayed message to a queue
// through the backend, from Watermill's delay metadata; nil for delayed-retry alone.
func (r *retry) scheduler() message.Publisher {
	if r.engine.backend == nil {
		return nil
	}
	return backend.Scheduler{Backend: r.engine.backend.Backend}
}

// deadLetterWarning checks a quorum work queue's arguments for a dead-letter
// exchange: past its delivery limit (x-delivery-limit, or 20 by default from RabbitMQ
// 4.0) a quorum queue without one drops the message. It gets there without the
// library: a message no client can read (amqp091-go v1.16.0 and later close the
// connection at a header nested deeper than 32 or with more than 8,192 entries,
// the broker gives the message back and counts it) reaches the limit in as many
// reconnections. It returns a warning naming the arguments that send such messages to
// poisonQueue, or "". A policy can set the dead-letter exchange instead; the
// arguments are all the library sees.
func deadLetterWarning(brokerVersion string, args amqp.Table, poisonQueue string) string {
	if args[declare.QueueTypeArg] != declare.QueueTypeQuorum {
		return ""
	}
	if _, set := args[declare.DeadLetterExchangeArg]; set {
		return ""
	}
	var limit string
	raw, set := args[declare.DeliveryLimitArg]
	switch {
	case set:
		n, ok := wire.Integer(raw)
		if !ok || n < 0 {
			return "" // no limit, or one workQueueWarning refuses
		}
		limit = fmt.Sprintf("its %s (%d)", declare.DeliveryLimitArg, n)
	case version.DefaultDeliveryLimit(brokerVersion):
		limit = fmt.Sprintf("the default delivery limit of RabbitMQ 4.0 and later (%d)", version.DeliveryLimit)
	default:
		return ""
	}
	return fmt.Sprintf("quorum work queue without %s: past %s the broker drops a message instead of dead-lettering it, and a message no client can read (amqp091-go v1.16.0 and later close their connection at a header nested deeper than 32) gets there by reconnections alone; declare it with %s \"\" and x-dead-letter-routing-key %q (the poison queue), or set them in a policy",
		declare.DeadLetterExchangeArg, limit, declare.DeadLetterExchangeArg, poisonQueue)
}

// poisonHint adds the fix to the error of a failed poison publish: for a poison queue
// that does not exist, the command that creates it.
func (r *retry) poisonHint(err error, gone bool) error {
	if !gone {
		return err
	}
	how := "topology mode " + string(r.cfg.Topology) + " does not declare it"
	if r.cfg.Topology == topology.ModeDeclare {
		how = "declaring it again failed"
	}
	return fmt.Errorf("%w; poison queue %q does not exist (%s): create it with `%s` as a user with configure permission; until then the message stays in its work queue and only its poisoning is retried", err, r.cfg.PoisonQueue, how, r.cfg.ApplyCommand())
}

// workQueueWarning checks a work queue's arguments against a quorum queue's delivery
// limit, which RabbitMQ before 4.3 applies to basic.nack too (20 by default from 4.0):
// a message whose hand-off fails that many times in a row is dead-lettered or dropped
// by the broker, outside the policy. It returns a warning, or "".
func workQueueWarning(brokerVersion string, args amqp.Table, maxAttempts int) string {
	// RabbitMQ 4.3 counts a requeue apart from the delivery limit: nothing to fear.
	if args[declare.QueueTypeArg] != declare.QueueTypeQuorum || version.DelayedRetry(brokerVersion) {
		return ""
	}
	raw, set := args[declare.DeliveryLimitArg]
	if !set {
		if !version.DefaultDeliveryLimit(brokerVersion) {
			return ""
		}
		return fmt.Sprintf("quorum queue without %s: RabbitMQ %s applies a limit of %d deliveries, so a message whose hand-off fails %d times in a row is dead-lettered or dropped instead of retried; declare %s explicitly (-1 for no limit)",
			declare.DeliveryLimitArg, brokerVersion, version.DeliveryLimit, version.DeliveryLimit, declare.DeliveryLimitArg)
	}
	limit, ok := wire.Integer(raw)
	switch {
	case !ok:
		return fmt.Sprintf("quorum queue with %s %v of type %T: RabbitMQ expects an integer", declare.DeliveryLimitArg, raw, raw)
	case limit >= 0 && limit < int64(maxAttempts):
		return fmt.Sprintf("quorum queue with %s %d, below the policy's %d attempts: when hand-offs fail the broker dead-letters or drops a message after %d deliveries instead of retrying it; raise it to at least %d, or -1 for no limit",
			declare.DeliveryLimitArg, limit, maxAttempts, limit, maxAttempts)
	}
	return ""
}
