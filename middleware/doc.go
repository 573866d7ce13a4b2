// Package middleware is the retry middleware: a Watermill HandlerMiddleware that turns
// a handler error into a delayed copy handed to a delay publisher, and a poisoned copy
// once attempts run out.
//
// # What happens on an error
//
// The handler's error is classified: Permanent errors go to the poison topic at once;
// RetryAfter errors are retried after the delay they carry; any other error is retried
// after the Policy's delay. A Classify function may decide for any error (it receives the
// default decision). For a retry, a copy of the message, with AttemptKey set to the next
// attempt, the failure recorded in its metadata and Watermill's delay metadata
// (components/delay) set to the delay, is published to the Delay publisher with the
// failing queue's name as topic. For a poisoning, a copy with the failure envelope goes
// to the Poison publisher.
//
// The middleware returns nil, so that the router acks the original, only when that
// publish returned nil; RabbitMQ backends return only once the broker has confirmed the
// copy. If the publish fails, the middleware pauses (100ms, doubling to 5s, for each
// failure of the same message in a row), then returns the handler's error joined with
// ErrHandoff and the router nacks the original, which watermill-amqp requeues (keep
// Consume.NoRequeueOnNack false). After RetryConfig.HandoffAttempts such failures the
// message is poisoned instead (PoisonHandoffFailed). A copy the broker would refuse as
// larger than its frame_max (delay.ErrTooLarge) has its envelope trimmed, then is
// poisoned (PoisonTooLarge) without its largest headers (DroppedHeadersKey). The
// incoming message's metadata and payload are never modified.
//
// # Several Retry middlewares
//
// With RetryConfig.Subscriber set, a Retry acts only on messages its own subscriber
// delivered (xdeath.SubscriberKey), leaves those of another Retry on the same handler to
// it, and fails the others with ErrNotWired, naming the fix.
//
// # The attempt count
//
// AttemptKey is our own metadata key (not "x-"). It is never derived from x-death or
// x-delivery-count: RabbitMQ 4.0+ ignores a client's x-death, and both restart whenever a
// copy is republished. Read it in a handler with Attempt(msg).
//
// # The failure envelope
//
// Retried and poisoned copies carry: ErrorKey (truncated to MaxErrorBytes),
// ErrorTypesKey (the Go types of the error chain), FirstFailureKey, LastFailureKey,
// HandlerKey, TopicKey, QueueKey, OriginalExchangeKey and OriginalRoutingKeyKey.
// Poisoned copies also carry PoisonReasonKey, AttemptKey and MaxAttemptsKey. Every field
// is bounded, so the envelope stays a few KiB at most, far below RabbitMQ's frame_max.
package middleware
