package amqp1

import (
	"errors"
	"fmt"
	"maps"
	"math"
	"reflect"
	"strings"

	amqp "github.com/Azure/go-amqp"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/middleware"
)

// Retry is amqpretry's retry middleware for this package's Subscriber, on RabbitMQ
// 4.3+: a failed delivery is settled modified with x-opt-delivery-time, and the broker
// holds it in its quorum queue until then (the delivery-time backend). Every delay of
// the Policy is kept exactly, to the millisecond (exponential, jitter, explicit list,
// RetryAfter, Classify), and nothing is copied or published: a retry cannot be
// duplicated by its own hand-off. The attempt is the broker's delivery count plus one;
// the failure envelope travels as x-opt-amqpretry-* message annotations, which the
// broker keeps, and is in the metadata of every later delivery
// (middleware.ReadEnvelope). A permanent error or the last attempt goes to the poison
// queue, with a publish the broker confirms before the delivery is accepted.
type Retry struct {
	*middleware.Retry
	sub    SubscriberConfig
	logger watermill.LoggerAdapter
}

// NewRetry validates sub and cfg, and only if both are valid connects to the broker at
// sub.URI, refuses a broker older than 4.3, declares the poison queue and builds the
// middleware. cfg.Backend must be delay.DeliveryTime() (the default here) or nil; the
// subscriber's queues must be quorum queues (sub.Queue.Type, the default), and
// cfg.Policy.MaxAttempts must not exceed their delivery limit (x-delivery-limit in
// sub.Queue.Arguments, RabbitMQ 4's default 20 when unset; -1 for none), past which
// the broker drops or dead-letters a message instead of delivering it again.
func NewRetry(sub SubscriberConfig, cfg amqpretry.Config) (*Retry, error) {
	if cfg.Backend == nil {
		cfg.Backend = delay.DeliveryTime()
	}
	sub.setDefaults()
	if cfg.OrderKey != nil {
		// One consumer at a time: competing consumers would break each key's order.
		args := maps.Clone(sub.Queue.Arguments)
		if args == nil {
			args = map[string]any{}
		}
		if _, set := args[singleActiveConsumerArg]; !set {
			args[singleActiveConsumerArg] = true
		}
		sub.Queue.Arguments = args
	}
	r, err := middleware.New(cfg, middleware.Transport{
		URI:       sub.URI,
		AMQP:      amqp091.Config{TLSClientConfig: sub.TLSConfig, Properties: handoffProperties(sub.ContainerID)},
		Queue:     sub.QueueName,
		Redeliver: Redeliver,
		Validate:  sub.validateFor,
	})
	if err != nil {
		return nil, err
	}
	return &Retry{Retry: r, sub: sub, logger: cfg.WithDefaults().Logger}, nil
}

// validateFor reports every setting of sub that cannot run cfg (with its defaults).
func (sub SubscriberConfig) validateFor(cfg amqpretry.Config) error {
	var errs []error
	if err := sub.Validate(); err != nil {
		errs = append(errs, err)
	}
	if sub.Queue.Type != "quorum" {
		errs = append(errs, fmt.Errorf("Subscriber: Queue.Type %q: the broker holds a retry (x-opt-delivery-time) in a quorum queue only: set Queue.Type to \"quorum\", its default", sub.Queue.Type))
	}
	if err := deliveryLimitFits(sub.Queue.Arguments, cfg.Policy.MaxAttempts); err != nil {
		errs = append(errs, err)
	}
	if sac, ok := sub.Queue.Arguments[singleActiveConsumerArg]; ok && cfg.OrderKey != nil && sac != true {
		errs = append(errs, fmt.Errorf("Subscriber: Queue.Arguments: %s %v: with Config.OrderKey a work queue has one active consumer, or competing consumers would break each key's order: leave it out (NewRetry sets it), or set it true", singleActiveConsumerArg, sac))
	}
	return errors.Join(errs...)
}

// defaultDeliveryLimit is the x-delivery-limit RabbitMQ 4 gives a quorum queue
// declared without one (TestPinnedFacts: the library's own). Refused here, where the
// 0-9-1 path only warns: every retry of delivery-time is a failed delivery the limit
// counts, while on 0-9-1 only a failed hand-off's nack counts, and only before 4.3.
const defaultDeliveryLimit = 20

// deliveryLimitFits checks the work queue's delivery limit against the policy: a quorum
// queue counts every delivery settled modified{delivery-failed} (and every delivery
// lost with its connection), and once a message's count passes the limit, the broker
// dead-letters it, or drops it without a dead-letter target, instead of delivering it
// again (measured on RabbitMQ 4.3.6: with the default 20, the 21st modified drops it).
// The retries of one message settle MaxAttempts-1 deliveries modified; requiring
// MaxAttempts <= the limit leaves one lost connection of room.
func deliveryLimitFits(args map[string]any, maxAttempts int) error {
	limit, set := int64(defaultDeliveryLimit), false
	if v, ok := args[deliveryLimitArg]; ok {
		n, isInt := integer(v)
		if !isInt {
			return fmt.Errorf("Subscriber: Queue.Arguments: x-delivery-limit %v of type %T: want an integer", v, v)
		}
		limit, set = n, true
	}
	if limit < 0 || int64(maxAttempts) <= limit {
		return nil
	}
	where := fmt.Sprintf("the queue's x-delivery-limit %d", limit)
	if !set {
		where = fmt.Sprintf("RabbitMQ 4's default x-delivery-limit of %d (none set in Subscriber Queue.Arguments)", limit)
	}
	return fmt.Errorf("Policy.MaxAttempts: %d is above %s: the broker would dead-letter or drop a message after that many failed deliveries, before its last attempt; lower MaxAttempts or set Queue.Arguments[\"x-delivery-limit\"] to at least %d (-1: no limit)",
		maxAttempts, where, maxAttempts)
}

