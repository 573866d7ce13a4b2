// Package delay parks messages in RabbitMQ and brings each back, after its delay, to
// the queue named when it was handed over, and only to that queue.
//
// # One interface, backends by name
//
// A Backend is a Watermill message.Publisher: Publish(queue, msgs...) reads each
// message's delay from Watermill's own delay metadata (components/delay:
// delay.Message(msg, delay.For(d))), parks it without modifying it, and returns only
// once the broker has confirmed it holds the message. New builds the backend named by Config.Backend, so a
// deployment switches backends by configuration alone:
//
//	ttl-tiers         a ladder of quorum queues with queue-level TTLs (default);
//	                  delays snap up to the next tier
//	binary-levels     Levels quorum queues of 2^L seconds; any delay up to
//	                  2^Levels-1 s with 1 s steps, no plugin
//	delayed-exchange  the rabbitmq_delayed_message_exchange plugin; 1 ms steps,
//	                  up to 49.7 days, stored on one node
//	memory            timers in this process; not durable; tests and demos only
//
// Every backend brings a retry back through a delivery exchange to which each work
// queue is bound under its own name (WorkQueue gives the declarations; the
// topology.Builder adds them to watermill-amqp's subscriber), so a retry never reaches
// another subscriber group of a fanout topic. No queue mixes delays, so a short delay
// never waits behind a long one (per-message TTL would block at the head of the queue).
// A retry whose queue is gone when it comes due goes to the parking queue
// (<prefix>.parking) through the delivery exchange's alternate exchange: with
// at-least-once dead lettering it would otherwise sit at the head of its delay queue and
// block everything behind it.
//
// # The hand-off
//
// Handoff is the one way the RabbitMQ backends (and the poison queue) publish: on a
// connection of its own, never the consuming one, on a channel in confirm mode, each
// message persistent, mandatory (except to the plugin, which returns every mandatory
// delayed publish), with a fresh MessageId and no expiration. Publish returns nil only
// when the broker has confirmed the message and not returned it: ErrNotConfirmed when
// the broker nacked it or the channel or connection closed first, ErrReturned when it
// was unroutable. Concurrent publishes share the channel with deferred confirmations;
// after a failure the next publish reconnects. Broker-owned headers (x-death, x-delay,
// CC, ...) are never copied into what it publishes (see package xdeath).
//
// # At start-up
//
// New checks the broker (Probe): it logs the RabbitMQ version and whether the
// delayed-message plugin is enabled, warns about 3.13.0-3.13.2, whose dead-letter cycle
// detection drops retried messages, and refuses the delayed-exchange backend with
// ErrPluginMissing where the plugin is absent. WorkQueueWarning tells whether a quorum
// work queue's delivery-limit could drop a message whose hand-off keeps failing. Then
// New declares the backend's publishing side, idempotently (package topology).
package delay
