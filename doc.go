// Package amqpretry turns a Watermill handler error into a delayed redelivery kept by
// RabbitMQ, instead of a sleep inside the handler. Every user imports it: it has the
// configuration (Config, Policy), what a handler returns to steer its retries
// (Permanent, RetryAfter) and what it reads (Attempt, AttemptFromContext). The
// transport package of your watermill-amqp major, github.com/amqpretry/amqpretry/wamqp3
// (or wamqp2), builds the middleware from it; that is the one other import of the
// common case.
//
// # The common case
//
//	amqpCfg := amqp.NewDurableQueueConfig(uri) // watermill-amqp v3; pub/sub configs work too; delayed retries add the queue arguments they need
//	retry, err := wamqp3.New(amqpCfg, amqpretry.Config{
//		Backend: must(delay.Parse(os.Getenv("DELAY_BACKEND"))), // "" is ttl-tiers
//		Policy:  amqpretry.Policy{MaxAttempts: 5},
//	})
//	if err != nil { ... }
//	defer retry.Close() // after the router
//	_, err = retry.AddHandler(router, "orders", "orders", func(msg *message.Message) error {
//		if bad(msg) {
//			return amqpretry.Permanent(errors.New("malformed order")) // poisoned at once
//		}
//		return process(msg) // any other error is retried with backoff
//	})
//
// # What happens on an error
//
// The error is classified (DecisionOf): Permanent poisons the message at once, and so
// does an error of a payload that can never decode (encoding/json's syntax and type
// errors, protobuf-go's); RetryAfter asks for its own delay; anything else is retried
// after the Policy's delay. Config.Classify may decide for any error. A handler's panic
// is recovered by the middleware and retried like an error (ErrPanicked), its stack in
// the envelope. A handler reads its attempt with Attempt, or, given the message's
// context (a Watermill CQRS handler), with AttemptFromContext. For a retry, a copy of the message with the next attempt number
// and the failure envelope (package middleware) is handed to the delay backend (package
// delay) on a connection of its own; the original is acked only once the broker has
// confirmed the copy, and nacked for redelivery when it cannot be (at-least-once:
// nothing lost, a duplicate possible). The broker brings the copy back to the queue that
// failed, and only to it, after the delay. On RabbitMQ 4.3 the delayed-retry backend (or
// delay.HeldRetries, for the first retries) copies nothing: the failed delivery
// stays in the work queue and the broker holds it for the queue's delay. After the last
// attempt, or on a permanent error, the message goes to the poison queue with its
// envelope. A message whose headers amqp091-go cannot read (v1.16.0 and later: nested
// deeper than 32) never reaches the library: its client loses the connection and the
// broker gives it back. Only the work queue can end that loop, a quorum queue with
// x-delivery-limit and the poison queue as its dead-letter target
// (docs/troubleshooting.md); New warns about a quorum work queue that would drop it.
//
// # The schedule
//
// Policy.Delays is the one way to set how long a retry waits: the delay before attempt
// n+1 is Delays[n-1], and the last entry repeats. Exponential builds a growing one; the
// default is Exponential(time.Second, 2, 10*time.Minute): 1s, 2s, 4s … 8m32s, 10m. Jitter
// (±20% by default, -1 for none) randomises every delay, never past the longest entry,
// so that messages that failed together do not come back together. The schedule is the
// delayed stage's: after Policy.Immediate retries (run at once, in this process, for an
// error that is not Permanent, asks for no delay and, with outage detection on, is not
// Unavailable) or delay.HeldRetries, it starts again at Delays[0]. A delay of the
// error's own (RetryAfter, Classify's) replaces the schedule's for that retry.
//
// Config.Validate refuses a schedule the backend cannot keep, naming the entry and the
// fix: on binary-levels and delayed-exchange a delay, jitter included, longer than they
// keep; on delayed-retry, which holds every retry for its one Delay, a Delays that asks
// for another delay or a growth, or a positive Jitter (Delays nil means its delay). On
// ttl-tiers a delay longer than the longest tier is parked again when it comes back,
// until it is due: never early.
//
// # Duplicates
//
// At-least-once delivery brings duplicates: a message whose ack was lost runs again.
// Config.Dedup acks a duplicate without running the handler: it remembers a message
// once its handler has succeeded (or it was poisoned), never when it fails, so that a
// retry, which carries the same UUID and payload, always runs; in memory, or in a
// DedupStore (the pgdedup module's PostgreSQL table). Watermill's Deduplicator records
// a key before the handler runs and drops every retry: give it DedupKey as its
// KeyFactory. A message is remembered by its work queue and UUID (and its redrives); a
// duplicate that arrives while the first copy still runs runs too; a DedupStore that
// fails is a dependency down: the message waits (Outage), or is retried. docs/dedup.md
// tells where duplicates come from and how long to keep.
//
// # Words
//
// One word per concept, in the code, the docs, the logs and the events:
//
//   - park: copy a failed message into delay storage, confirmed before the original is
//     acked (ttl-tiers, binary-levels, delayed-exchange, memory: a backend that keeps a
//     copy).
//   - hold: have the broker keep the failed delivery itself in its work queue, no copy
//     (delayed-retry and delay.HeldRetries, delivery-time: a backend that keeps the
//     delivery).
//   - the parking queue: <Prefix>.parking, where a retry whose work queue is gone when
//     it comes due waits; the poison queue: where a message that failed for good goes.
//   - re-park: park a retry again when it comes back before it is due, because its
//     delay (a RetryAfter) is longer than the backend's longest; hold again is the same
//     for a held retry.
//   - order key (Config.OrderKey): what a message's order is kept within. A key is
//     blocked while its head (its message whose retry waits) waits; its later messages
//     wait behind it, in its behind queue (<Prefix>.behind.*); releasing the key runs
//     them, in order (docs/ordering.md).
//
// What each backend can do (how it keeps a retry, which delays, past its longest) is
// in the table of package delay.
//
// # Packages
//
//   - wamqp3, wamqp2: New, AddHandler, SubscriberConfig for watermill-amqp v3 or v2.
//   - delay: the backends: their names, errors and what each can do.
//   - middleware: the failure Envelope (reading the poison queue), Events and Stats.
//   - topology: the least-privilege Mode and the declarations of Config.Plan.
//   - xdeath: a marshaler that reads dead-lettered messages, and x-death parsing.
//   - ops: status, topology, poison and parking queues, from Go (the amqpretry command
//     is built on it).
package amqpretry
