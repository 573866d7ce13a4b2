// Package middleware is the retry middleware: Retry turns a handler's error into a
// broker-side delayed redelivery.
//
// It reads each delivery once, on receipt, and runs the handler (engine.go), with the
// attempt in the message's context (amqpretry.AttemptFromContext) and recovering its
// panic: a panic is a failure like an error (amqpretry.ErrPanicked), logged at ERROR
// with its stack, which the Envelope carries; the Retry nearest the handler recovers
// it, whatever the order of Watermill's Recoverer. On a handler error it decides what becomes of the message (whether it is this Retry's to
// hand off, the error's marks, amqpretry.Config.Classify, the Policy), sizes the delay
// with the delay backend, stamps the failure Envelope on a copy and parks the copy in
// the backend, which publishes it confirmed before the delivery is acked (copy.go, in
// that order); or, for a backend that holds retries (delayed-retry, delivery-time), it
// settles the delivery for the broker to hold in its work queue (hold.go). It decides
// from what the backend can do (its Caps), never from its name. A message that failed
// for good goes to the poison queue, confirmed, with its Envelope; one whose poisoning
// cannot be published stays in its work queue and only its poisoning is retried, never
// the handler (poison.go). A failed hand-off is paced and counted (handoff.go); a copy
// back before it is due is re-parked (repark.go); the queues bound for retries are
// recorded when its subscriber subscribes (wiring.go); Close waits for the hand-offs in
// flight (lifecycle.go); with amqpretry.Config.Dedup, a message is checked before the
// handler and remembered once handled or poisoned, never when it fails, and a retry
// this Retry scheduled that a middleware acked before its handler ran is said once at
// ERROR (dedup.go). What it sees of Watermill's middlewares around it (a message acked
// before it could settle it, a failure taken by PoisonQueue inside, the handler run
// again after a Permanent error, a delivery run through it again) is in around.go, and
// docs/watermill-middlewares.md. Every path that moves a message publishes with confirms before
// it acks, or nacks with requeue: nothing is lost. It tells amqpretry.Config.Observe
// every amqpretry.Event and counts its Stats (observe.go).
//
// Most programs build it through the transport package of their watermill-amqp major,
// github.com/amqpretry/amqpretry/wamqp3 or wamqp2, whose New also gives the
// subscriber config it needs; github.com/amqpretry/amqpretry/amqp1 builds it for AMQP
// 1.0. Each of them calls New with a Transport: the seam a transport of your own uses
// too. Its subscriber calls Retry.Delivered on each message and, where retries come
// back through the broker, Retry.Bind on each subscribe. The transport packages also
// mark the deliveries of subscribers that name their queues otherwise (a queue per
// handler, SubscriberConfigFor), and refuse, when a handler is added, a work queue that
// cannot hold the retries.
//
// Read a poisoned message's Envelope with ReadEnvelope.
package middleware
