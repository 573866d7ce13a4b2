// Package wamqp3 wires amqpretry into watermill-amqp v3
// (github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp): New builds the retry from your subscriber config and an
// amqpretry.Config, AddHandler adds a handler with its subscriber and the middleware in
// one call. Import it if your program uses watermill-amqp v3; it compiles no
// code of the other major.
//
//	amqpCfg := amqp.NewDurableQueueConfig(uri)
//	retry, err := wamqp3.New(amqpCfg, amqpretry.Config{Policy: amqpretry.Policy{MaxAttempts: 5}})
//	if err != nil { ... }
//	defer retry.Close() // after the router
//	_, err = retry.AddHandler(router, "orders", "orders", handle)
//
// SubscriberConfig returns the subscriber config ready to use: its marshaler reads
// dead-lettered messages (which the DefaultMarshaler refuses forever) and records
// which Retry delivered each message, and its topology builder gives each subscribed
// queue its way back from the delay backend, again after every reconnect. A Retry acts
// only on messages its own subscriber config delivered, so the middlewares of several
// subscriber groups on one fanout topic, added in any order, each serve their own
// group; a message no Retry on its handler can route back is poisoned at its first
// failure with amqpretry.ErrNotWired, naming the fix, and a message of a subscriber
// built from SubscriberConfig whose handler has no middleware of the Retry is refused
// when it comes back after a failure, paced, with the same error.
//
// One Retry serves subscribers that name their queues in other ways: a queue per
// handler, as Watermill's CQRS processors build them, takes one SubscriberConfigFor
// call per handler, with one hand-off connection, one topology and one Stats for all
// (docs/cqrs.md). A subscriber whose queue the Retry would not send retries to (a copy
// of SubscriberConfig() with a Queue.GenerateName of its own) is refused when it
// subscribes, with amqpretry.ErrNotWired. PoisonSubscriberConfig reads the poison
// queue.
package wamqp3

//go:generate go run ../internal/cmd/majorgen ../internal/cmd/majorgen/retry.go.in retry.go
