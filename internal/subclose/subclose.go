// Package subclose closes a subscriber when the context of its subscription is done.
//
// Watermill's router closes a handler's subscriber on router.Close() only: a Run whose
// context is cancelled, or a Handler.Stop(), ends the subscription but leaves the
// subscriber, and its AMQP connection, open. The transport packages' AddHandler builds
// the subscriber itself and returns none to close, so it wraps it in OnDone.
package subclose

import (
	"context"

	"github.com/ThreeDotsLabs/watermill/message"
)

// OnDone returns s, closed when the context of its Subscribe is done. Closing s more
// than once (the router's Close, then this) must be harmless, as it is for
// watermill-amqp's subscribers.
func OnDone(s message.Subscriber) message.Subscriber { return onDone{s} }

type onDone struct{ message.Subscriber }

func (s onDone) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	msgs, err := s.Subscriber.Subscribe(ctx, topic)
	if err != nil {
		return nil, err
	}
	go func() {
		<-ctx.Done()
		_ = s.Subscriber.Close()
	}()
	return msgs, nil
}
