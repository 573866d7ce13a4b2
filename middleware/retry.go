package middleware

import (
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/derived"
	"github.com/amqpretry/amqpretry/internal/hooks"
)

// Transport is what the retry middleware needs of the transport its messages come
// through: where the hand-off reaches RabbitMQ, how its subscriber names queues and
// marshals messages, and, for a transport whose broker holds a failed delivery itself,
// how to settle one to come back later. The transport packages wamqp3, wamqp2 and amqp1
// build one from their subscriber config; a transport of your own builds its own, and
// its subscriber calls Retry.Delivered on each delivery and, where retries come back
// through the broker, Retry.Bind on each subscribe.
type Transport struct {
	// URI of the broker, over AMQP 0-9-1: the hand-off publishes retries and
	// poisoned messages through it, confirmed, on a connection of its own. It never
	// appears in logs or errors with its password. "" runs in this process: the
	// memory backend only.
	URI string
	// AMQP configures the hand-off's connection (TLS, heartbeat, client properties).
	AMQP amqp.Config
	// UUIDHeader is the header a copy carries the message UUID in, where the
	// subscriber reads it (watermill-amqp's MessageUUIDHeaderKey). Default:
	// watermill-amqp's "_watermill_message_uuid".
	UUIDHeader string
	// NotPersistent and Postprocess are watermill-amqp's marshaler options
	// (NotPersistentDeliveryMode, PostprocessPublishing), applied to every copy.
	NotPersistent bool
	Postprocess   func(amqp.Publishing) amqp.Publishing
	// Queue maps the topic a handler subscribes to onto the queue it consumes, where
	// its retries come back. Default: the topic.
	Queue func(topic string) string
	// QueueArgs are the arguments the subscriber declares its queues with: New warns
	// when the broker's delivery limit on them could drop a message.
	QueueArgs amqp.Table
	// Redeliver settles msg, the delivery that failed, so that the broker holds it
	// until at and delivers it again with the message annotations given: the
	// delivery-time backend runs on it (the AMQP 1.0 transport on RabbitMQ 4.3).
	Redeliver func(msg *message.Message, at time.Time, annotations map[string]any) error
	// Validate, if set, checks the transport's own settings against the Config (with
	// its defaults); New reports its errors with the Config's, before it connects.
	Validate func(cfg amqpretry.Config) error
}

// Retry is the retry middleware: on a handler error it decides what becomes of the
// message (Config.Policy, Config.Classify), sizes the delay with the delay backend,
// stamps the failure Envelope on a copy and hands the copy to the backend, confirmed
// before the delivery is acked (or, for a backend that holds retries in the work
// queue, settles the delivery for the broker to hold), and poisons what failed for
// good. Build it with New, or with the New of your transport package, which also
// gives the subscriber config it needs; Close it after the router.
type Retry struct{ r *retry }

// New validates cfg and t, every invalid field named, and only if both are valid
// connects to the broker at t.URI, refuses a backend the broker cannot run, declares
// (or, in topology mode verify, checks) the backend's topology and the poison queue,
// and builds the middleware. An invalid config touches nothing on the broker.
//
// With the memory backend and no URI, everything stays in this process:
// delay.Memory(...) (a GoChannel, say) receives the retries and the poisoned messages.
func New(cfg amqpretry.Config, t Transport) (*Retry, error) {
	setHooks()
	// What cfg derives (internal/derived), once, handed down with the Config; the
	// policy is checked as cfg gives it (Validate).
	v := derived.Of(cfg)
	withDefaults := cfg.WithDefaults()
	var errs []error
	if t.Validate != nil {
		errs = append(errs, t.Validate(withDefaults))
	}
	if t.Redeliver != nil && v.Backend != nil && !v.AMQP1 {
		errs = append(errs, amqp1Only(withDefaults))
	}
	errs = append(errs, cfg.Validate())
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("invalid config: %w", err)
	}
	if t.URI == "" && !v.InProcess {
		return nil, fmt.Errorf("invalid config: Transport.URI: required for the %s backend", v.Name)
	}
	r, err := start(withDefaults, v, t)
	if err != nil {
		return nil, err
	}
	h := &Retry{r: r}
	// A Retry dropped without Close says so at WARN, and closes its connection.
	runtime.SetFinalizer(h, func(h *Retry) { h.r.forgotten() })
	return h, nil
}

