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
//	sub, err := amqp.NewSubscriber(retry.SubscriberConfig(), logger)
//	router.AddMiddleware(retry.Middleware)
//	router.AddConsumerHandler("orders", "orders", sub, handle)
//
// SubscriberConfig returns the subscriber config with the marshaler that reads
// dead-lettered messages (package xdeath) and a topology builder that binds each
// subscribed queue to the backend's delivery exchange, again after every reconnect.
//
// One Retry serves the handlers whose queues Config.Subscriber names. With pub/sub
// configs, where several subscriber groups read one fanout topic through queues of their
// own, build one Retry per group and add its Middleware to that group's handler: each
// retry comes back to the group that failed, never to the others.
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
