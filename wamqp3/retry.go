package wamqp3

import (
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	amqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/wamqp"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/xdeath"
)

// Retry is the retry middleware (middleware.Retry) for subscribers built from
// watermill-amqp v3 configs. Build it with New, add each handler with AddHandler (or
// build its subscriber from SubscriberConfig and add Middleware to it or to the
// router), and Close it after the router.
type Retry struct {
	*middleware.Retry
	w   *wamqp.Wiring
	sub amqp.Config
}

// New validates sub and cfg, every invalid field named, and only if both are valid
// connects to the broker at sub's URI, refuses a backend the broker cannot run,
// declares (or, in topology mode verify, checks) the backend's topology and the poison
// queue, and builds the middleware. An invalid config touches nothing on the broker.
//
// With the memory backend and no URI in sub, everything stays in this process:
// delay.Memory(...) (a GoChannel, say) receives the retries and the poisoned messages.
func New(sub amqp.Config, cfg amqpretry.Config) (*Retry, error) {
	m := sub.Marshaler
	if d, ok := m.(amqp.DefaultMarshaler); ok {
		m = xdeath.Marshaler(d) // the same fields
	}
	c := sub.Connection
	w, err := wamqp.New(wamqp.Sub{URI: c.AmqpURI, AMQP: c.AmqpConfig, TLS: c.TLSConfig, QueueName: sub.Queue.GenerateName,
		NoRequeueOnNack: sub.Consume.NoRequeueOnNack, QueueArgs: sub.Queue.Arguments, Marshaler: m}, cfg)
	if err != nil {
		return nil, err
	}
	return &Retry{Retry: w.Retry, w: w, sub: sub}, nil
}

// SubscriberConfig returns the subscriber config given to New, ready for
// amqp.NewSubscriber: its marshaler reads every header and marks each message as this
// Retry's (Delivered), its topology builder gives each subscribed queue its way back
// (Bind, as the topology mode says), and, with delayed retries, its queues are
// declared with the arguments RabbitMQ 4.3 needs to hold them. AddHandler does all of
// this. Its topology builder refuses, at subscribe, a queue that its Queue.GenerateName
// did not name (replaced on a copy: use SubscriberConfigFor) and the poison queue (use
// PoisonSubscriberConfig).
func (r *Retry) SubscriberConfig() amqp.Config { return r.configFor(nil) }

// SubscriberConfigFor is SubscriberConfig with generateName naming the queues: the
// Retry sends the retries of each queue it names back to that queue. One Retry serves
// any number of such configs, with one hand-off connection, one topology and one Stats:
// a queue per handler (Watermill's CQRS processors, say) takes one call per handler:
//
//	SubscriberConstructor: func(p cqrs.EventProcessorSubscriberConstructorParams) (message.Subscriber, error) {
//		return amqp.NewSubscriber(retry.SubscriberConfigFor(amqp.GenerateQueueNameTopicNameWithSuffix(p.HandlerName)), logger)
//	},
//
// Give its subscribers' handlers this Retry's Middleware (router.AddMiddleware). The
// Retry remembers each call as long as it lives: call it once per subscriber.
func (r *Retry) SubscriberConfigFor(generateName func(topic string) string) amqp.Config {
	if generateName == nil {
		generateName = r.sub.Queue.GenerateName
	}
	return r.configFor(generateName)
}

func (r *Retry) configFor(generateName func(topic string) string) amqp.Config {
	c := r.sub
	if r.w.InProcess() {
		if generateName != nil {
			c.Queue.GenerateName = generateName
		}
		return c
	}
	q := r.w.For(generateName)
	c.Queue.GenerateName = q.GenerateName
	c.Marshaler = q.Marshaler()
	inner := c.TopologyBuilder
	if inner == nil {
		inner = &amqp.DefaultTopologyBuilder{}
	}
	c.TopologyBuilder = builder{inner: inner, q: q}
	c.Queue.Arguments = r.w.WorkQueueArgs(c.Queue.Arguments)
	return c
}

// PoisonSubscriberConfig returns a subscriber config that reads the poison queue
// (Config().PoisonQueue), whatever the topic subscribed to, with the connection and
// marshaling options of the config given to New: its topology builder declares the
// poison queue with its own arguments (checks it in topology mode verify, nothing in
// mode none), binds no exchange, and its subscribers have no retries. Each message
// carries its failure Envelope (amqpretry.ReadEnvelope). Ack what you have dealt with;
// a nacked message comes back at once.
func (r *Retry) PoisonSubscriberConfig() amqp.Config {
	name, args := r.w.PoisonQueue()
	c := r.sub
	c.Queue.GenerateName = func(string) string { return name }
	c.Queue.Arguments = args
	c.Queue.Durable, c.Queue.Exclusive, c.Queue.AutoDelete = true, false, false
	c.Exchange = amqp.ExchangeConfig{GenerateName: func(string) string { return "" }}
	c.QueueBind = amqp.QueueBindConfig{GenerateRoutingKey: func(string) string { return "" }}
	if r.w.InProcess() {
		return c
	}
	c.Marshaler = r.w.PoisonMarshaler()
	c.TopologyBuilder = poisonBuilder{w: r.w}
	return c
}

// AddHandler adds to router a handler named handlerName that consumes topic through a
// new subscriber built from SubscriberConfig(), with this Retry's Middleware on it:
// the one call that wires subscriber, handler and middleware so that they cannot be
// mismatched. The subscriber, and its connection, is closed when its subscription
// ends: on router.Close(), when the context given to router.Run is cancelled, and on
// the handler's Stop(). In-process, the subscriber is the memory backend's Publisher, which must then
// be a message.Subscriber too (and is left open: it is yours).
func (r *Retry) AddHandler(router *message.Router, handlerName, topic string, handler message.NoPublishHandlerFunc) (*message.Handler, error) {
	return r.w.AddHandler(router, handlerName, topic, handler, func(logger watermill.LoggerAdapter) (message.Subscriber, error) {
		return amqp.NewSubscriber(r.SubscriberConfig(), logger)
	})
}

// builder is the subscriber's topology builder (wamqp.Queues.BuildTopology) over the
// major's own, inner; poisonBuilder that of a subscriber of the poison queue
// (wamqp.Wiring.BuildPoisonTopology). Their BuildTopology, whose signature is the
// major's own, is in topology.go.
type builder struct {
	inner amqp.TopologyBuilder
	q     *wamqp.Queues
}

type poisonBuilder struct{ w *wamqp.Wiring }

func (b builder) ExchangeDeclare(ch *amqp091.Channel, exchange string, config amqp.Config) error {
	e := config.Exchange
	return b.q.DeclareExchange(ch, exchange, e.Type, e.Arguments, func() error { return b.inner.ExchangeDeclare(ch, exchange, config) })
}

func (poisonBuilder) ExchangeDeclare(*amqp091.Channel, string, amqp.Config) error { return nil }

// subscribed is what one subscribe of a subscriber built from c declares.
func subscribed(c amqp.Config, queue, exchange, key, topic string) wamqp.Subscribed {
	return wamqp.Subscribed{Queue: queue, Topic: topic, QueueArgs: c.Queue.Arguments, Exchange: exchange, ExchangeType: c.Exchange.Type,
		ExchangeArgs: c.Exchange.Arguments, Key: key, BindArgs: c.QueueBind.Arguments}
}