// amqp1Only is the error of cfg's backend on the AMQP 1.0 transport (Transport.Redeliver
// set) when it does not settle a failed delivery with an AMQP 1.0 outcome (the AMQP1
// trait), naming those that do.
func amqp1Only(cfg amqpretry.Config) error {
	var fits []string
	for _, o := range backend.All(cfg.Backend) {
		if b, err := backend.Open(o, backend.Setup{Prefix: cfg.Prefix}); err == nil {
			if _, ok := b.(backend.AMQP1); ok {
				fits = append(fits, b.Name())
			}
		}
	}
	return fmt.Errorf("Backend: %q: the AMQP 1.0 transport retries only with a backend that settles a failed delivery with an AMQP 1.0 outcome (%s): leave Backend empty for its default",
		cfg.Backend.Name(), strings.Join(fits, ", "))
}

// Middleware implements message.HandlerMiddleware: add it to the handler, or to the
// router.
func (r *Retry) Middleware(h message.HandlerFunc) message.HandlerFunc { return r.r.Middleware(h) }

// Stats returns what the middleware did since New.
func (r *Retry) Stats() Stats { return r.r.Stats() }

// Close stops the middleware and closes the backend and the hand-off connection. Close
// the router first: a message that fails after Close is not handed off but nacked for
// redelivery, paced (the first such message is logged at WARN), so nothing is lost
// and the next run retries it. Close waits for the hand-offs in flight, then logs what
// this Retry did since New. A second Close does nothing. A Retry dropped without
// Close is closed when the garbage collector finds it, with a WARN: close it yourself.
func (r *Retry) Close() error { return r.r.close() }

// Delivered marks msg as delivered by a subscriber wired to this Retry, at attempt
// (from 1; 0 keeps the attempt the message's envelope carries): a transport's
// subscriber calls it on each message, before the router runs the handler. The
// middleware hands off only the messages so marked (others fail with
// amqpretry.ErrNotWired), so that a retry never goes where no subscriber of this
// Retry waits for it.
func (r *Retry) Delivered(msg *message.Message, attempt int) { r.r.delivered(msg, attempt, 0) }

// Bind gives queue its way back from the delay backend on ch, as Config.Topology says
// (declares it, checks it, or nothing), and records that retries can come back to
// queue: a transport's subscriber calls it after declaring queue, on every subscribe
// and reconnect. The middleware hands off no retry for a queue never bound
// (amqpretry.ErrNotWired). With delayed retries in topology mode verify it also
// checks that queue is a quorum queue. With Config.OrderKey it forgets what it knew of
// the queue's keys: another consumer may have blocked or released some. A transport
// whose backend keeps every retry in the work queue (no way back) calls it with a nil
// ch.
func (r *Retry) Bind(ch *amqp.Channel, queue string) error { return r.r.bind(ch, queue) }

// setHooks gives internal/hooks its functions, for the root module's own transport
// and tests, once, on the first New: what they reach is a Retry's, so none is called
// before a Retry exists.
var setHooks = sync.OnceFunc(func() {
	hooks.CheckWorkQueue = func(r any, queue string) error { return r.(*Retry).r.checkWorkQueue(queue) }
	hooks.DeliveredFor = func(r any, queue func(topic string) string) func(msg *message.Message, attempt int) {
		h := r.(*Retry)
		if queue == nil {
			return h.Delivered
		}
		fn := h.r.engine.wiring.more.add(queue)
		return func(msg *message.Message, attempt int) { h.r.delivered(msg, attempt, fn) }
	}
	hooks.Scheduler = func(r any) message.Publisher { return r.(*Retry).r.scheduler() }
})
