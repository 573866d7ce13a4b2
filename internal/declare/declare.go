// Package declare applies a topology.Topology on a channel: declares it, verifies it
// without declaring (least privilege), or checks each declaration and reports on it.
// It also names the arguments RabbitMQ gives meaning to, once.
package declare

import (
	"errors"
	"fmt"
	"regexp"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/topology"
)

// Argument names and values RabbitMQ gives meaning to.
const (
	QueueTypeArg          = "x-queue-type"
	MessageTTLArg         = "x-message-ttl"
	DeadLetterExchangeArg = "x-dead-letter-exchange"
	DeadLetterStrategyArg = "x-dead-letter-strategy"
	OverflowArg           = "x-overflow"
	AlternateExchangeArg  = "alternate-exchange"
	DelayedTypeArg        = "x-delayed-type"
	DeliveryLimitArg      = "x-delivery-limit"
	// RabbitMQ 4.3's delayed retry of quorum queues: type (disabled, all, failed or
	// returned) and the linear delay's minimum and maximum, in milliseconds.
	DelayedRetryTypeArg = "x-delayed-retry-type"
	DelayedRetryMinArg  = "x-delayed-retry-min"
	DelayedRetryMaxArg  = "x-delayed-retry-max"

	QueueTypeQuorum        = "quorum"
	DeadLetterAtLeastOnce  = "at-least-once"
	OverflowRejectPublish  = "reject-publish"
	ExchangeDelayedMessage = "x-delayed-message"
	DelayedRetryReturned   = "returned"
)

// holdingDeliveryLimit is the delivery limit of the queues that hold messages for
// people (poison, parking): reading them (basic.get, then a requeue) counts as a
// delivery on RabbitMQ 4.0 to 4.2, whose default limit of 20 would drop a poisoned
// message after its 20th listing. -1 would mean no limit on 4.x, but drops a message
// at its first requeue on 3.x; a million does neither.
const holdingDeliveryLimit = 1_000_000

// HoldingQueue is a queue that holds messages until someone acts on them, the poison
// and parking queues (role): a quorum queue, replicated like the delay queues, with a
// delivery limit no reading reaches.
func HoldingQueue(name, role string) topology.Queue {
	return topology.Queue{Name: name, Role: role, Args: map[string]interface{}{
		QueueTypeArg:     QueueTypeQuorum,
		DeliveryLimitArg: int64(holdingDeliveryLimit),
	}}
}

// Merge returns the declarations of ts, in order.
func Merge(ts ...topology.Topology) topology.Topology {
	var out topology.Topology
	for _, t := range ts {
		out.Exchanges = append(out.Exchanges, t.Exchanges...)
		out.Queues = append(out.Queues, t.Queues...)
		out.Bindings = append(out.Bindings, t.Bindings...)
	}
	return out
}

// Unique drops repeated declarations, keeping the first.
func Unique(t topology.Topology) topology.Topology {
	var out topology.Topology
	seen := map[string]bool{}
	first := func(key string) bool {
		if seen[key] {
			return false
		}
		seen[key] = true
		return true
	}
	for _, e := range t.Exchanges {
		if first(fmt.Sprintf("e|%s|%s|%v", e.Name, e.Kind, e.Args)) {
			out.Exchanges = append(out.Exchanges, e)
		}
	}
	for _, q := range t.Queues {
		if first(fmt.Sprintf("q|%s|%v", q.Name, q.Args)) {
			out.Queues = append(out.Queues, q)
		}
	}
	for _, b := range t.Bindings {
		if first(fmt.Sprintf("b|%s|%s|%s|%v|%v", b.Exchange, b.Destination, b.Key, b.ToExchange, b.Args)) {
			out.Bindings = append(out.Bindings, b)
		}
	}
	return out
}

// Ensure applies t on ch as mode says: topology.ModeDeclare (or "") declares it,
// topology.ModeVerify verifies it, topology.ModeNone does nothing. A failed
// declaration or check closes ch.
func Ensure(ch *amqp.Channel, mode topology.Mode, t topology.Topology) error {
	switch mode {
	case topology.ModeDeclare, "":
		return Declare(ch, t)
	case topology.ModeVerify:
		return Verify(ch, t)
	case topology.ModeNone:
		return nil
	}
	return fmt.Errorf("unknown topology mode %q", mode)
}

