package wamqp

import (
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/subclose"
	"github.com/amqpretry/amqpretry/topology"
)

// What the two watermill-amqp majors share: their subscriber configs spell the queue,
// the exchange and the binding the same way, and their topology builders differ only
// in their signature. The transport packages (wamqp2, wamqp3) translate their major's
// types into these and call the methods below; everything else is done here once.

// QueueSpec is a subscriber config's queue declaration.
type QueueSpec struct {
	Durable, AutoDelete, Exclusive, NoWait bool
	Args                                   amqp.Table
}

// ExchangeSpec is a subscriber config's exchange declaration.
type ExchangeSpec struct {
	Type                                  string
	Durable, AutoDelete, Internal, NoWait bool
	Args                                  amqp.Table
}

// Subscribed is what one subscribe declares: the queue, and the exchange and binding
// key when the config has an exchange (pub/sub).
type Subscribed struct {
	Queue, Exchange, Key string
	QueueSpec            QueueSpec
	ExchangeSpec         ExchangeSpec
	BindNoWait           bool
	BindArgs             amqp.Table
}

// BuildTopology is the subscriber's topology builder: it declares the subscriber's
// queue and exchange with declareInner (the major's own builder), or, in topology mode
// verify, checks them, or does nothing in mode none; then it gives the queue its way
// back. Called on every subscribe and reconnect.
func (w *Wiring) BuildTopology(ch *amqp.Channel, s Subscribed, declareInner func() error) error {
	switch w.cfg.Topology {
	case topology.ModeNone:
	case topology.ModeVerify:
		q := s.QueueSpec
		if _, err := ch.QueueDeclarePassive(s.Queue, q.Durable, q.AutoDelete, q.Exclusive, q.NoWait, q.Args); err != nil {
			return w.fix.Hint(declare.CheckError("queue", s.Queue, err), s.Queue)
		}
		if s.Exchange != "" {
			if err := w.DeclareExchange(ch, s.Exchange, s.ExchangeSpec, nil); err != nil {
				return err
			}
			if err := ch.QueueBind(s.Queue, s.Key, s.Exchange, s.BindNoWait, s.BindArgs); err != nil {
				return w.fix.Hint(declare.BindError(topology.Binding{Exchange: s.Exchange, Destination: s.Queue, Key: s.Key}, err), s.Queue)
			}
		}
	default:
		if err := declareInner(); err != nil {
			return w.fix.Hint(err, s.Queue)
		}
	}
	return w.Retry.Bind(ch, s.Queue)
}

// DeclareExchange declares a subscriber's exchange with declareInner (the major's own
// builder), checks it in topology mode verify, or does nothing in mode none.
func (w *Wiring) DeclareExchange(ch *amqp.Channel, exchange string, e ExchangeSpec, declareInner func() error) error {
	switch w.cfg.Topology {
	case topology.ModeNone:
		return nil
	case topology.ModeVerify:
		if err := ch.ExchangeDeclarePassive(exchange, e.Type, e.Durable, e.AutoDelete, e.Internal, e.NoWait, e.Args); err != nil {
			return w.fix.Hint(declare.CheckError("exchange", exchange, err), "")
		}
		return nil
	}
	return declareInner()
}

// AddHandler adds to router a handler that consumes topic through the subscriber
// newSubscriber builds, closed when its subscription ends (in-process: Config.Memory,
// which must be a message.Subscriber, and is left open), with this Retry's middleware
// on it.
func (w *Wiring) AddHandler(router *message.Router, handlerName, topic string, handler message.NoPublishHandlerFunc, newSubscriber func(watermill.LoggerAdapter) (message.Subscriber, error)) (*message.Handler, error) {
	var sub message.Subscriber
	if w.InProcess() {
		s, ok := w.cfg.Memory.(message.Subscriber)
		if !ok {
			return nil, fmt.Errorf("handler %q: Config.Memory (%T) is not a message.Subscriber", handlerName, w.cfg.Memory)
		}
		sub = s
	} else {
		s, err := newSubscriber(w.cfg.Logger)
		if err != nil {
			return nil, fmt.Errorf("subscriber for handler %q: %w", handlerName, err)
		}
		sub = subclose.OnDone(s)
	}
	h := router.AddConsumerHandler(handlerName, topic, sub, handler)
	h.AddMiddleware(w.Retry.Middleware)
	return h, nil
}