// Queue arguments RabbitMQ gives meaning to: copies of the library's internal
// declare.DeliveryLimitArg and declare.QueueTypeArg: this module's code builds on the
// root's public API only, not its internal/ (CI checks it; a test pins the copies).
const (
	deliveryLimitArg        = "x-delivery-limit"
	queueTypeArg            = "x-queue-type"
	singleActiveConsumerArg = "x-single-active-consumer"
)

// parkUntilKey is the metadata key of a retry copy's due time, the library's internal
// keys.ParkUntil (a test pins the copy): a copy held until then counts its
// returns as waits, not attempts.
const parkUntilKey = "amqpretry-hold-until"

// handoffProperties are the client properties of the poison queue's AMQP 0-9-1
// connection: its connection_name is the subscriber's ContainerID (or
// "watermill-amqp1") and "-poison", so that rabbitmqctl list_connections
// client_properties tells whose it is, as container_id does for the subscribers'.
func handoffProperties(containerID string) amqp091.Table {
	if containerID == "" {
		containerID = "watermill-amqp1"
	}
	return amqp091.Table{
		"connection_name": containerID + "-poison",
		"product":         "amqpretry amqp1 retry",
		"platform":        "golang",
	}
}

// SubscriberConfig returns the subscriber config given to NewRetry, for NewSubscriber:
// its deliveries carry the attempt, the envelope and the Retry's identity in their
// metadata, as the middleware reads them.
func (r *Retry) SubscriberConfig() SubscriberConfig {
	c := r.sub
	c.retry = r.Retry
	return c
}

// AddHandler adds to router a handler named handlerName that consumes topic through a
// new Subscriber built from SubscriberConfig(), with this Retry's Middleware on it.
// The router closes the subscriber when it stops.
func (r *Retry) AddHandler(router *message.Router, handlerName, topic string, handler message.NoPublishHandlerFunc) (*message.Handler, error) {
	s, err := NewSubscriber(r.SubscriberConfig(), r.logger)
	if err != nil {
		return nil, fmt.Errorf("subscriber for handler %q: %w", handlerName, err)
	}
	h := router.AddConsumerHandler(handlerName, topic, s, handler)
	h.AddMiddleware(r.Middleware)
	return h, nil
}

// annotationPrefix starts AMQP 1.0's non-standard message annotations, the ones the
// delivery-time backend carries the failure envelope in (package delay writes them
// with the same prefix; the retry tests on the broker read the envelope back through
// it).
const annotationPrefix = "x-opt-"

// envelopeAnnotation starts the message annotations the failure envelope travels in:
// annotationPrefix, then the envelope's keys (the library's internal/keys; a test pins
// the copy).
const envelopeAnnotation = annotationPrefix + "amqpretry-"

// retryView writes into msg's metadata what the retry middleware reads of delivery m:
// the failure envelope carried in annotations, and, through r.Delivered, that it is r's
// at the attempt the broker's delivery count plus one says.
func retryView(msg *message.Message, m *amqp.Message, r *middleware.Retry) {
	for k, v := range m.Annotations {
		name, _ := k.(string)
		if sym, ok := k.(amqp.Symbol); ok {
			name = string(sym)
		}
		if s, ok := v.(string); ok && strings.HasPrefix(name, envelopeAnnotation) {
			msg.Metadata[strings.TrimPrefix(name, annotationPrefix)] = s
		}
	}
	count := uint32(0)
	if m.Header != nil {
		count = m.Header.DeliveryCount
	}
	if _, copied := msg.Metadata[parkUntilKey]; copied {
		// A copy held until it is due: its attempt is the one it carries.
		r.Delivered(msg, 0)
		return
	}
	r.Delivered(msg, int(count)+1)
}

// integer reads an AMQP integer of any width, as RabbitMQ takes x-delivery-limit: a
// copy of the library's internal wire.Integer: this module's code does not import the
// root's internal/ (CI checks it; a test pins the copy).
func integer(v any) (int64, bool) {
	switch n := v.(type) {
	case int8, int16, int32, int64, int:
		return reflect.ValueOf(n).Int(), true
	case uint8, uint16, uint32:
		return int64(reflect.ValueOf(n).Uint()), true
	case uint64:
		return int64(n), n <= math.MaxInt64
	case uint:
		return int64(n), uint64(n) <= math.MaxInt64
	}
	return 0, false
}
