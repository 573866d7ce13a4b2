package amqp1

import "errors"

var (
	// ErrClosed is returned by Publish, Subscribe and SubscribeInitialize once the
	// Publisher or Subscriber is closed.
	ErrClosed = errors.New("amqp1: closed")

	// ErrNotAccepted is returned by Publish when the broker settled a message with an
	// outcome other than accepted: rejected (for example a queue at its length limit
	// with overflow reject-publish), released (nothing to route it to, for an
	// /exchanges/... address) or modified. The broker does not have the message.
	ErrNotAccepted = errors.New("amqp1: message not accepted by the broker")

	// ErrNotConfirmed is returned by Publish when the outcome of a message never came:
	// the link or the connection was lost, or PublishTimeout (or the message's context)
	// ran out. The broker may or may not have the message; publishing it again may
	// duplicate it.
	ErrNotConfirmed = errors.New("amqp1: message outcome not confirmed")

	// ErrNotDelivered is returned by Redeliver when the message was not delivered by
	// this package's Subscriber (or its context no longer carries the delivery).
	ErrNotDelivered = errors.New("amqp1: message was not delivered by an amqp1 subscriber")
)
