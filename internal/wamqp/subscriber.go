// Package wamqp is the one implementation of the transport packages wamqp2 and wamqp3:
// what a watermill-amqp subscriber config says, read once into Sub, and what the
// subscriber needs of a Retry (its marshaler, its topology builder, its queue
// arguments). The two packages translate their major's types into these, and nothing
// else.
package wamqp

import (
	"crypto/tls"
	"errors"
	"fmt"
	"strings"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/derived"
	"github.com/amqpretry/amqpretry/internal/marshal"
	"github.com/amqpretry/amqpretry/internal/names"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/xdeath"
)

// Sub is what a transport package reads from its watermill-amqp subscriber config.
type Sub struct {
	URI             string
	AMQP            *amqp.Config
	TLS             *tls.Config
	QueueName       func(topic string) string
	NoRequeueOnNack bool
	QueueArgs       amqp.Table
	// Marshaler is the subscriber config's marshaler, which the Retry can use when it
	// is nil (the major's DefaultMarshaler with its defaults) or an xdeath.Marshaler:
	// the transport package converts its major's DefaultMarshaler to one, their fields
	// being the same.
	Marshaler any
}

// marshalOptions returns the options of the subscriber config's marshaler, nil when the
// Retry cannot use it.
func (sub Sub) marshalOptions() *marshal.Options {
	switch m := sub.Marshaler.(type) {
	case nil:
		return &marshal.Options{}
	case xdeath.Marshaler:
		return &marshal.Options{PostprocessPublishing: m.PostprocessPublishing, NotPersistentDeliveryMode: m.NotPersistentDeliveryMode, MessageUUIDHeaderKey: m.MessageUUIDHeaderKey}
	}
	return nil
}

// Wiring is a Retry and what a subscriber config needs to be wired to it.
type Wiring struct {
	Retry *middleware.Retry
	cfg   amqpretry.Config // with defaults
	sub   Sub
	view  backend.Derived // what cfg derives
	amqp  amqp.Config     // the hand-off's connection's, for hint
	// marshal has the options of the subscriber config's marshaler; none where the Retry
	// cannot use it (in-process, where it is not validated).
	marshal marshal.Options
}

// New validates sub and cfg, every invalid field named, and only then builds the
// Retry (middleware.New) with the subscriber config's connection and marshaling.
func New(sub Sub, cfg amqpretry.Config) (*Wiring, error) {
	// What the Config derives, once for the transport: read by its checks (New calls
	// Validate with the Config, defaults applied) and kept for the wiring.
	var view backend.Derived
	validate := func(cfg amqpretry.Config) error {
		view = derived.Of(cfg)
		return sub.validate(cfg, view)
	}
	t := middleware.Transport{URI: sub.URI, Queue: sub.QueueName, QueueArgs: sub.QueueArgs, Validate: validate}
	m := sub.marshalOptions()
	if m != nil {
		t.UUIDHeader, t.NotPersistent, t.Postprocess = m.MessageUUIDHeaderKey, m.NotPersistentDeliveryMode, m.PostprocessPublishing
	}
	switch {
	case sub.AMQP != nil:
		t.AMQP = *sub.AMQP
	default:
		t.AMQP = amqp.Config{TLSClientConfig: sub.TLS, Heartbeat: backend.Heartbeat}
	}
	r, err := middleware.New(cfg, t)
	if err != nil {
		return nil, err
	}
	// With its defaults, and what it derives.
	w := &Wiring{Retry: r, cfg: cfg.WithDefaults(), sub: sub, view: view, amqp: t.AMQP}
	if m != nil {
		w.marshal = *m
	}
	return w, nil
}

// InProcess tells whether the Retry runs without a broker (the memory backend, no
// URI): its subscriber config is then left as it is.
func (w *Wiring) InProcess() bool { return w.sub.URI == "" }

// Marshaler is the subscriber's marshaler: the user's options, with what the Retry
// reads on each delivery (where it was published, the returns RabbitMQ 4.3 counts
// when work queues hold retries), each delivery marked as the Retry's.
func (w *Wiring) Marshaler() marshal.Marshaler {
	o := w.marshal
	o.Retry, o.Delivered = true, w.Retry.Delivered
	o.ReturnedAttempts = w.view.WorkQueueArgs != nil
	return marshal.Marshaler{Options: o}
}

