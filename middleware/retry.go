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
}

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
// modified.
type Retry struct {
	cfg RetryConfig
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
		produced, err := h(msg)
		if err == nil {
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
	wdelay.Message(cp, wdelay.For(wait))
	if perr := r.cfg.Delay.Publish(f.queue, cp); perr != nil {
		if errors.Is(perr, delay.ErrDelayTooLong) {
			// Handing it off again would be refused again: poison it, saying why, without
			// the delay request that was refused.
			delete(cp.Metadata, wdelay.DelayedForKey)
			delete(cp.Metadata, wdelay.DelayedUntilKey)
			cp.Metadata.Set(ErrorKey, truncate(perr.Error()+"; handler error: "+err.Error(), MaxErrorBytes))
			return r.poison(err, cp, f, PoisonDelayTooLong, fields)
		}
		r.cfg.Logger.Error("Could not hand off retry, nacking message for redelivery", perr, fields)
		return errors.Join(err, fmt.Errorf("%w: queue %q: %w", ErrHandoff, f.queue, perr))
	}
	fields["requested_delay"] = cp.Metadata.Get(delay.RequestedDelayKey)
	fields["effective_delay"] = cp.Metadata.Get(delay.EffectiveDelayKey)
	r.cfg.Logger.Info("Retry scheduled", fields)
	return nil
}

// poison hands cp, the copy of a message that failed for good, to the poison topic.
func (r *Retry) poison(err error, cp *message.Message, f failure, reason string, fields watermill.LogFields) error {
	cp.Metadata.Set(PoisonReasonKey, reason)
	cp.Metadata.Set(AttemptKey, strconv.Itoa(f.attempt))
	cp.Metadata.Set(MaxAttemptsKey, strconv.Itoa(r.cfg.Policy.MaxAttempts))
	fields["poison_reason"] = reason
	if perr := r.cfg.Poison.Publish(r.cfg.PoisonTopic, cp); perr != nil {
		r.cfg.Logger.Error("Could not poison message, nacking it for redelivery", perr, fields)
		return errors.Join(err, fmt.Errorf("%w: poison topic %q: %w", ErrHandoff, r.cfg.PoisonTopic, perr))
	}
	r.cfg.Logger.Info("Message poisoned", fields)
	return nil
}
