// Package amqp1 is a Watermill Pub/Sub for RabbitMQ 4.x over AMQP 1.0, RabbitMQ 4's
// native protocol, served on the same port as AMQP 0-9-1 with nothing to enable.
//
// It exists for what AMQP 0-9-1 cannot say: a consumer can settle a failed message
// with the modified outcome, and RabbitMQ 4.3 then holds it in the queue until a
// given time (x-opt-delivery-time) and hands it back with its delivery count one
// higher and with annotations of the consumer's choosing. Redeliver asks for that;
// everything else is an ordinary Watermill Publisher and Subscriber, configured like
// watermill-amqp's.
//
// # Getting started
//
//	sub, err := amqp1.NewSubscriber(amqp1.SubscriberConfig{
//		URI: "amqp://user:password@rabbitmq:5672/",
//	}, logger)
//	pub, err := amqp1.NewPublisher(amqp1.PublisherConfig{
//		URI: "amqp://user:password@rabbitmq:5672/",
//	}, logger)
//
//	router.AddHandler("invoice", "orders", sub, "invoices", pub, handler)
//
// The URI's path is the virtual host ("/" or none for the default one, "/%2f" also
// works). Both connect lazily: the Subscriber on its first Subscribe (or
// SubscribeInitialize), the Publisher on its first Publish.
//
// # Topics, queues and addresses
//
// A topic is a queue. The Subscriber consumes the queue SubscriberConfig.QueueName
// gives for the topic (the topic itself by default) and declares it first, durable,
// of type SubscriberConfig.Queue.Type ("quorum" by default) with the queue arguments
// of SubscriberConfig.Queue.Arguments, through RabbitMQ 4's management node over AMQP
// 1.0. The declaration is idempotent; a queue that exists with another type or other
// arguments makes Subscribe fail with the broker's reason. Set Queue.NoDeclare when
// someone else owns the topology. Several Subscribers of one topic compete for its
// messages: there are no consumer groups; fan-out is done by the broker, by binding
// queues to an exchange.
//
// The Publisher sends to the address PublisherConfig.Address gives for the topic,
// QueueAddress(topic) by default ("/queues/<topic>", RabbitMQ's address format v2).
// ExchangeAddress(exchange, key) routes through an exchange instead. The Publisher
// declares nothing: a queue that does not exist is an error (amqp:not-found), never
// a silent drop, and a message that an exchange routes nowhere comes back as
// ErrNotAccepted ("released").
//
// # Messages
//
// The payload travels as one AMQP data section, each metadata entry as an application
// property, and the UUID both as the application property _watermill_message_uuid
// and as the message-id. Messages are durable. The property name is the header
// watermill-amqp uses, and RabbitMQ converts 0-9-1 headers to application properties
// and back: messages published here are read by watermill-amqp subscribers with UUID,
// payload and metadata intact, and the other way round.
//
// Received application properties become metadata: strings as they are; other values
// as text (integers in decimal, floats in their shortest form, bools as true/false,
// timestamps in RFC 3339 UTC, binary in standard base64, null as ""). A property never
// makes the Subscriber refuse a delivery. Without _watermill_message_uuid the UUID is
// the message-id when that is a string, else empty. RabbitMQ delivers a 0-9-1 header
// whose name starts with "x-" as a message annotation (see Annotations), and leaves out
// 0-9-1 headers that are tables or arrays. A body that is neither data sections nor a
// string or binary amqp-value cannot be a payload: the Subscriber logs it and settles
// it rejected (dead-lettered when the queue has a dead-letter target, dropped
// otherwise) rather than redelivering it forever.
//
// # Acks, nacks and redelivery
//
// The Subscriber hands out one message at a time per Subscribe call. Ack settles it
// accepted. Nack settles it released: the broker delivers it again at once, and a
// quorum queue does not count that as a failed delivery. Before Nack, code with the
// message (a middleware, the handler) may call Redeliver: Nack then settles it
// modified, with delivery-failed set and the annotations given, and, with a delivery
// time, RabbitMQ 4.3 keeps it aside until then, even on a queue without any
// delayed-retry settings. DeliveryCount and Annotations read what the broker says
// about a delivery. Redeliver finds the delivery through the message's context, which
// the router's handlers inherit; metadata plays no part.
//
// What the broker does, measured on RabbitMQ 4.3.6 with a quorum queue: the message
// returns at the delivery time (2 s asked: 3-5 ms late); its delivery count is one
// higher; the annotations given to Redeliver, custom x-opt-* ones included, are kept
// on it for every later delivery, released ones included; a plain Nack (released)
// leaves the delivery count as it is; x-opt-delivery-time may be an AMQP long, ulong or
// timestamp. A classic queue redelivers at once, drops the annotations and reports a
// delivery count of 1 after any redelivery. RabbitMQ 4.0 to 4.2 ignore the delivery
// time.
//
// # Delivery guarantees and failures
//
// Delivery is at-least-once. When the link or the connection is lost, the Subscriber
// attaches again with backoff (SubscriberConfig.ReconnectInitialInterval, up to
// ReconnectMaxInterval) and goes on; the broker redelivers what was not settled. A lost
// connection counts as a failed delivery of the messages it had unsettled (delivery count +1 on
// a quorum queue, towards its delivery-limit, 20 by default on RabbitMQ 4); a link
// detached by the Subscriber (Close, the end of a Subscribe context) does not.
//
// Publish returns once the broker has accepted every message, and says why otherwise:
// ErrNotAccepted (rejected, released or modified: the broker does not have the
// message) or ErrNotConfirmed (the link or connection was lost, or the time ran out,
// before the outcome came: the broker may have it). The next Publish after a failure
// attaches or connects again.
//
// # Closing
//
// When a Subscribe context ends or Close is called, no further message is handed out,
// the contexts of the messages handed out are cancelled, and the Subscriber waits up to
// SubscriberConfig.CloseTimeout for their Ack or Nack, settles them, then detaches and
// closes the channel. Publisher.Close waits for the Publish calls under way.
//
// # Link credit
//
// SubscriberConfig.Credit is how many messages the broker may send ahead of their
// settlement, like watermill-amqp's prefetch count, and 1 by default like its presets:
// a message waits on the broker, where any consumer can take it, not behind a slow
// handler. On a quorum queue, where every settlement goes through the queue's log,
// credit 1 costs a round trip through it per message: measured on RabbitMQ 4.3.6 (2
// cores), acking 3,000 messages ran at about 740 messages/s with credit 1, 3,300 with
// 10, 6,600 with 50. Raise it for throughput; messages received but not handed out go
// back to the queue when the link closes, without counting as failed deliveries.
//
// The password of the URI never appears in logs or errors; the logs show the URI
// with the password replaced by "xxxxx".
package amqp1
