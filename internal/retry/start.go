package retry

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/handoff"
	"github.com/amqpretry/amqpretry/internal/marshal"
	"github.com/amqpretry/amqpretry/internal/redact"
	"github.com/amqpretry/amqpretry/internal/schedule"
	"github.com/amqpretry/amqpretry/internal/version"
	"github.com/amqpretry/amqpretry/internal/wire"
	"github.com/amqpretry/amqpretry/topology"
)

// Conn is how a Retry reaches the broker, read from the subscriber config.
type Conn struct {
	// URI of the broker; "" runs in-process (the memory backend only).
	URI  string
	AMQP amqp.Config
	// Marshal are the options of the subscriber's marshaler, so that copies carry
	// the UUID where the subscriber reads it.
	Marshal marshal.Options
	// QueueArgs are the arguments the subscriber declares its queues with.
	QueueArgs amqp.Table
	// Queue maps a topic to its queue. Default: the topic.
	Queue func(topic string) string
	// Redeliver is the AMQP 1.0 transport's settlement with a delivery time, for the
	// delivery-time backend (nil on 0-9-1).
	Redeliver func(msg *message.Message, at time.Time, annotations map[string]any) error
}

// Retry is a started retry: the engine, the hand-off it publishes through, and what
// its subscriber config needs.
type Retry struct {
	*Engine
	cfg     amqpretry.Config
	conn    Conn
	handoff *handoff.Handoff // nil in-process
	id      string

	mu    sync.Mutex
	bound map[string]bool // queues whose way back a subscriber of this Retry declared
}

// Start builds a Retry from cfg, valid and with its defaults, and conn: it connects
// (unless in-process), refuses a backend the broker cannot run, declares (or checks)
// the poison queue and the backend's topology, and logs what could lose retries.
func Start(cfg amqpretry.Config, conn Conn) (*Retry, error) {
	if conn.Queue == nil {
		conn.Queue = func(topic string) string { return topic }
	}
	r := &Retry{cfg: cfg, conn: conn}
	e := &Engine{cfg: cfg, wiring: Wiring{Queue: conn.Queue}}
	r.Engine = e
	spec := backend.Spec{Name: cfg.Backend, Prefix: cfg.Prefix, Tiers: cfg.Tiers, Levels: cfg.Levels, RetryDelay: cfg.DelayedRetryDelay}
	if conn.URI == "" {
		b, err := backend.New(spec, backend.Env{Memory: cfg.Memory, Logger: cfg.Logger})
		if err != nil {
			return nil, fmt.Errorf("invalid config: %w", err)
		}
		e.backend = b
		e.poisonQ = func(_ context.Context, msg *message.Message) error { return cfg.Memory.Publish(cfg.PoisonQueue, msg) }
		r.logReady()
		return r, nil
	}
	r.id = watermill.NewShortUUID()
	e.wiring.ID, e.wiring.Bound = r.id, r.isBound
	h, err := handoff.Dial(handoff.Config{URI: conn.URI, AMQP: conn.AMQP, ConfirmTimeout: cfg.ConfirmTimeout,
		Marshal: conn.Marshal, Topology: cfg.Topology, Logger: cfg.Logger})
	if err != nil {
		return nil, err
	}
	r.handoff = h
	if err := r.start(spec); err != nil {
		return nil, errors.Join(err, r.Close())
	}
	r.logReady()
	return r, nil
}

