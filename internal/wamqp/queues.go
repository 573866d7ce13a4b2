package wamqp

import (
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/hooks"
	"github.com/amqpretry/amqpretry/internal/marshal"
	"github.com/amqpretry/amqpretry/internal/names"
	"github.com/amqpretry/amqpretry/topology"
)

// Queues is one way of naming queues, a Queue.GenerateName, as a subscriber config the
// Retry made uses it: the Retry marks the deliveries of the config's subscribers as
// coming from a queue it names (hooks.DeliveredFor), and the config's
// topology builder refuses a queue its GenerateName did not name, which the Retry
// would send no retry to.
type Queues struct {
	w         *Wiring
	name      func(topic string) string
	delivered func(msg *message.Message, attempt int)
	guard     *marshal.Guard // nil in-process

	mu    sync.Mutex
	named map[string]bool // the queues GenerateName named
}

// For returns the way of naming queues name is; nil for the subscriber config's own,
// given to New.
func (w *Wiring) For(name func(topic string) string) *Queues {
	q := &Queues{w: w, name: w.sub.QueueName, delivered: w.Retry.Delivered, named: map[string]bool{}}
	if !w.InProcess() {
		// Attached to the Retry's record of reads by its first message (marshal.NewGuard).
		q.guard = marshal.NewGuard()
	}
	if name != nil {
		q.name, q.delivered = name, hooks.DeliveredFor(w.Retry, name)
	}
	return q
}

// GenerateName is the subscriber config's Queue.GenerateName: the queue name names for
// topic, recorded.
func (q *Queues) GenerateName(topic string) string {
	queue := q.name(topic)
	q.mu.Lock()
	q.named[queue] = true
	q.mu.Unlock()
	return queue
}

// Marshaler is the subscriber's marshaler (Wiring.Marshaler), marking each delivery as
// coming from a queue of this way of naming, and refusing the redelivery of a message
// whose handler failed without the Retry's middleware (marshal.Reads).
func (q *Queues) Marshaler() marshal.Marshaler {
	m := q.w.Marshaler()
	m.Delivered, m.Guard = q.delivered, q.guard
	return m
}

// BuildTopology is Wiring.BuildTopology after a check that the Retry sends the retries
// of s.Queue back to it: the config's GenerateName named it (and, where the major says
// which topic is subscribed, named it for that topic). It refuses the poison queue,
// which a subscriber with retries would feed its own failures.
func (q *Queues) BuildTopology(ch *amqp.Channel, s Subscribed, declareInner func() error) error {
	if err := q.check(s); err != nil {
		return err
	}
	return q.w.BuildTopology(ch, s, declareInner)
}

func (q *Queues) check(s Subscribed) error {
	if s.Queue == q.w.cfg.PoisonQueue {
		return q.w.poisonAsWorkQueue(s.Queue)
	}
	q.mu.Lock()
	named := q.named[s.Queue]
	q.mu.Unlock()
	if named && (s.Topic == "" || q.name(s.Topic) == s.Queue) {
		return nil
	}
	instead := ""
	if s.Topic != "" {
		instead = fmt.Sprintf(" (it would send the retries of topic %q to queue %q)", s.Topic, q.name(s.Topic))
	}
	return fmt.Errorf("%w: the subscriber binds queue %q, which this Retry would not send its retries to%s: its config's Queue.GenerateName is not the one the Retry made the config with (replaced on a copy of SubscriberConfig(), say); make the config with Retry.SubscriberConfigFor(yourGenerateName) instead: the Retry then sends each queue's retries back to it",
		amqpretry.ErrNotWired, s.Queue, instead)
}

// poisonAsWorkQueue is the refusal of queue, the poison queue, as a work queue: before
// the handler is added (AddHandler) and before anything is declared (BuildTopology).
func (w *Wiring) poisonAsWorkQueue(queue string) error {
	stray := ""
	if !w.InProcess() && w.cfg.Topology == topology.ModeDeclare {
		stray = fmt.Sprintf(" (New declared it as the poison queue: then delete it, `rabbitmqctl delete_queue %s`, once nothing in it is needed, so that the subscriber can declare the work queue)", queue)
	}
	return fmt.Errorf("%w: queue %q is this Retry's poison queue (Config.PoisonQueue): a subscriber with retries would send its failures back into it; if it is a work queue, give the poison queue a name of its own (by default %q)%s; to read the poison queue, use a subscriber built from Retry.PoisonSubscriberConfig()",
		amqpretry.ErrNotWired, queue, names.Names{Prefix: w.cfg.Prefix}.Poison(), stray)
}

// DeclareExchange is Wiring.DeclareExchange.
func (q *Queues) DeclareExchange(ch *amqp.Channel, exchange, kind string, args amqp.Table, declareInner func() error) error {
	return q.w.DeclareExchange(ch, exchange, kind, args, declareInner)
}

// PoisonQueue is the poison queue's name, and the arguments it is declared with.
func (w *Wiring) PoisonQueue() (string, amqp.Table) {
	q := declare.ReviewQueue(w.cfg.PoisonQueue, "poison")
	return q.Name, q.Args
}

// BuildPoisonTopology is the topology builder of a subscriber of the poison queue: it
// declares the poison queue with its own arguments, checks it in topology mode verify,
// or does nothing in mode none; and refuses any other queue.
func (w *Wiring) BuildPoisonTopology(ch *amqp.Channel, queue string) error {
	name, args := w.PoisonQueue()
	if queue != name {
		return fmt.Errorf("the subscriber of poison queue %q binds queue %q: keep the Queue.GenerateName of Retry.PoisonSubscriberConfig(), which names the poison queue for any topic", name, queue)
	}
	t := topology.Topology{Queues: []topology.Queue{{Name: name, Role: "poison", Args: args}}}
	if err := t.Apply(ch, w.cfg.Topology); err != nil {
		return fmt.Errorf("poison queue (topology mode %s): %w", w.cfg.Topology, w.hint(err, ""))
	}
	return nil
}

// PoisonMarshaler is the marshaler of a subscriber of the poison queue: the user's
// options, reading every header (dead-lettered or not), marking nothing as the Retry's.
func (w *Wiring) PoisonMarshaler() marshal.Marshaler {
	return marshal.Marshaler{Options: w.marshal}
}
