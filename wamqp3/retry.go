package wamqp3

import (
	"fmt"
	"runtime"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	amqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/marshal"
	"github.com/amqpretry/amqpretry/internal/retry"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/xdeath"
)

// Retry is the retry middleware for subscribers built from watermill-amqp v3
// configs. Build it with New, add each handler with AddHandler (or build its
// subscriber from SubscriberConfig and add Middleware to it or to the router), and
// Close it after the router.
type Retry struct {
	r   *retry.Retry
	sub amqp.Config
}

// New validates sub and cfg, every invalid field named, and only if both are valid
// connects to the broker at sub's URI, refuses a backend the broker cannot run,
// declares (or, in topology mode verify, checks) the backend's topology and the poison
// queue, and builds the middleware. An invalid config touches nothing on the broker.
//
// With the memory backend and no URI in sub, everything stays in this process:
// Config.Memory (a GoChannel, say) receives the retries and the poisoned messages.
func New(sub amqp.Config, cfg amqpretry.Config) (*Retry, error) {
	s := retry.Sub{
		URI: sub.Connection.AmqpURI, AMQP: sub.Connection.AmqpConfig, TLS: sub.Connection.TLSConfig,
		QueueName: sub.Queue.GenerateName, NoRequeueOnNack: sub.Consume.NoRequeueOnNack, QueueArgs: sub.Queue.Arguments,
		MarshalerType: fmt.Sprintf("%T", sub.Marshaler),
	}
	switch m := sub.Marshaler.(type) {
	case nil:
		s.Marshal = &marshal.Options{}
	case amqp.DefaultMarshaler:
		s.Marshal = &marshal.Options{PostprocessPublishing: m.PostprocessPublishing, NotPersistentDeliveryMode: m.NotPersistentDeliveryMode, MessageUUIDHeaderKey: m.MessageUUIDHeaderKey}
	case xdeath.Marshaler:
		s.Marshal = &marshal.Options{PostprocessPublishing: m.PostprocessPublishing, NotPersistentDeliveryMode: m.NotPersistentDeliveryMode, MessageUUIDHeaderKey: m.MessageUUIDHeaderKey}
	}
	r, err := retry.New(s, cfg)
	if err != nil {
		return nil, err
	}
	w := &Retry{r: r, sub: sub}
	// A Retry dropped without Close says so at WARN, and closes its connection.
	runtime.SetFinalizer(w, func(w *Retry) { w.r.Forgotten() })
	return w, nil
}

// Middleware implements message.HandlerMiddleware: add it to the handler, or to the
// router.
func (r *Retry) Middleware(h message.HandlerFunc) message.HandlerFunc { return r.r.Middleware(h) }

// SubscriberConfig returns the subscriber config given to New, ready for
// amqp.NewSubscriber: its marshaler reads every header and records which Retry
// delivered each message, its topology builder gives each subscribed queue its way
// back (as the topology mode says), and, with delayed retries, its queues are declared
// with the arguments RabbitMQ 4.3 needs to hold them. AddHandler does all of this.
func (r *Retry) SubscriberConfig() amqp.Config {
	c := r.sub
	if r.r.InProcess() {
		return c
	}
	c.Marshaler = marshal.Marshaler{Options: r.r.SubscriberMarshal()}
	inner := c.TopologyBuilder
	if inner == nil {
		inner = &amqp.DefaultTopologyBuilder{}
	}
	c.TopologyBuilder = builder{inner: inner, r: r.r}
	c.Queue.Arguments = r.r.WorkQueueArgs(c.Queue.Arguments)
	return c
}

