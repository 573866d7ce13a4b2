// Package topology declares what the delay backends need, idempotently.
//
// A Topology is data: exchanges, queues (always durable) and bindings, declared in that
// order by Declare. Declaring the same Topology twice changes nothing. When a queue or
// exchange already exists with other arguments the broker refuses (406
// PRECONDITION_FAILED) and Declare returns an error wrapping ErrMismatch that names the
// queue or exchange and the argument that differs, for example:
//
//	declare queue "amqpretry.delay.5s": declared with different arguments:
//	argument x-message-ttl differs from the existing declaration (delete it or align the config): ...
//
// Builder plugs the work-queue side into watermill-amqp: it is a TopologyBuilder that
// declares the subscriber's own queue as before, then the bindings a delay backend needs
// to bring retries back to that queue. The watermill-amqp Subscriber runs it on Subscribe
// and after every reconnect.
//
// The exported argument names (QueueTypeArg, DeadLetterStrategyArg, ...) are the ones
// RabbitMQ gives meaning to.
package topology
