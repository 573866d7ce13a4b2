package wamqp

import (
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/ctxkey"
	"github.com/amqpretry/amqpretry/internal/hooks"
	"github.com/amqpretry/amqpretry/internal/subclose"
	"github.com/amqpretry/amqpretry/topology"
)

// What the two watermill-amqp majors share: their subscriber configs spell the queue,
// the exchange and the binding the same way, and their topology builders differ only
// in their signature. The transport packages (wamqp2, wamqp3) translate their major's
// types into these and call the methods below; everything else is done here once.

// Subscribed is what one subscribe declares, as the subscriber config spells it: the
// queue, and, when the config has an exchange (pub/sub), the exchange and the binding.
type Subscribed struct {
	Queue string
	// Topic is the topic subscribed to, where the major says it (v3); "" where not.
	Topic                  string
	QueueArgs              amqp.Table
	Exchange, ExchangeType string
	ExchangeArgs           amqp.Table
	Key                    string
	BindArgs               amqp.Table
}

// topology is s as declarations (durable, which a passive check does not compare).
func (s Subscribed) topology() topology.Topology {
	t := topology.Topology{Queues: []topology.Queue{{Name: s.Queue, Args: s.QueueArgs}}}
	if s.Exchange != "" {
		t.Exchanges = []topology.Exchange{{Name: s.Exchange, Kind: s.ExchangeType, Args: s.ExchangeArgs}}
		t.Bindings = []topology.Binding{{Exchange: s.Exchange, Destination: s.Queue, Key: s.Key, Args: s.BindArgs}}
	}
	return t
}

// BuildTopology is the subscriber's topology builder: it declares the subscriber's
// queue and exchange with declareInner (the major's own builder), or, in topology mode
// verify, checks them, or does nothing in mode none; then it gives the queue its way
// back. Called on every subscribe and reconnect.
func (w *Wiring) BuildTopology(ch *amqp.Channel, s Subscribed, declareInner func() error) error {
	switch w.cfg.Topology {
	case topology.ModeNone:
	case topology.ModeVerify:
		if err := s.topology().Apply(ch, topology.ModeVerify); err != nil {
			return w.hint(err, s.Queue)
		}
	default:
		if err := declareInner(); err != nil {
			return w.hint(err, s.Queue)
		}
	}
	return w.Retry.Bind(ch, s.Queue)
}

// DeclareExchange declares a subscriber's exchange with declareInner (the major's own
// builder), checks it in topology mode verify, or does nothing in mode none.
func (w *Wiring) DeclareExchange(ch *amqp.Channel, exchange, kind string, args amqp.Table, declareInner func() error) error {
	switch w.cfg.Topology {
	case topology.ModeNone:
		return nil
	case topology.ModeVerify:
		t := topology.Topology{Exchanges: []topology.Exchange{{Name: exchange, Kind: kind, Args: args}}}
		if err := t.Apply(ch, topology.ModeVerify); err != nil {
			return w.hint(err, "")
		}
		return nil
	}
	return declareInner()
}

// AddHandler adds to router a handler that consumes topic through the subscriber
// newSubscriber builds, closed when its subscription ends (in-process: the memory backend's publisher,
// which must be a message.Subscriber, and is left open), with this Retry's middleware
// on it. It first refuses the poison queue as the handler's queue, and a work queue
// that exists and cannot hold the retries (hooks.CheckWorkQueue): refused here, not
// when the router runs.
func (w *Wiring) AddHandler(router *message.Router, handlerName, topic string, handler message.NoPublishHandlerFunc, newSubscriber func(watermill.LoggerAdapter) (message.Subscriber, error)) (*message.Handler, error) {
	queue := topic
	if w.sub.QueueName != nil {
		queue = w.sub.QueueName(topic)
	}
	if queue == w.cfg.PoisonQueue {
		return nil, fmt.Errorf("handler %q: %w", handlerName, w.poisonAsWorkQueue(queue))
	}
	if err := hooks.CheckWorkQueue(w.Retry, queue); err != nil {
		return nil, fmt.Errorf("handler %q: %w", handlerName, err)
	}
	var sub message.Subscriber
	if w.InProcess() {
		s, ok := w.view.Local.(message.Subscriber)
		if !ok {
			return nil, fmt.Errorf("handler %q: the %s backend's publisher (%T) is not a message.Subscriber", handlerName, w.view.Name, w.view.Local)
		}
		sub = s
	} else {
		s, err := newSubscriber(w.cfg.Logger)
		if err != nil {
			return nil, fmt.Errorf("subscriber for handler %q: %w", handlerName, err)
		}
		sub = subclose.OnDone(s)
	}
	h := router.AddConsumerHandler(handlerName, topic, sub, ranHandler(handler))
	h.AddMiddleware(w.Retry.Middleware, expectHandler)
	return h, nil
}

// ranHandler is h, telling the Retry that it ran, and when it failed; expectHandler,
// just inside the Retry's middleware, tells it that h is below: a retry acked without
// h running was dropped by a middleware in between (one added to the handler after
// AddHandler), and a failure turned into a success or run again was a middleware's
// doing, which the Retry logs once where it cannot work (middleware/around.go). Both go
// through the message's chain (ctxkey.Chain).
func ranHandler(h message.NoPublishHandlerFunc) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		c, _ := msg.Context().Value(ctxkey.Chain{}).(handlerMarks)
		if c != nil {
			c.HandlerRan()
		}
		err := h(msg)
		if err != nil && c != nil {
			c.HandlerFailed(err)
		}
		return err
	}
}

// handlerMarks is what ranHandler tells the Retry through the message's chain.
type handlerMarks interface {
	HandlerRan()
	HandlerFailed(err error)
}

func expectHandler(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		if c, ok := msg.Context().Value(ctxkey.Chain{}).(interface{ ExpectHandler() }); ok {
			c.ExpectHandler()
		}
		return h(msg)
	}
}