// AddHandler adds to router a handler named handlerName that consumes topic through a
// new subscriber built from SubscriberConfig(), with this Retry's Middleware on it:
// the one call that wires subscriber, handler and middleware so that they cannot be
// mismatched. The subscriber, and its connection, is closed when its subscription
// ends: on router.Close(), when the context given to router.Run is cancelled, and on
// the handler's Stop(). In-process, the subscriber is Config.Memory, which must then
// be a message.Subscriber too (and is left open: it is yours).
func (r *Retry) AddHandler(router *message.Router, handlerName, topic string, handler message.NoPublishHandlerFunc) (*message.Handler, error) {
	return r.r.AddHandler(router, handlerName, topic, handler, func() (message.Subscriber, error) {
		return amqp.NewSubscriber(r.SubscriberConfig(), r.r.Config().Logger)
	})
}

// Retryable tells whether running the handler again in this process could help after
// err, as this Retry decides: not for a failed hand-off (amqpretry.ErrHandoff), nor
// when the error is Permanent or asks for a delay (RetryAfter, or Config.Classify
// deciding so; Classify is asked without a message). Give it to Watermill's
// middleware.Retry if you keep that inside this one for in-process retries:
//
//	wmiddleware.Retry{MaxRetries: 2, ShouldRetry: func(p wmiddleware.RetryParams) bool { return retry.Retryable(p.Err) }}
//
// Policy.Immediate does the same without a second middleware.
func (r *Retry) Retryable(err error) bool { return r.r.Retryable(err) }

// Scheduler returns a message.Publisher through which any code can schedule a delayed
// message to a queue a subscriber of this Retry consumes: it reads Watermill's delay
// metadata (components/delay) and parks the message in the backend. Nil for the
// delayed-retry backend, which holds only the deliveries that failed.
func (r *Retry) Scheduler() message.Publisher { return r.r.Scheduler() }

// Stats returns what the middleware did since New.
func (r *Retry) Stats() middleware.Stats { return r.r.Stats() }

// Close stops the middleware and closes the backend and the hand-off connection. Close
// the router first: a message that fails after Close is not handed off but nacked for
// redelivery, paced (the first such message is logged at WARN), so nothing is lost
// and the next run retries it. Close waits for the hand-offs in flight, then logs what
// this Retry did since New. A second Close does nothing. A Retry dropped without
// Close is closed when the garbage collector finds it, with a WARN: close it yourself.
func (r *Retry) Close() error { return r.r.Close() }

// builder is the subscriber's topology builder (retry.Retry.BuildTopology) over the
// major's own, inner.
type builder struct {
	inner amqp.TopologyBuilder
	r     *retry.Retry
}

func (b builder) BuildTopology(ch *amqp091.Channel, params amqp.BuildTopologyParams, config amqp.Config, logger watermill.LoggerAdapter) error {
	s := subscribed(params.QueueName, params.ExchangeName, params.RoutingKey, config)
	return b.r.BuildTopology(ch, s, func() error { return b.inner.BuildTopology(ch, params, config, logger) })
}

func (b builder) ExchangeDeclare(ch *amqp091.Channel, exchange string, config amqp.Config) error {
	return b.r.DeclareExchange(ch, exchange, exchangeSpec(config), func() error { return b.inner.ExchangeDeclare(ch, exchange, config) })
}

func subscribed(queue, exchange, key string, c amqp.Config) retry.Subscribed {
	q := c.Queue
	return retry.Subscribed{
		Queue: queue, Exchange: exchange, Key: key,
		QueueSpec:    retry.QueueSpec{Durable: q.Durable, AutoDelete: q.AutoDelete, Exclusive: q.Exclusive, NoWait: q.NoWait, Args: q.Arguments},
		ExchangeSpec: exchangeSpec(c),
		BindNoWait:   c.QueueBind.NoWait, BindArgs: c.QueueBind.Arguments,
	}
}

func exchangeSpec(c amqp.Config) retry.ExchangeSpec {
	e := c.Exchange
	return retry.ExchangeSpec{Type: e.Type, Durable: e.Durable, AutoDelete: e.AutoDeleted, Internal: e.Internal, NoWait: e.NoWait, Args: e.Arguments}
}
