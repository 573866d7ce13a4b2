// Package delay has the delay backends: Backend, the interface of a backend as
// configured (the type of amqpretry.Config.Backend), sealed, and the constructors of
// its values, each with its own settings: TTLTiers (the default), BinaryLevels,
// DelayedExchange, DelayedRetry, DeliveryTime, Memory, and HeldRetries, which holds the
// first retries in the work queue in front of another; Parse for a backend named by
// configuration; and the errors they return. The backends are the library's: their
// implementations, one file per backend (ttltiers.go, binarylevels.go,
// delayedexchange.go, delayedretry.go, deliverytime.go, memory.go, heldretries.go),
// implement the contract of the library's internal/backend (what a backend declares,
// how it sizes a delay, parks a message or holds the failed delivery, and the optional
// interfaces of what it alone does: a version gate, work queue arguments, command-line
// flags, its storage as ops reads it), which the middleware, the Config and package ops
// decide from alone. Adding a backend is a file here and its line in the parse table of
// backend.go.
//
// Import it to configure a backend in code,
//
//	Backend: delay.BinaryLevels(20),
//
// to read one from configuration (a deployment switches backends by configuration
// alone),
//
//	Backend: must(delay.Parse(os.Getenv("DELAY_BACKEND"))), // "" is ttl-tiers
//
// or to match ErrDelayTooLong, ErrPluginMissing or ErrUnsupported.
//
//	backend           precision                    longest delay          broker
//	ttl-tiers         snaps up to the next tier    the longest tier (1h)  3.10+
//	binary-levels     1 s steps                    2^Levels - 1 s         3.10+
//	delayed-exchange  1 ms steps                   2^32 - 1 ms (49.7 d)   3.10-4.2 with the plugin
//	delayed-retry     one constant delay per queue the same               4.3+
//	delivery-time     1 ms steps, per message      any                    4.3+, AMQP 1.0 (package amqp1)
//	memory            exact (a Go timer)           none                   none: not durable
//
// ttl-tiers, binary-levels and delayed-exchange park a confirmed copy of the failed
// message and bring it back through a delivery exchange, to which each work queue is
// bound under its own name: a retry never reaches another subscriber group of a fanout
// topic. No queue mixes delays, so a short delay never waits behind a long one. A
// retry whose work queue is gone when it comes due goes to the parking queue
// (<prefix>.parking), except on delayed-exchange, whose plugin drops it.
//
// delayed-retry copies nothing: the middleware settles the failed delivery with a
// requeue and RabbitMQ 4.3 holds it aside in the work queue for the queue's delay.
// HeldRetries has it take the first retries only, in front of a copying backend.
//
// delivery-time copies nothing either: over AMQP 1.0 (the transport of package
// github.com/amqpretry/amqpretry/amqp1) the middleware settles the failed delivery with
// the modified outcome and an exact due time (x-opt-delivery-time), which RabbitMQ 4.3
// holds in the quorum work queue until then.
package delay
