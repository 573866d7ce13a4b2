package middleware

import (
	"errors"
	"fmt"
	"maps"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wdelay "github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
)

// Delayer parks a copy of a failed message and brings it back, after a delay, to the
// queue named by the topic it is published to. Every delay.Backend is one.
type Delayer interface {
	// Publish parks msgs, reading the delay from Watermill's delay metadata
	// (components/delay), and returns once they are safe (for RabbitMQ, confirmed).
	message.Publisher
	// Effective returns the delay actually applied for a requested one (snapped to a
	// tier, rounded to a second, ...), or an error if it cannot be held at all.
	Effective(requested time.Duration) (time.Duration, error)
}

// RetryConfig configures Retry.
type RetryConfig struct {
	// Policy: how many attempts and how long apart. Defaults: see Policy.
	Policy Policy
	// Classify decides, for any error, whether to poison now and whether to override
	// the policy's delay. Default: DefaultClassify, the error's own marks (Permanent,
	// RetryAfter), whose answer it receives as ClassifyParams.Default.
	Classify func(ClassifyParams) Decision

	// Delay parks the copy of a failed message and brings it back to its queue (a
	// delay.Backend). Required.
	Delay Delayer
	// Poison receives messages that failed for good, on PoisonTopic. Required.
	Poison message.Publisher
	// PoisonTopic is the topic (for RabbitMQ, the queue) of poisoned messages. Required.
	PoisonTopic string
	// Queue maps the topic a handler subscribes to onto the queue its messages come
	// from, which is where a retry must come back to (for watermill-amqp,
	// Config.Queue.GenerateName). Default: the topic itself.
	Queue func(topic string) string

	// Subscriber identifies the subscriber configuration whose deliveries this Retry
	// handles, and Owner tells which subscriber delivered a message (amqpretry sets
	// both, from xdeath.Marshaler.Subscriber and xdeath.SubscriberKey). When Subscriber
	// is set, a failed message that another subscriber delivered is left to that
	// subscriber's Retry if its middleware is also on the handler, so several Retry
	// middlewares added router-wide each serve their own group; a message no Retry on
	// the handler owns fails with ErrNotWired. Default: "" (every message is this
	// Retry's).
	Subscriber string
	Owner      func(msg *message.Message) string
	// Origin, if set, tells the exchange and routing key a message was delivered with,
	// recorded as OriginalExchangeKey and OriginalRoutingKeyKey on its first failure
	// (amqpretry reads them from xdeath.DeliveryExchangeKey and
	// xdeath.DeliveryRoutingKeyKey). Default: nil (recorded empty).
	Origin func(msg *message.Message) (exchange, routingKey string)
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
	if c.Owner == nil {
		c.Owner = func(*message.Message) string { return "" }
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
		run := msg
		var decided *Decision // err's, when retryNow classified it
		for err != nil {
			var again bool
			if again, decided = r.retryNow(run, err); !again {
				break
			}
			pause(msg.Context(), r.cfg.Policy.ImmediateInterval)
			next := run.Copy()
			next.SetContext(run.Context())
			next.Metadata.Set(AttemptKey, strconv.Itoa(Attempt(run)+1))
			run = next
			produced, err = h(run)
		}
		if err == nil {
			r.failures.forget(msg.UUID)
			if observe {
				r.observe(Event{Kind: EventSucceeded, Queue: r.cfg.Queue(message.SubscribeTopicFromCtx(msg.Context())), Attempt: Attempt(run)})
			}
			return produced, nil
		}
		return nil, r.handleFailure(run, err, decided)
	}
}

// retryNow tells whether run, which failed with err, gets an immediate retry: on its
// first delivery, within Policy.Immediate and MaxAttempts, if it is this Retry's and
// its error asks for no delay and is not permanent. It returns the decision when it
// classified err, so that Classify runs once per failure.
func (r *Retry) retryNow(run *message.Message, err error) (bool, *Decision) {
	attempt := Attempt(run)
	if attempt > r.cfg.Policy.Immediate || attempt >= r.cfg.Policy.MaxAttempts || !r.owns(run) || errors.Is(err, ErrHandoff) {
		return false, nil
	}
	d := r.decide(run, err, attempt)
	return !d.Permanent && d.Delay <= 0, &d
}

// decide classifies err: the error's marks, then Classify if set.
func (r *Retry) decide(msg *message.Message, err error, attempt int) Decision {
	p := ClassifyParams{Err: err, Message: msg, Attempt: attempt}
	p.Default = DefaultClassify(p)
	if r.cfg.Classify == nil {
		return p.Default
	}
	return r.cfg.Classify(p)
}

