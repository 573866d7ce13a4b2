package middleware

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
)

// Wiring: what the engine knows of its subscriber side, and whether a message is this
// Retry's to hand off (checkWiring).

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
