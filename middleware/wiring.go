package middleware

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/topology"
)

// Wiring: what the engine knows of its subscriber side, and the queues bound for
// retries (bind). A delivery's mark (mark, engine.go) is resolved once, on receipt
// (resolve, engine.go); whether the message is this Retry's to hand off is the failure path's first
// step (checkWiring, copy.go); the Retry middlewares a message passes through are
// recorded on receipt (read, engine.go).

// wiring is what the engine needs to know of the subscriber side.
type wiring struct {
	// ID identifies the Retry; its subscriber's marshaler stamps it on every delivery
	// (keys.Subscriber). "" means every message is this Retry's (in-process).
	ID string
	// Queue maps the topic a handler subscribes to onto the queue its messages come
	// from, where a retry must come back. Default: the topic.
	Queue func(topic string) string
	// Bound are the queues whose way back this Retry's subscriber declared (bind).
	// Nil: not checked.
	Bound *queueSet
	// more are the queue-name functions of subscribers that name queues otherwise
	// than Queue (hooks.DeliveredFor): the n-th (from 1) marks its deliveries
	// "<ID>/<n>".
	more queueFuncs
}

// queueSet is a set of queue names that grows while the engine reads it.
type queueSet struct {
	mu sync.Mutex
	m  map[string]bool
}

// add adds queue to the set.
func (s *queueSet) add(queue string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m == nil {
		s.m = map[string]bool{}
	}
	s.m[queue] = true
}

// queueFuncs is a list that grows while the engine reads it: copied on write.
type queueFuncs struct {
	mu sync.Mutex // serializes writers
	fs atomic.Pointer[[]func(topic string) string]
}

// add registers f, returning its number, from 1.
func (q *queueFuncs) add(f func(topic string) string) int {
	q.mu.Lock()
	defer q.mu.Unlock()
	var fs []func(string) string
	if old := q.fs.Load(); old != nil {
		fs = append(fs, *old...)
	}
	fs = append(fs, f)
	q.fs.Store(&fs)
	return len(fs)
}

// bind gives queue its way back, on ch, as the topology mode says (declare, check,
// nothing), and records that it did (Retry.Bind).
func (r *retry) bind(ch *amqp.Channel, queue string) error {
	if err := r.checkWorkQueueType(queue); err != nil {
		return err
	}
	if r.engine.backend != nil {
		if ch == nil && r.cfg.Topology != topology.ModeNone {
			return fmt.Errorf("retry topology for queue %q: no channel to declare it on", queue)
		}
		if err := r.engine.backend.WorkQueue(queue).Apply(ch, r.cfg.Topology); err != nil {
			return fmt.Errorf("retry topology for queue %q: %w", queue, r.view.Fix.Hint(err, queue))
		}
	}
	if r.wiring.Bound != nil {
		r.wiring.Bound.add(queue)
	}
	if r.order != nil {
		// A new consumer: another may have blocked or released keys meanwhile.
		r.order.forget(queue)
	}
	return nil
}

// checkWorkQueueType refuses, in topology mode verify with delayed retries, a work
// queue that exists as another type than quorum: its passive declaration passed, but
// the broker would redeliver every nack at once. Mode declare has declared it with the
// arguments already (a clash fails there, see Hint, and AddHandler has checked it
// before: checkWorkQueue).
func (r *retry) checkWorkQueueType(queue string) error {
	if r.cfg.Topology != topology.ModeVerify {
		return nil
	}
	return r.checkWorkQueue(queue)
}

// checkWorkQueue refuses, with delayed retries (Backend delayed-retry or delay.HeldRetries),
// a work queue that exists as another type than quorum, read passively over the
// hand-off's connection, in topology modes declare and verify; mode none checks
// nothing. A queue that does not exist yet passes (the subscriber declares it), and so
// does one whose type cannot be read over AMQP (no configure permission): the engine
// notices at the first retry instead.
func (r *retry) checkWorkQueue(queue string) error {
	if r.cfg.Topology == topology.ModeNone || !r.view.Fix.HoldsRetries || r.handoff == nil {
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

// isBound tells whether queue's way back was bound (bind): always when not checked.
func (r *retry) isBound(queue string) bool {
	s := r.wiring.Bound
	if s == nil {
		return true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.m[queue]
}

// refuseUnread is the subscribers' marshalers' refusal of a message redelivered after
// its handler failed without this Retry's middleware (marshal.Reads): it is counted
// as a failed hand-off, the first of its subscriber logged at ERROR with the fix, and
// paced, so that nothing loops at wire speed. The refusal nacks it, with requeue.
func (r *retry) refuseUnread(msg *message.Message, refusals int, first, outside bool) error {
	if outside {
		// A middleware outside the Retry failed it: paced, then it runs again.
		if first {
			warn(r.cfg.Logger, "Message redelivered after a middleware outside the Retry failed it: each redelivery paced,", fmt.Errorf("message %s: a middleware added outside the Retry (router.AddMiddleware before it, an open CircuitBreaker or a RandomFail, say) failed it before the Retry saw it, and the broker redelivers it at once; it waits %s, longer each time, before it runs again: put that middleware inside the Retry (docs/watermill-middlewares.md)", msg.UUID, backend.HandoffPause(refusals)), watermill.LogFields{
				"message_uuid": msg.UUID, "delivery_routing_key": msg.Metadata[keys.DeliveryRoutingKey], "redeliveries": refusals, "said": "once",
			})
		}
		pauseUntil(context.Background(), backend.HandoffPause(refusals), r.engine.life.closing())
		return nil
	}
	err := fmt.Errorf("%w: message %s came back after its handler failed, and no middleware of this Retry has read a message of its subscriber, built from the Retry's config: the handler has no retry middleware, so the broker would redeliver it at once, again and again; it is refused, and nacked after a pause, until the handler has one: add the handler with Retry.AddHandler, or add Retry.Middleware to the handler (handler.AddMiddleware) or to the router (router.AddMiddleware)",
		amqpretry.ErrNotWired, msg.UUID)
	r.engine.stats.failures.Add(1)
	if first {
		r.cfg.Logger.Error("Message redelivered after its handler failed without the retry middleware: refused, paced", err, watermill.LogFields{
			"message_uuid": msg.UUID, "delivery_routing_key": msg.Metadata[keys.DeliveryRoutingKey], "refusals": refusals, "said": "once",
		})
	}
	pauseUntil(context.Background(), backend.HandoffPause(refusals), r.engine.life.closing())
	return err
}
