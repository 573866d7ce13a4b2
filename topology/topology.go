package topology

import (
	"errors"
	"fmt"
	"regexp"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Argument names RabbitMQ gives meaning to. They are exported so that code and tests
// spell them one way.
const (
	QueueTypeArg            = "x-queue-type"
	MessageTTLArg           = "x-message-ttl"
	DeadLetterExchangeArg   = "x-dead-letter-exchange"
	DeadLetterStrategyArg   = "x-dead-letter-strategy"
	DeadLetterRoutingKeyArg = "x-dead-letter-routing-key"
	OverflowArg             = "x-overflow"
	AlternateExchangeArg    = "alternate-exchange"
	DelayedTypeArg          = "x-delayed-type"

	QueueTypeQuorum        = "quorum"
	DeadLetterAtLeastOnce  = "at-least-once"
	OverflowRejectPublish  = "reject-publish"
	ExchangeDelayedMessage = "x-delayed-message"
)

// ErrMismatch is returned (wrapped) when a queue or exchange already exists with other
// arguments than the ones asked for (AMQP 406 PRECONDITION_FAILED).
var ErrMismatch = errors.New("declared with different arguments")

// Exchange is one durable exchange.
type Exchange struct {
	Name string
	Kind string // direct, fanout, topic, headers, x-delayed-message
	Args amqp.Table
}

// Queue is one durable queue.
type Queue struct {
	Name string
	Args amqp.Table
}

// Binding binds a queue (or, with ToExchange, an exchange) to an exchange.
type Binding struct {
	Exchange    string
	Destination string
	Key         string
	Args        amqp.Table
	ToExchange  bool
}

// Topology is a set of declarations. Declare applies them in order: exchanges, queues,
// then bindings, so a binding always finds both of its ends.
type Topology struct {
	Exchanges []Exchange
	Queues    []Queue
	Bindings  []Binding
}

// Merge returns t followed by the declarations of others.
func (t Topology) Merge(others ...Topology) Topology {
	out := Topology{
		Exchanges: append([]Exchange(nil), t.Exchanges...),
		Queues:    append([]Queue(nil), t.Queues...),
		Bindings:  append([]Binding(nil), t.Bindings...),
	}
	for _, o := range others {
		out.Exchanges = append(out.Exchanges, o.Exchanges...)
		out.Queues = append(out.Queues, o.Queues...)
		out.Bindings = append(out.Bindings, o.Bindings...)
	}
	return out
}

// Declare declares everything in t on ch. Declarations are idempotent: running Declare
// again with the same Topology changes nothing. A clash with an existing declaration
// returns an error wrapping ErrMismatch that names the queue or exchange and the
// argument that differs; the broker closes ch in that case.
func Declare(ch *amqp.Channel, t Topology) error {
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
		var err error
		if b.ToExchange {
			err = ch.ExchangeBind(b.Destination, b.Key, b.Exchange, false, b.Args)
		} else {
			err = ch.QueueBind(b.Destination, b.Key, b.Exchange, false, b.Args)
		}
		if err != nil {
			return fmt.Errorf("bind %q to exchange %q with key %q: %w", b.Destination, b.Exchange, b.Key, err)
		}
	}
	return nil
}

var inequivalentArg = regexp.MustCompile(`inequivalent arg '([^']+)'`)

func declareError(kind, name string, err error) error {
	var amqpErr *amqp.Error
	if errors.As(err, &amqpErr) && amqpErr.Code == amqp.PreconditionFailed {
		arg := "arguments"
		if m := inequivalentArg.FindStringSubmatch(amqpErr.Reason); m != nil {
			arg = "argument " + m[1]
		}
		return fmt.Errorf("declare %s %q: %w: %s differs from the existing declaration (delete it or align the config): %w",
			kind, name, ErrMismatch, arg, err)
	}
	return fmt.Errorf("declare %s %q: %w", kind, name, err)
}
