package middleware

import (
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wdelay "github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/xdeath"
)

// RetryConfig configures Retry.
type RetryConfig struct {
	// Policy: how many attempts and how long apart. Defaults: see Policy.
	Policy Policy
	// Classify decides, for any error, whether to poison now and whether to override
	// the policy's delay. Default: the error's own marks (Permanent, RetryAfter), which
	// it receives as ClassifyParams.Default.
	Classify func(ClassifyParams) Decision

	// Delay parks the copy of a failed message and brings it back to the queue named by
	// the topic it is published to (a delay.Backend). Required.
	Delay message.Publisher
	// Poison receives messages that failed for good, on PoisonTopic. Required.
	Poison message.Publisher
	// PoisonTopic is the topic (for RabbitMQ, the queue) of poisoned messages. Required.
	PoisonTopic string
	// Queue maps the topic a handler subscribes to onto the queue its messages come
	// from, which is where a retry must come back to (for watermill-amqp,
	// Config.Queue.GenerateName). Default: the topic itself.
	Queue func(topic string) string

	// Subscriber identifies the subscriber configuration whose deliveries this Retry
	// handles: the value its marshaler records under xdeath.SubscriberKey
	// (xdeath.Marshaler.Subscriber). amqpretry sets both. When set, a failed message
	// that another subscriber delivered is left to that subscriber's Retry if its
	// middleware is also on the handler, so several Retry middlewares added router-wide
	// each serve their own group; a message no Retry on the handler owns fails with
	// ErrNotWired. Default: "" (every message is this Retry's).
	Subscriber string
	// CheckQueue, if set, is asked before each retry whether a retry can come back to
	// the queue (for amqpretry: whether this Retry's topology builder bound it). An error
	// fails the message with ErrNotWired instead of parking the retry where nobody
	// looks. Default: nil (no check).
	CheckQueue func(queue string) error
	// HandoffAttempts is how many hand-offs of one message may fail in a row before it
	// goes to the poison topic instead (PoisonHandoffFailed). After each failure the
	// middleware waits (100ms, doubling, at most 5s) before it returns the error that
	// makes the router nack the message, so that a hand-off that keeps failing is never
	// redelivered at wire speed. A poisoning that fails is retried the same way, without
	// limit: only the broker can take the message. Default: 5.
	HandoffAttempts int
	// Observe, if set, is told every delivery, success, retry, poisoning and failed
	// hand-off (see Event), for metrics. It runs on the handler's goroutine: keep it
	// fast. Default: nil.
	Observe func(Event)
	// RetryLogEvery samples the INFO line logged per scheduled retry: 0 or 1 logs every
	// one, N logs one in N, a negative value none. Poisonings and failed hand-offs are
	// always logged. Default: 0.
	RetryLogEvery int

	// Logger. Default: watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *RetryConfig) setDefaults() {
	c.Policy.setDefaults()
	if c.Queue == nil {
		c.Queue = func(topic string) string { return topic }
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
	if c.HandoffAttempts == 0 {
		c.HandoffAttempts = DefaultHandoffAttempts
	}
}

// DefaultHandoffAttempts is RetryConfig.HandoffAttempts's default.
const DefaultHandoffAttempts = 5

// Validate reports every invalid field, each named.
func (c RetryConfig) Validate() error {
	var errs []error
	if err := c.Policy.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("Policy: %w", err))
	}
	if c.Delay == nil {
		errs = append(errs, errors.New("Delay: required"))
	}
	if c.Poison == nil {
		errs = append(errs, errors.New("Poison: required"))
	}
	if c.PoisonTopic == "" {
		errs = append(errs, errors.New("PoisonTopic: required"))
	}
	if c.HandoffAttempts < 0 {
		errs = append(errs, fmt.Errorf("HandoffAttempts: %d is negative", c.HandoffAttempts))
	}

	return errors.Join(errs...)
}

// Retry turns a handler error into a delayed redelivery through the broker.
//
// On an error, Retry hands a copy of the message to the delay publisher with the next
// attempt number in AttemptKey, and returns nil only once the publisher has confirmed the
// copy: the router then acks the original. When attempts run out, or the error is
// permanent, the copy goes to the poison topic with a failure envelope instead. When a
// hand-off fails, Retry returns the handler's error joined with ErrHandoff, the router
// nacks the original and the broker redelivers it (watermill-amqp requeues on nack unless
// Consume.NoRequeueOnNack is set, which must stay false). The incoming message is never
// modified (Retry adds itself to its context, see RetryConfig.Subscriber).
type Retry struct {
	cfg      RetryConfig
	failures failureCounts
	stats    stats
}

// NewRetry validates cfg and returns the middleware.
func NewRetry(cfg RetryConfig) (*Retry, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	return &Retry{cfg: cfg}, nil
}

// Policy returns the policy in force, defaults applied.
func (r *Retry) Policy() Policy { return r.cfg.Policy }

// Attempt returns which attempt this delivery of msg is, from 1 (AttemptKey; a missing
// or unreadable value counts as the first).
func Attempt(msg *message.Message) int {
	n, err := strconv.Atoi(msg.Metadata.Get(AttemptKey))
	if err != nil || n < 1 {
		return 1
	}
	return n
}