// Declare declares everything in t on ch, idempotently. A clash with an existing
// declaration returns an error wrapping topology.ErrMismatch that names the queue or
// exchange and the argument that differs; the broker closes ch in that case.
func Declare(ch *amqp.Channel, t topology.Topology) error {
	for _, e := range t.Exchanges {
		if err := ch.ExchangeDeclare(e.Name, e.Kind, true, false, false, false, e.Args); err != nil {
			return declareError("exchange", e.Name, err)
		}
	}
	for _, q := range t.Queues {
		if _, err := ch.QueueDeclare(q.Name, true, false, false, false, q.Args); err != nil {
			return declareError("queue", q.Name, err)
		}
	}
	for _, b := range t.Bindings {
		if err := bind(ch, b); err != nil {
			return fmt.Errorf("bind %q to exchange %q with key %q: %w", b.Destination, b.Exchange, b.Key, err)
		}
	}
	return nil
}

// Verify checks t on ch without declaring any exchange or queue: each one is declared
// passively, which needs no configure permission and fails (404, wrapped in
// topology.ErrMissing) when it does not exist. Bindings cannot be read in AMQP 0-9-1,
// so Verify asserts them. It stops at the first problem, which has closed ch.
func Verify(ch *amqp.Channel, t topology.Topology) error {
	for _, e := range t.Exchanges {
		if err := ch.ExchangeDeclarePassive(e.Name, e.Kind, true, false, false, false, e.Args); err != nil {
			return CheckError("exchange", e.Name, err)
		}
	}
	for _, q := range t.Queues {
		if _, err := ch.QueueDeclarePassive(q.Name, true, false, false, false, q.Args); err != nil {
			return CheckError("queue", q.Name, err)
		}
	}
	for _, b := range t.Bindings {
		if err := bind(ch, b); err != nil {
			return BindError(b, err)
		}
	}
	return nil
}

func bind(ch *amqp.Channel, b topology.Binding) error {
	if b.ToExchange {
		return ch.ExchangeBind(b.Destination, b.Key, b.Exchange, false, b.Args)
	}
	return ch.QueueBind(b.Destination, b.Key, b.Exchange, false, b.Args)
}

var inequivalentArg = regexp.MustCompile(`inequivalent arg '([^']+)'`)

func declareError(kind, name string, err error) error {
	// Only "inequivalent arg" is a clash with an existing declaration: RabbitMQ 4.x
	// answers 406 as well to an unknown exchange type (a missing plugin) and to an
	// invalid argument, where deleting the existing object would not help.
	if m := inequivalentArg.FindStringSubmatch(reason(err)); IsCode(err, amqp.PreconditionFailed) && m != nil {
		return fmt.Errorf("declare %s %q: %w: argument %s differs from the existing declaration (delete it or align the config): %w",
			kind, name, topology.ErrMismatch, m[1], err)
	}
	return fmt.Errorf("declare %s %q: %w", kind, name, err)
}

// CheckError names the object of a failed passive declaration; a 404 wraps
// topology.ErrMissing.
func CheckError(kind, name string, err error) error {
	if IsCode(err, amqp.NotFound) {
		return fmt.Errorf("%s %q: %w: %w", kind, name, topology.ErrMissing, err)
	}
	return fmt.Errorf("check %s %q: %w", kind, name, err)
}

// BindError names the binding that could not be made; a 404 wraps
// topology.ErrMissing.
func BindError(b topology.Binding, err error) error {
	if IsCode(err, amqp.NotFound) {
		return fmt.Errorf("binding of %q to exchange %q with key %q: %w (its exchange or queue does not exist): %w", b.Destination, b.Exchange, b.Key, topology.ErrMissing, err)
	}
	return fmt.Errorf("bind %q to exchange %q with key %q: %w", b.Destination, b.Exchange, b.Key, err)
}

// IsCode tells whether err is an AMQP error with the given reply code.
func IsCode(err error, code int) bool {
	var amqpErr *amqp.Error
	return errors.As(err, &amqpErr) && amqpErr.Code == code
}

func reason(err error) string {
	var amqpErr *amqp.Error
	if errors.As(err, &amqpErr) {
		return amqpErr.Reason
	}
	return err.Error()
}
