package middleware

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/topology"
)

// Wiring: what the engine knows of its subscriber side: the queues bound for retries
// (bind), the Retry middlewares a message passes through (joinChain), and whether a
// message is this Retry's to hand off (checkWiring).

// wiring is what the engine needs to know of the subscriber side.
type wiring struct {
	// ID identifies the Retry; its subscriber's marshaler stamps it on every delivery
	// (keys.Subscriber). "" means every message is this Retry's (in-process).
	ID string
	// Queue maps the topic a handler subscribes to onto the queue its messages come
	// from, where a retry must come back. Default: the topic.
	Queue func(topic string) string
	// Bound tells whether a queue's way back was declared by this Retry's subscriber.
	// Nil: not checked.
	Bound func(queue string) bool
}

// chain lists the Retry middlewares (by wiring.ID) a message passes through.
type chain struct {
	mu  sync.Mutex
	ids []string
}

type chainKey struct{}

// joinChain records id in msg's context. The chain is shared by every middleware of
// the handler, so an outer one sees the inner ones after the handler returns.
func joinChain(msg *message.Message, id string) {
	c, _ := msg.Context().Value(chainKey{}).(*chain)
	if c == nil {
		c = &chain{}
		msg.SetContext(context.WithValue(msg.Context(), chainKey{}, c))
	}
	c.mu.Lock()
	c.ids = append(c.ids, id)
	c.mu.Unlock()
}

// inChain tells whether the Retry id is among the middlewares msg passes through.
func inChain(msg *message.Message, id string) bool {
	c, _ := msg.Context().Value(chainKey{}).(*chain)
	if c == nil {
		return false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Contains(c.ids, id)
}

// errOtherRetry: the message is another Retry's, and that Retry is on the handler too.
var errOtherRetry = errors.New("message of another retry middleware on this handler")

// checkWiring tells whether this Retry may hand off d: nil, errOtherRetry, or an
// error wrapping ErrNotWired that names the fix.
func (e *engine) checkWiring(d delivery) error {
	if e.wiring.ID == "" {
		return nil
	}
	switch {
	case d.owner == e.wiring.ID:
	case d.owner == "":
		return fmt.Errorf("%w: message %s on handler %q was not delivered by a subscriber built from this Retry's SubscriberConfig(), so where its retry must go is unknown; build the subscriber from Retry.SubscriberConfig(), or add the handler with Retry.AddHandler", amqpretry.ErrNotWired, d.msg.UUID, d.handler)
	case inChain(d.msg, d.owner):
		return errOtherRetry
	default:
		return fmt.Errorf("%w: message %s on handler %q was delivered by the subscriber of another Retry, whose middleware is not on this handler; add that Retry's Middleware to the handler, or add the handler with its AddHandler", amqpretry.ErrNotWired, d.msg.UUID, d.handler)
	}
	if e.wiring.Bound != nil && !e.wiring.Bound(d.queue) {
		return fmt.Errorf("%w: handler %q: queue %q was never bound for retries by a subscriber built from this Retry's SubscriberConfig(), so a retry could not come back to it", amqpretry.ErrNotWired, d.handler, d.queue)
	}
	return nil
}

// bind gives queue its way back, on ch, as the topology mode says (declare, check,
// nothing), and records that it did (Retry.Bind).
func (r *retry) bind(ch *amqp.Channel, queue string) error {
	if err := r.checkWorkQueueType(queue); err != nil {
		return err
	}
	if r.engine.backend != nil {
		if err := r.engine.backend.WorkQueue(queue).Apply(ch, r.cfg.Topology); err != nil {
			return fmt.Errorf("retry topology for queue %q: %w", queue, r.view.Fix.Hint(err, queue))
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.bound == nil {
		r.bound = map[string]bool{}
	}
	r.bound[queue] = true
	return nil
}

// checkWorkQueueType refuses, in topology mode verify with delayed retries, a work
// queue that exists as another type than quorum: its passive declaration passed, but
// the broker would redeliver every nack at once. Mode declare has declared it with the
// arguments already (a clash fails there, see Hint); without configure permission the
// type cannot be read over AMQP, and the engine notices at the first retry instead.
func (r *retry) checkWorkQueueType(queue string) error {
	if r.cfg.Topology != topology.ModeVerify || !r.view.Fix.HoldsRetries || r.handoff == nil {
		return nil
	}
	conn, err := r.handoff.Connection()
	if err != nil {
		return fmt.Errorf("check the type of work queue %q: %w", queue, err)
	}
	t, known, err := declare.QueueType(conn, queue)
	switch {
	case err != nil:
		return fmt.Errorf("check the type of work queue %q: %w", queue, err)
	case known && t != declare.QueueTypeQuorum:
		return fmt.Errorf("%s: %w", declare.WrongQueueTypeFix(queue, t), topology.ErrMismatch)
	}
	return nil
}

func (r *retry) isBound(queue string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.bound[queue]
}
