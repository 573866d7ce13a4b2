package middleware

import (
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
)

// owns tells whether msg is this Retry's to count: delivered by its subscriber, or any
// message when RetryConfig.Subscriber is not set.
func (r *Retry) owns(msg *message.Message) bool {
	return r.cfg.Subscriber == "" || r.cfg.Owner(msg) == r.cfg.Subscriber
}

// errOtherRetry: the message is another Retry's, and that Retry is on the handler too.
var errOtherRetry = errors.New("message of another retry middleware on this handler")

// checkWiring tells whether this Retry may hand off msg: nil, errOtherRetry, or an
// error wrapping ErrNotWired that names the fix.
func (r *Retry) checkWiring(msg *message.Message, f failure) error {
	if r.cfg.Subscriber == "" {
		return nil
	}
	switch owner := r.cfg.Owner(msg); {
	case owner == r.cfg.Subscriber:
	case owner == "":
		return fmt.Errorf("%w: message %s on handler %q was not delivered by a subscriber built from this Retry's SubscriberConfig(), so where its retry must go is unknown; build the subscriber from Retry.SubscriberConfig(), or add the handler with Retry.AddHandler", ErrNotWired, msg.UUID, f.handler)
	case inChain(msg, owner):
		return errOtherRetry
	default:
		return fmt.Errorf("%w: message %s on handler %q was delivered by the subscriber of another amqpretry.Retry, whose middleware is not on this handler; add that Retry's Middleware to the handler, or add the handler with its AddHandler", ErrNotWired, msg.UUID, f.handler)
	}
	if r.cfg.CheckQueue != nil {
		if err := r.cfg.CheckQueue(f.queue); err != nil {
			return fmt.Errorf("%w: handler %q: %w", ErrNotWired, f.handler, err)
		}
	}
	return nil
}