// Middleware implements message.HandlerMiddleware.
func (r *Retry) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		if r.cfg.Subscriber != "" {
			joinChain(msg, r.cfg.Subscriber)
		}
		observe := r.cfg.Observe != nil && r.owns(msg)
		if observe {
			r.observeDelivery(msg, r.cfg.Queue(message.SubscribeTopicFromCtx(msg.Context())))
		}
		produced, err := h(msg)
		if err == nil {
			r.failures.forget(msg.UUID)
			if observe {
				r.observe(Event{Kind: EventSucceeded, Queue: r.cfg.Queue(message.SubscribeTopicFromCtx(msg.Context())), Attempt: Attempt(msg)})
			}
			return produced, nil
		}
		return nil, r.handleFailure(msg, err)
	}
}

func (r *Retry) handleFailure(msg *message.Message, err error) error {
	ctx := msg.Context()
	topic := message.SubscribeTopicFromCtx(ctx)
	f := failure{
		err:      err,
		attempt:  Attempt(msg),
		at:       time.Now(),
		handler:  message.HandlerNameFromCtx(ctx),
		topic:    topic,
		queue:    r.cfg.Queue(topic),
		exchange: msg.Metadata.Get(xdeath.DeliveryExchangeKey),
		key:      msg.Metadata.Get(xdeath.DeliveryRoutingKeyKey),
	}
	if errors.Is(err, ErrHandoff) {
		return err // a Retry nearer the handler has dealt with it
	}
	werr := r.checkWiring(msg, f)
	if errors.Is(werr, errOtherRetry) {
		return err // that Retry, also on this handler, decides
	}
	decision := DefaultClassify(err)
	if r.cfg.Classify != nil {
		decision = r.cfg.Classify(ClassifyParams{Err: err, Message: msg, Attempt: f.attempt, Default: decision})
	}

	fields := watermill.LogFields{
		"message_uuid": msg.UUID, "handler": f.handler, "topic": topic, "queue": f.queue,
		"attempt": f.attempt, "max_attempts": r.cfg.Policy.MaxAttempts, "err": err.Error(),
	}
	cp := msg.Copy()
	cp.SetContext(ctx)
	f.record(cp.Metadata)

	switch {
	case werr != nil:
		return r.handoffFailed(err, werr, cp, f, fields, true)
	case decision.Permanent:
		return r.poison(err, cp, f, PoisonPermanent, fields)
	case f.attempt >= r.cfg.Policy.MaxAttempts:
		return r.poison(err, cp, f, PoisonMaxAttempts, fields)
	case f.queue == "":
		return errors.Join(err, fmt.Errorf("%w: no subscribed topic in the message context (is the middleware on a router handler?)", ErrHandoff))
	}
	wait := decision.Delay
	if wait <= 0 {
		wait = r.cfg.Policy.Delay(f.attempt)
	}
	cp.Metadata.Set(AttemptKey, strconv.Itoa(f.attempt+1))
	start := time.Now()
	perr := r.publishRetry(f.queue, cp, wait)
	if errors.Is(perr, delay.ErrTooLarge) {
		trimEnvelope(cp.Metadata)
		perr = r.publishRetry(f.queue, cp, wait)
	}
	switch {
	case perr == nil:
		r.failures.forget(msg.UUID)
		n := r.stats.retries.Add(1)
		requested, effective := cp.Metadata.Get(delay.RequestedDelayKey), cp.Metadata.Get(delay.EffectiveDelayKey)
		if r.cfg.Observe != nil {
			e := Event{Kind: EventRetryScheduled, Queue: f.queue, Attempt: f.attempt, Err: err, Handoff: time.Since(start)}
			e.Requested, _ = time.ParseDuration(requested)
			e.Effective, _ = time.ParseDuration(effective)
			r.observe(e)
		}
		if r.sampled(n) {
			fields["requested_delay"], fields["effective_delay"] = requested, effective
			r.cfg.Logger.Info("Retry scheduled", fields)
		}
		return nil
	case errors.Is(perr, delay.ErrDelayTooLong), errors.Is(perr, delay.ErrTooLarge):
		// Handing it off again would be refused again: poison it, saying why.
		reason, note := PoisonDelayTooLong, perr.Error()
		if errors.Is(perr, delay.ErrTooLarge) {
			// Short: the envelope of this copy is trimmed to fit.
			reason, note = PoisonTooLarge, "retry copy larger than the broker's frame_max even with a trimmed envelope"
			fields["handoff_err"] = perr.Error()
		}
		cp.Metadata.Set(ErrorKey, truncate(note+"; handler error: "+err.Error(), MaxErrorBytes))
		return r.poison(err, cp, f, reason, fields)
	}
	return r.handoffFailed(err, perr, cp, f, fields, true)
}

// publishRetry asks the delay publisher to bring cp back to queue after wait.
func (r *Retry) publishRetry(queue string, cp *message.Message, wait time.Duration) error {
	wdelay.Message(cp, wdelay.For(wait))
	return r.cfg.Delay.Publish(queue, cp)
}