func (r *Retry) start(spec backend.Spec) error {
	cfg, e, v := r.cfg, r.Engine, r.handoff.Version()
	if cfg.HeldRetries > 0 && !version.DelayedRetry(v) {
		return backend.UnsupportedError(delay.DelayedRetry, v)
	}
	b, err := backend.New(spec, backend.Env{Handoff: r.handoff, Memory: cfg.Memory, Redeliver: r.conn.Redeliver, Logger: cfg.Logger})
	if err != nil {
		return fmt.Errorf("invalid config: %w", err)
	}
	// The backend first: a broker that cannot run it is refused before anything is
	// declared.
	if cfg.Backend != delay.Memory {
		if err := backend.Prepare(b, r.handoff, cfg.Topology); err != nil {
			return r.Hint(err, "")
		}
	}
	if err := r.handoff.Ensure(cfg.Topology, topology.Topology{Queues: []topology.Queue{declare.HoldingQueue(cfg.PoisonQueue, "poison")}}); err != nil {
		return fmt.Errorf("poison queue (topology mode %s): %w", cfg.Topology, r.Hint(err, ""))
	}
	switch _, inPlace := b.(backend.InPlace); {
	case inPlace:
		// Every retry stays in the work queue: no way back to bind.
		e.inPlace, e.wiring.Bound = b, nil
	case cfg.HeldRetries > 0:
		held, err := backend.New(backend.Spec{Name: delay.DelayedRetry, RetryDelay: cfg.DelayedRetryDelay}, backend.Env{})
		if err != nil {
			return fmt.Errorf("invalid config: %w", err)
		}
		e.backend, e.inPlace = b, held
	default:
		e.backend = b
	}
	e.poisonQ = func(ctx context.Context, msg *message.Message) error {
		return r.handoff.ToQueue(ctx, cfg.PoisonQueue, msg)
	}
	e.poisonHint = r.poisonHint
	fields := watermill.LogFields{"rabbitmq_version": v, "delay_backend": cfg.Backend}
	if w := version.Warning(v); w != "" {
		cfg.Logger.Error("RabbitMQ version loses retries", errors.New(w), fields)
	}
	if w := workQueueWarning(v, r.conn.QueueArgs, cfg.Policy.MaxAttempts); w != "" {
		cfg.Logger.Error("Work queues may lose retries", errors.New(w), fields)
	}
	if cfg.Backend == delay.DelayedExchange {
		cfg.Logger.Error("The delayed-exchange backend may lose retries that come due while the broker stops (the plugin routes them fire-and-forget); ttl-tiers and binary-levels do not",
			errors.New("retries due while the broker stops may be lost"), fields)
	}
	return nil
}

// logReady logs, once at start, the policy in effect (defaults applied): attempts,
// schedule, the longest delay it can ask for, and the backend's limits; and, at INFO,
// when that delay is longer than ttl-tiers holds.
func (r *Retry) logReady() {
	cfg, e := r.cfg, r.Engine
	p := schedule.Policy(cfg.Policy)
	longest, _ := p.Longest(p.Retries(cfg.Policy.Immediate + cfg.HeldRetries))
	fields := watermill.LogFields{
		"delay_backend": cfg.Backend, "held_retries": cfg.HeldRetries, "poison_queue": cfg.PoisonQueue,
		"max_attempts": cfg.Policy.MaxAttempts, "schedule": p.String(), "longest_delay": longest.String(),
	}
	if r.conn.URI != "" {
		fields["amqp_uri"] = redact.URI(r.conn.URI)
	}
	var lim backend.Limits
	switch {
	case e.backend != nil:
		lim = backend.LimitsOf(e.backend)
	case e.inPlace != nil:
		lim = backend.LimitsOf(e.inPlace)
	}
	fields["backend_limits"] = lim.Text
	if cfg.HeldRetries > 0 {
		fields["schedule"] = fmt.Sprintf("%d retries held in the work queue %s apart, then %s", cfg.HeldRetries, cfg.DelayedRetryDelay, p.String())
	}
	if cfg.Backend == delay.DelayedRetry {
		fields["schedule"] = fmt.Sprintf("every retry held in the work queue %s (DelayedRetryDelay)", cfg.DelayedRetryDelay)
		fields["longest_delay"] = cfg.DelayedRetryDelay.String()
	}
	cfg.Logger.Info("Broker-side retry ready", fields)
	if e.backend != nil && lim.Longest > 0 && !lim.Refuses && longest > lim.Longest {
		cfg.Logger.Info("The policy's longest delay is longer than the backend holds; those retries come back early", watermill.LogFields{
			"delay_backend": cfg.Backend, "policy_longest_delay": longest.String(), "effective_delay": lim.Longest.String(),
		})
	}
}

// ID identifies this Retry's deliveries (keys.Subscriber); "" in-process.
func (r *Retry) ID() string { return r.id }

// Config is the configuration, with its defaults.
func (r *Retry) Config() amqpretry.Config { return r.cfg }

// InProcess tells whether the retry runs without a broker.
func (r *Retry) InProcess() bool { return r.handoff == nil }

// SubscriberMarshal returns the options of the subscriber's marshaler: the user's,
// with what this Retry needs to read on each delivery.
func (r *Retry) SubscriberMarshal() marshal.Options {
	o := r.conn.Marshal
	o.Retry, o.Subscriber = true, r.id
	o.ReturnedAttempts = r.holdsRetries()
	return o
}