// WorkQueueArgs returns args with what a work queue needs added (with delayed retries:
// a quorum queue that holds returned deliveries, dead-lettering to the poison queue
// unless args name a dead-letter exchange), as a new table; args itself when it needs
// nothing. New has refused args that give one of these another value.
func (w *Wiring) WorkQueueArgs(args amqp.Table) amqp.Table {
	if w.view.WorkQueueArgs == nil && w.cfg.OrderKey == nil {
		return args
	}
	out, _ := backend.MergeWorkQueueArgs(args, w.view.WorkQueueArgs)
	if w.cfg.OrderKey != nil {
		// One consumer at a time: competing consumers would break each key's order.
		out[declare.SingleActiveConsumerArg] = true
	}
	return out
}

// validate reports every invalid field of sub, for cfg (with defaults), v what cfg
// derives.
func (sub Sub) validate(cfg amqpretry.Config, v backend.Derived) error {
	if sub.URI == "" {
		if !v.InProcess {
			return fmt.Errorf("Subscriber: Connection.AmqpURI: required for the %s backend", v.Name)
		}
		return nil
	}
	var errs []error
	if a, ok := v.Backend.(backend.AMQP1); ok {
		errs = append(errs, a.OnAMQP091())
	}
	if sub.QueueName == nil {
		errs = append(errs, errors.New("Subscriber: Queue.GenerateName: required"))
	} else if q := sub.QueueName("amqpretry-topic-1"); q == cfg.PoisonQueue && sub.QueueName("amqpretry-topic-2") == q {
		// A GenerateName that names one queue whatever the topic: the work queue.
		errs = append(errs, fmt.Errorf("PoisonQueue: %q is the work queue, the one queue the subscriber config's Queue.GenerateName names for every topic: a subscriber with retries would send its failures back into it; give the poison queue a name of its own (by default %q)",
			q, names.Names{Prefix: cfg.Prefix}.Poison()))
	}
	if sub.NoRequeueOnNack {
		errs = append(errs, errors.New("Subscriber: Consume.NoRequeueOnNack: must be false, or a failed hand-off would drop the message instead of requeueing it"))
	}
	if sub.marshalOptions() == nil {
		errs = append(errs, fmt.Errorf("Subscriber: Marshaler: %T cannot read dead-lettered messages; use the DefaultMarshaler or xdeath.Marshaler", sub.Marshaler))
	}
	if cfg.OrderKey != nil {
		if sac, ok := sub.QueueArgs[declare.SingleActiveConsumerArg]; ok && sac != true {
			errs = append(errs, fmt.Errorf("Subscriber: Queue.Arguments: %s %v: with Config.OrderKey a work queue has one active consumer, or competing consumers would break each key's order: leave it out (the subscriber config sets it), or set it true", declare.SingleActiveConsumerArg, sac))
		}
	}
	if v.WorkQueueArgs != nil {
		_, conflicts := backend.MergeWorkQueueArgs(sub.QueueArgs, v.WorkQueueArgs)
		for _, c := range conflicts {
			name, _, _ := strings.Cut(c, " ")
			set := ""
			if name == declare.DelayedRetryMinArg || name == declare.DelayedRetryMaxArg {
				set = " (delay.HeldRetries's delay sets it)"
				if _, ok := v.Backend.(backend.Constant); ok {
					set = " (the delayed-retry backend's delay sets it)"
				}
			}
			errs = append(errs, fmt.Errorf("Subscriber: Queue.Arguments: %s: a work queue that holds delayed retries needs %s %s, which the subscriber config adds%s: leave it out of Queue.Arguments",
				c, name, declare.FormatValue(v.WorkQueueArgs[name]), set))
		}
	}
	return errors.Join(errs...)
}

// hint adds the fix to a topology error of a subscriber (backend.Derived's Fix). A work
// queue whose declaration clashed is read over a connection of its own to the broker,
// as the hand-off's (the Retry's own Fix reads it over the hand-off's), closed after.
func (w *Wiring) hint(err error, queue string) error {
	f := w.view.Fix
	var conn *amqp.Connection
	f.Conn = func() (*amqp.Connection, error) {
		c, err := backend.DialConn(w.sub.URI, w.amqp)
		conn = c
		return c, err
	}
	err = f.Hint(err, queue)
	if conn != nil {
		_ = conn.Close()
	}
	return err
}
