package topology

import (
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/amqperr"
)

// Apply applies t on ch as mode says. ModeDeclare (or "") declares every exchange,
// queue and binding, idempotently: a clash with an existing declaration returns an
// error wrapping ErrMismatch that names the queue or exchange and the argument that
// differs. ModeVerify declares no exchange or queue: it declares each passively,
// which needs no configure permission and fails, wrapping ErrMissing, when one does
// not exist; bindings cannot be read in AMQP 0-9-1, so it asserts them. ModeNone does
// nothing. It stops at the first problem, which has closed ch.
//
// Config.Plan gives the topology a configuration needs; Apply it yourself in topology
// mode none, or have `amqpretry topology apply` do it.
func (t Topology) Apply(ch *amqp.Channel, mode Mode) error {
	switch mode {
	case ModeDeclare, "":
		return t.declare(ch)
	case ModeVerify:
		return t.verify(ch)
	case ModeNone:
		return nil
	}
	return fmt.Errorf("unknown topology mode %q: want %s, %s or %s", mode, ModeDeclare, ModeVerify, ModeNone)
}

func (t Topology) declare(ch *amqp.Channel) error {
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
		if err := b.bind(ch); err != nil {
			return fmt.Errorf("bind %q to exchange %q with key %q: %w", b.Destination, b.Exchange, b.Key, err)
		}
	}
	return nil
}

func (t Topology) verify(ch *amqp.Channel) error {
	for _, e := range t.Exchanges {
		if err := ch.ExchangeDeclarePassive(e.Name, e.Kind, true, false, false, false, e.Args); err != nil {
			return checkError("exchange", e.Name, err)
		}
	}
	for _, q := range t.Queues {
		if _, err := ch.QueueDeclarePassive(q.Name, true, false, false, false, q.Args); err != nil {
			return checkError("queue", q.Name, err)
		}
	}
	for _, b := range t.Bindings {
		if err := b.bind(ch); err != nil {
			return b.bindError(err)
		}
	}
	return nil
}

func (b Binding) bind(ch *amqp.Channel) error {
	if b.ToExchange {
		return ch.ExchangeBind(b.Destination, b.Key, b.Exchange, false, b.Args)
	}
	return ch.QueueBind(b.Destination, b.Key, b.Exchange, false, b.Args)
}

func declareError(kind, name string, err error) error {
	// Only "inequivalent arg" is a clash with an existing declaration: RabbitMQ 4.x
	// answers 406 as well to an unknown exchange type (a missing plugin) and to an
	// invalid argument, where deleting the existing object would not help.
	if m := amqperr.InequivalentArg.FindStringSubmatch(amqperr.Reason(err)); amqperr.IsCode(err, amqp.PreconditionFailed) && m != nil {
		return fmt.Errorf("declare %s %q: %w: argument %s differs from the existing declaration (delete it or align the config): %w",
			kind, name, ErrMismatch, m[1], err)
	}
	return fmt.Errorf("declare %s %q: %w", kind, name, err)
}

// bindError names the binding that could not be made; a 404 wraps ErrMissing.
func (b Binding) bindError(err error) error {
	if amqperr.IsCode(err, amqp.NotFound) {
		return fmt.Errorf("binding of %q to exchange %q with key %q: %w (its exchange or queue does not exist): %w", b.Destination, b.Exchange, b.Key, ErrMissing, err)
	}
	return fmt.Errorf("bind %q to exchange %q with key %q: %w", b.Destination, b.Exchange, b.Key, err)
}

// checkError names the object of a failed passive declaration; a 404 wraps ErrMissing.
func checkError(kind, name string, err error) error {
	if amqperr.IsCode(err, amqp.NotFound) {
		return fmt.Errorf("%s %q: %w: %w", kind, name, ErrMissing, err)
	}
	return fmt.Errorf("check %s %q: %w", kind, name, err)
}
