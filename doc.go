// Package amqpretry turns a Watermill handler error into a delayed redelivery parked in
// RabbitMQ, instead of a sleep inside the handler.
//
// When a handler fails, the retry middleware hands a copy of the message to a delay
// backend, which parks it in the broker and lets the broker bring it back, after the
// backoff, to the queue that failed and only to it. The original is acked only once the
// broker has confirmed the copy; if the hand-off cannot be confirmed the original is
// nacked and requeued, so nothing is lost. The attempt number travels in the message's
// own metadata (middleware.AttemptKey); when attempts run out, or the error is marked
// middleware.Permanent, the message goes to a poison queue with a failure envelope.
//
// Healthy messages keep flowing while failed ones wait in the broker: nothing waits in
// the process, no memory is held per waiting message, and waiting messages survive a
// restart of the application (and of the broker, with the durable backends).
//
// # The common case
//
//	amqpCfg := amqp.NewDurableQueueConfig(uri) // or a pub/sub config
//	retry, err := amqpretry.New(amqpretry.Config{
//		Subscriber: amqpCfg,
//		Delay:      delay.Config{Backend: "ttl-tiers"}, // or from configuration
//		Policy:     middleware.Policy{MaxAttempts: 5},
//	})
//	_, err = retry.AddHandler(router, "orders", "orders", handle)
//
// AddHandler builds the subscriber from SubscriberConfig(), adds the handler and puts
// the retry middleware on it, in one call that cannot be mis-wired. SubscriberConfig
// returns the subscriber config with the marshaler that reads dead-lettered messages
// (package xdeath) and records which Retry's subscriber delivered each message, and a
// topology builder that binds each subscribed queue to the backend's delivery exchange,
// again after every reconnect.
//
// A Retry acts only on messages its own subscriber config delivered. With pub/sub
// configs, where several subscriber groups read one fanout topic through queues of
// their own, build one Retry per group: whether each is wired with AddHandler or all
// their middlewares are added router-wide, each retry comes back to the group that
// failed, never to the others. A message that no Retry on its handler can route back
// (a subscriber not built from SubscriberConfig) fails loudly with
// middleware.ErrNotWired, naming the fix, and is poisoned after Config.HandoffAttempts
// tries; it is never parked silently.
//
// # Packages
//
//   - middleware: the retry middleware on its own (Policy, Permanent, RetryAfter,
//     Classify, the failure envelope's metadata keys).
//   - delay: the delay backends behind one interface, chosen by name (ttl-tiers,
//     binary-levels, delayed-exchange, memory), and the confirmed hand-off.
//   - topology: declarations, idempotent, with errors that name what clashes.
//   - xdeath: x-death parsing and the marshaler that accepts every broker header.
package amqpretry