// handleFailure decides what becomes of msg after the handler failed with err (unless
// decided already holds err's decision), sizes the delay with the backend, stamps the
// copy and publishes it: data flows one way.
func (r *Retry) handleFailure(msg *message.Message, err error, decided *Decision) error {
	if errors.Is(err, ErrHandoff) {
		return err // a Retry nearer the handler has dealt with it
	}
	f := r.failureOf(msg, err)
	werr := r.checkWiring(msg, f)
	if errors.Is(werr, errOtherRetry) {
		return err // that Retry, also on this handler, decides
	}
	if decided == nil {
		d := r.decide(msg, err, f.attempt)
		decided = &d
	}
	decision := *decided
	fields := watermill.LogFields{
		"message_uuid": msg.UUID, "handler": f.handler, "topic": f.topic, "queue": f.queue,
		"attempt": f.attempt, "max_attempts": r.cfg.Policy.MaxAttempts, "err": err.Error(),
	}
	cp := copyForEnvelope(msg)
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

	// Decide and size.
	requested := decision.Delay
	if requested <= 0 {
		requested = r.cfg.Policy.delayAfter(f.attempt)
	}
	effective, serr := r.cfg.Delay.Effective(requested)
	if serr != nil {
		// Handing it off would be refused: poison it, saying why.
		cp.Metadata.Set(ErrorKey, truncate(serr.Error()+"; handler error: "+err.Error(), MaxErrorBytes))
		return r.poison(err, cp, f, PoisonDelayTooLong, fields)
	}
	// Stamp and publish.
	start := time.Now()
	stampRetry(cp.Metadata, f.attempt+1, requested, effective, start)
	wdelay.Message(cp, wdelay.For(effective))
	perr := r.cfg.Delay.Publish(f.queue, cp)
	if tooLarge(perr) {
		trimEnvelope(cp.Metadata)
		perr = r.cfg.Delay.Publish(f.queue, cp)
	}
	switch {
	case perr == nil:
		r.failures.forget(msg.UUID)
		n := r.stats.retries.Add(1)
		r.observe(Event{Kind: EventRetryScheduled, Queue: f.queue, Attempt: f.attempt, Err: err,
			Requested: requested, Effective: effective, Handoff: time.Since(start)})
		if r.sampled(n) {
			fields["requested_delay"], fields["effective_delay"] = requested.String(), effective.String()
			r.cfg.Logger.Info("Retry scheduled", fields)
		}
		return nil
	case tooLarge(perr):
		// Handing it off again would be refused again: poison it, saying why, briefly:
		// the envelope of this copy is trimmed to fit.
		fields["handoff_err"] = perr.Error()
		cp.Metadata.Set(ErrorKey, truncate("retry copy larger than the broker's frame_max even with a trimmed envelope; handler error: "+err.Error(), MaxErrorBytes))
		return r.poison(err, cp, f, PoisonTooLarge, fields)
	}
	return r.handoffFailed(err, perr, cp, f, fields, true)
}

// envelopeRoom is how many keys the envelope, the retry stamps and Watermill's delay
// metadata add to a copy at most.
const envelopeRoom = 16

// copyForEnvelope copies msg, with its context, into metadata sized for the envelope:
// message.Copy's map would grow several times while it is stamped.
func copyForEnvelope(msg *message.Message) *message.Message {
	cp := message.NewMessageWithContext(msg.Context(), msg.UUID, msg.Payload)
	cp.Metadata = make(message.Metadata, len(msg.Metadata)+envelopeRoom)
	maps.Copy(cp.Metadata, msg.Metadata)
	return cp
}

// failureOf describes the failed attempt of msg.
func (r *Retry) failureOf(msg *message.Message, err error) failure {
	ctx := msg.Context()
	f := failure{
		err:     err,
		attempt: Attempt(msg),
		at:      time.Now(),
		handler: message.HandlerNameFromCtx(ctx),
		topic:   message.SubscribeTopicFromCtx(ctx),
	}
	f.queue = r.cfg.Queue(f.topic)
	if r.cfg.Origin != nil {
		f.exchange, f.key = r.cfg.Origin(msg)
	}
	return f
}

// tooLarge tells whether a publish was refused as larger than the broker's frame_max
// (delay.ErrTooLarge says so with a TooLarge method).
func tooLarge(err error) bool {
	var t interface{ TooLarge() bool }
	return errors.As(err, &t) && t.TooLarge()
}