// holdsRetries tells whether work queues hold retries (delayed retry).
func (r *Retry) holdsRetries() bool {
	return backend.HoldsRetries(r.cfg.Backend, r.cfg.HeldRetries)
}

// WorkQueueArgs returns args with what a work queue needs added (a quorum queue that
// holds returned deliveries, with delayed retries), as a new table; args itself when
// it needs nothing.
func (r *Retry) WorkQueueArgs(args amqp.Table) amqp.Table {
	if !r.holdsRetries() {
		return args
	}
	out := amqp.Table{}
	for k, v := range args {
		out[k] = v
	}
	for k, v := range backend.WorkQueueArgs(r.cfg.DelayedRetryDelay) {
		out[k] = v
	}
	return out
}

// BindWorkQueue gives queue its way back, on ch, as the topology mode says (declare,
// check, nothing), and records that it did: called by the subscriber's topology
// builder on every subscribe and reconnect.
func (r *Retry) BindWorkQueue(ch *amqp.Channel, queue string) error {
	if err := r.checkWorkQueueType(queue); err != nil {
		return err
	}
	if r.Engine.backend != nil {
		if err := declare.Ensure(ch, r.cfg.Topology, r.Engine.backend.WorkQueue(queue)); err != nil {
			return fmt.Errorf("retry topology for queue %q: %w", queue, r.Hint(err, queue))
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.bound == nil {
		r.bound = map[string]bool{}
	}
	r.bound[queue] = true
	return nil
}

// checkWorkQueueType refuses, in topology mode verify with delayed retries, a work
// queue that exists as another type than quorum: its passive declaration passed, but
// the broker would redeliver every nack at once. Mode declare has declared it with the
// arguments already (a clash fails there, see Hint); without configure permission the
// type cannot be read over AMQP, and the engine notices at the first retry instead.
func (r *Retry) checkWorkQueueType(queue string) error {
	if r.cfg.Topology != topology.ModeVerify || !r.holdsRetries() || r.handoff == nil {
		return nil
	}
	conn, err := r.handoff.Connection()
	if err != nil {
		return fmt.Errorf("check the type of work queue %q: %w", queue, err)
	}
	t, known, err := declare.QueueType(conn, queue)
	switch {
	case err != nil:
		return fmt.Errorf("check the type of work queue %q: %w", queue, err)
	case known && t != declare.QueueTypeQuorum:
		return fmt.Errorf("%s: %w", declare.WrongQueueTypeFix(queue, t), topology.ErrMismatch)
	}
	return nil
}

func (r *Retry) isBound(queue string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.bound[queue]
}

// ApplyCommand is the `amqpretry topology apply` command that creates what this
// Retry needs, for the queues given.
func (r *Retry) ApplyCommand(queues ...string) string {
	c := r.cfg
	return backend.ApplyCommand(backend.Spec{Name: c.Backend, Prefix: c.Prefix, Tiers: c.Tiers, Levels: c.Levels, RetryDelay: c.DelayedRetryDelay},
		c.PoisonQueue, c.HeldRetries, c.DelayedRetryDelay, queues...)
}

// Scheduler is a message.Publisher that schedules a delayed message to a queue
// through the backend, from Watermill's delay metadata; nil for delayed-retry alone.
func (r *Retry) Scheduler() message.Publisher {
	if r.Engine.backend == nil {
		return nil
	}
	return backend.Scheduler{Backend: r.Engine.backend}
}

// Close stops the Retry: from then on the middleware hands nothing off and opens
// nothing (a message that fails is nacked for redelivery, paced, and the first one is
// logged at WARN); it waits for the hand-offs in flight, closes the backend and the
// hand-off connection, and logs what the Retry did since it started. Close the router
// first. A second Close does nothing.
func (r *Retry) Close() error {
	waited, first := r.Engine.life.close()
	if !first {
		return nil
	}
	var errs []error
	if r.Engine.backend != nil {
		errs = append(errs, r.Engine.backend.Close())
	}
	if r.handoff != nil {
		errs = append(errs, r.handoff.Close())
	}
	err := errors.Join(errs...)
	st := r.Stats()
	fields := watermill.LogFields{
		"retries": st.Retries, "poisoned": st.Poisoned, "handoff_failures": st.HandoffFailures,
		"handoffs_waited_for": waited, "poison_pending": st.PoisonPending,
	}
	if err != nil {
		fields["close_err"] = err.Error()
	}
	r.cfg.Logger.Info("Broker-side retry closed", fields)
	return err
}

// Forgotten is for a finalizer of the transport's Retry: one dropped without Close
// logs it at WARN and closes its hand-off connection, which would leak otherwise.
func (r *Retry) Forgotten() {
	if r.Engine.life.isClosed() {
		return
	}
	warn(r.cfg.Logger, "Retry garbage-collected without Close: closing its hand-off connection now",
		errors.New("Retry.Close was never called: call it once the router has stopped (defer retry.Close() before creating the router)"),
		watermill.LogFields{"delay_backend": r.cfg.Backend, "amqp_uri": redact.URI(r.conn.URI)})
	go func() { _ = r.Close() }()
}

// poisonHint adds the fix to the error of a failed poison publish: for a poison queue
// that does not exist, the command that creates it.
func (r *Retry) poisonHint(err error, gone bool) error {
	if !gone {
		return err
	}
	how := "topology mode " + string(r.cfg.Topology) + " does not declare it"
	if r.cfg.Topology == topology.ModeDeclare {
		how = "declaring it again failed"
	}
	return fmt.Errorf("%w; poison queue %q does not exist (%s): create it with `%s` as a user with configure permission; until then the message stays in its work queue and only its poisoning is retried", err, r.cfg.PoisonQueue, how, r.ApplyCommand())
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

// Hint adds the fix to an error of the topology checks: the command that creates what
// is missing (with queue, when there is one); for a work queue that exists without the
// arguments delayed retries need, how to give them; for a user refused the configure
// permission in topology mode declare, the least-privilege mode.
func (r *Retry) Hint(err error, queue string) error {
	var queues []string
	if queue != "" {
		queues = []string{queue}
	}
	if t, ok := declare.QueueTypeClash(err); ok && queue != "" && r.holdsRetries() && t != declare.QueueTypeQuorum {
		return fmt.Errorf("%s: %w (%w)", declare.WrongQueueTypeFix(queue, t), topology.ErrMismatch, err)
	}
	switch {
	case errors.Is(err, topology.ErrMissing):
		return fmt.Errorf("%w; create it with `%s` as a user with configure permission (topology mode %s declares nothing)", err, r.ApplyCommand(queues...), topology.ModeVerify)
	case declare.IsCode(err, amqp.PreconditionFailed) && r.holdsRetries() && queue != "" && strings.Contains(err.Error(), "x-delayed-retry"):
		ms := r.cfg.DelayedRetryDelay.Milliseconds()
		return fmt.Errorf("%w; work queue %q exists without the arguments delayed retries need: delete it and let the library declare it again, or apply a policy, `rabbitmqctl set_policy amqpretry-delayed-retry '^%s$' '{\"delayed-retry-type\":\"returned\",\"delayed-retry-min\":%d,\"delayed-retry-max\":%d}' --apply-to quorum_queues`, and run with Config.Topology set to topology.ModeVerify so that it is not declared again",
			err, queue, regexp.QuoteMeta(queue), ms, ms)
	case declare.IsCode(err, amqp.PreconditionFailed) && !r.holdsRetries() && queue != "" && strings.Contains(err.Error(), "x-delayed-retry"):
		// Moving off delayed-retry: the queue cannot lose its arguments, and the
		// retries it holds need them until they are back.
		return fmt.Errorf("%w; work queue %q was declared for delayed retries (RabbitMQ 4.3) and may still hold some: do not delete it, keep its arguments: give the subscriber config's Queue.Arguments the x-delayed-retry-* values it was declared with, or run with Config.Topology set to topology.ModeVerify (with %s, a delayed retry of the queue only delays the redelivery of a failed hand-off); see docs/switching-backends.md",
			err, queue, r.cfg.Backend)
	case declare.IsCode(err, amqp.AccessRefused) && r.cfg.Topology == topology.ModeDeclare:
		return fmt.Errorf("%w; a user without configure permission cannot declare: have an administrator run `%s`, then set Config.Topology to topology.ModeVerify", err, r.ApplyCommand(queues...))
	}
	return err
}