// owns tells whether msg is this Retry's to count: delivered by its subscriber, or any
// message when RetryConfig.Subscriber is not set.
func (r *Retry) owns(msg *message.Message) bool {
	return r.cfg.Subscriber == "" || msg.Metadata.Get(xdeath.SubscriberKey) == r.cfg.Subscriber
}

// errOtherRetry: the message is another Retry's, and that Retry is on the handler too.
var errOtherRetry = errors.New("message of another retry middleware on this handler")

// checkWiring tells whether this Retry may hand off msg: nil, errOtherRetry, or an
// error wrapping ErrNotWired that names the fix.
func (r *Retry) checkWiring(msg *message.Message, f failure) error {
	if r.cfg.Subscriber == "" {
		return nil
	}
	switch owner := msg.Metadata.Get(xdeath.SubscriberKey); {
	case owner == r.cfg.Subscriber:
	case owner == "":
		return fmt.Errorf("%w: message %s on handler %q was not delivered by a subscriber built from this Retry's SubscriberConfig(), so where its retry must go is unknown; build the subscriber from Retry.SubscriberConfig(), or add the handler with Retry.AddHandler", ErrNotWired, msg.UUID, f.handler)
	case inChain(msg, owner):
		return errOtherRetry
	default:
		return fmt.Errorf("%w: message %s on handler %q was delivered by the subscriber of another amqpretry.Retry, whose middleware is not on this handler; add that Retry's Middleware to the handler, or add the handler with its AddHandler", ErrNotWired, msg.UUID, f.handler)
	}
	if r.cfg.CheckQueue != nil {
		if err := r.cfg.CheckQueue(f.queue); err != nil {
			return fmt.Errorf("%w: handler %q: %w", ErrNotWired, f.handler, err)
		}
	}
	return nil
}

// poison hands cp, the copy of a message that failed for good, to the poison topic. A
// copy too large for the broker loses its envelope's longer fields first, then the
// largest headers that are not ours, named under DroppedHeadersKey, until it fits.
func (r *Retry) poison(err error, cp *message.Message, f failure, reason string, fields watermill.LogFields) error {
	for _, k := range []string{delay.RequestedDelayKey, delay.EffectiveDelayKey, delay.DueKey, delay.TierHeader, wdelay.DelayedForKey, wdelay.DelayedUntilKey} {
		delete(cp.Metadata, k)
	}
	cp.Metadata.Set(PoisonReasonKey, reason)
	cp.Metadata.Set(AttemptKey, strconv.Itoa(f.attempt))
	cp.Metadata.Set(MaxAttemptsKey, strconv.Itoa(r.cfg.Policy.MaxAttempts))
	fields["poison_reason"] = reason
	start := time.Now()
	perr := r.cfg.Poison.Publish(r.cfg.PoisonTopic, cp)
	if errors.Is(perr, delay.ErrTooLarge) {
		trimEnvelope(cp.Metadata)
		perr = r.cfg.Poison.Publish(r.cfg.PoisonTopic, cp)
	}
	for errors.Is(perr, delay.ErrTooLarge) && dropLargestHeader(cp.Metadata) {
		perr = r.cfg.Poison.Publish(r.cfg.PoisonTopic, cp)
	}
	if perr != nil {
		return r.handoffFailed(err, fmt.Errorf("poison topic %q: %w", r.cfg.PoisonTopic, perr), cp, f, fields, false)
	}
	r.failures.forget(cp.UUID)
	r.stats.poisoned.Add(1)
	r.observe(Event{Kind: EventPoisoned, Queue: f.queue, Attempt: f.attempt, Reason: reason, Err: err, Handoff: time.Since(start)})
	if dropped := cp.Metadata.Get(DroppedHeadersKey); dropped != "" {
		fields["dropped_headers"] = dropped
	}
	warn(r.cfg.Logger, "Message poisoned", err, fields)
	return nil
}

// handoffFailed handles a hand-off that failed with perr: it poisons the message once
// HandoffAttempts hand-offs of it have failed in a row (if mayPoison), and otherwise
// waits a while, then returns the error that makes the router nack it for redelivery.
func (r *Retry) handoffFailed(err, perr error, cp *message.Message, f failure, fields watermill.LogFields, mayPoison bool) error {
	n := r.failures.add(cp.UUID)
	r.stats.failures.Add(1)
	r.observe(Event{Kind: EventHandoffFailed, Queue: f.queue, Attempt: f.attempt, Err: perr})
	fields["handoff_failures"] = n
	r.cfg.Logger.Error("Could not hand off message, nacking it for redelivery", perr, fields)
	if mayPoison && n >= r.cfg.HandoffAttempts {
		note := fmt.Sprintf("%d hand-offs failed in a row, the last: %v; handler error: %v", n, perr, err)
		cp.Metadata.Set(ErrorKey, truncate(note, MaxErrorBytes))
		return r.poison(err, cp, f, PoisonHandoffFailed, fields)
	}
	pause(cp.Context(), handoffBackoff(n))
	return errors.Join(err, fmt.Errorf("%w: queue %q: %w", ErrHandoff, f.queue, perr))
}
