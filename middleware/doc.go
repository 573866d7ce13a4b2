// Package middleware is the retry middleware: Retry turns a handler's error into a
// broker-side delayed redelivery.
//
// On a handler error it decides what becomes of the message (the error's marks,
// amqpretry.Config.Classify, the Policy), sizes the delay with the delay backend,
// stamps the failure Envelope on a copy and hands the copy to the backend, which
// publishes it confirmed before the delivery is acked (engine.go, copy.go); or, for a
// backend that keeps the failed delivery in the work queue (delayed-retry,
// delivery-time), it settles the delivery for the broker to hold (hold.go). It decides
// from what the backend can do (its Caps), never from its name. A message that failed
// for good goes to the poison queue, confirmed, with its Envelope; one whose poisoning
// cannot be published stays in its work queue and only its poisoning is retried, never
// the handler (poison.go). A failed hand-off is paced and counted (handoff.go); a copy
// back before it is due is parked again (repark.go). Every path that moves a message
// publishes with confirms before it acks, or nacks with requeue: nothing is lost. It
// tells amqpretry.Config.Observe every amqpretry.Event and counts its Stats
// (observe.go).
//
// Most programs build it through the transport package of their watermill-amqp major,
// github.com/amqpretry/amqpretry/wamqp3 or wamqp2, whose New also gives the
// subscriber config it needs; github.com/amqpretry/amqpretry/amqp1 builds it for AMQP
// 1.0. Each of them calls New with a Transport: the seam a transport of your own uses
// too. Its subscriber calls Retry.Delivered on each message, and, where retries come
// back through the broker, Retry.Bind on each subscribe.
//
// Read a poisoned message's Envelope with ReadEnvelope.
package middleware
