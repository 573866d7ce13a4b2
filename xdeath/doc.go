// Package xdeath lets Watermill consume the messages RabbitMQ dead-letters or delays,
// and reads their dead-letter history. Import it for a subscriber of your own that
// reads dead-lettered messages (the subscribers of a Retry get such a marshaler
// already), or to read x-death.
//
// # Why a marshaler
//
// Watermill metadata is a map of strings, and the DefaultMarshaler of watermill-amqp
// refuses any AMQP header that is not a string (github.com/ThreeDotsLabs/watermill
// issue #65). RabbitMQ adds such headers itself: x-death, an array of tables, to every
// dead-lettered message; x-delay, an integer, to every message the delayed-message
// exchange plugin delivers; x-delivery-count and x-acquired-count, integers, to
// redeliveries from quorum queues. The subscriber nacks such a message with requeue,
// receives it again and fails again, forever. Marshaler accepts headers of any type,
// for watermill-amqp v2 and v3 alike:
//
//	cfg := amqp.NewDurableQueueConfig(uri)
//	cfg.Marshaler = xdeath.Marshaler{}
//
// String headers become metadata unchanged. Every other header is stored in a typed
// JSON encoding, so that Marshal sends it back with its AMQP type (an int32 stays an
// int32); a header that encoding cannot carry (a non-string value under a name that is
// not UTF-8, nesting deeper than 64) is kept losslessly. A delivery is never refused
// for its headers.
//
// # What Marshal leaves out
//
// Marshal drops every header RabbitMQ owns (x-death, x-first-death-*, x-last-death-*,
// x-delay, x-delivery-count, x-acquired-count, CC, BCC). A consumer that publishes a
// copy of a dead-lettered message with its x-death header feeds RabbitMQ's dead-letter
// cycle detection, which drops messages that seem to have gone round a cycle without a
// rejection, silently (celery/celery issue #9867). Nor would copying x-death keep a
// history: from RabbitMQ 4.0 the broker ignores x-death headers set by clients
// (rabbitmq/rabbitmq-server issues #10709 and #11331). To set such a header on purpose,
// for instance x-delay, do it in PostprocessPublishing, which runs last.
//
// # Reading the dead-letter history
//
// Parse reads x-death and the x-first-death-* and x-last-death-* headers from a header
// table (an amqp091 Delivery's); FromMetadata from the metadata of a message
// unmarshaled by Marshaler. The subscriber of a Retry does not carry x-death into
// metadata, where it would be encoded on every delivery only to be dropped: there,
// FromMetadata gives the first and last deaths. The history is for diagnostics only:
// every copy published by a client starts a new one, so its counts cannot tell how
// often a message was retried (amqpretry.Attempt does).
package xdeath
