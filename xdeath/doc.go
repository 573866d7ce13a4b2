// Package xdeath lets Watermill consume the messages RabbitMQ dead-letters
// or delays, reads their dead-letter history, and keeps broker-owned headers
// out of the copies it publishes again.
//
// # Why a marshaler
//
// Watermill metadata is a map of strings, and the DefaultMarshaler of
// watermill-amqp refuses any AMQP header that is not a string
// (github.com/ThreeDotsLabs/watermill issue #65). RabbitMQ adds such headers
// itself: x-death, an array of tables, to every dead-lettered message;
// x-delay, an integer, to every message the delayed-message exchange plugin
// delivers; x-delivery-count, an integer, to redeliveries from quorum
// queues. The subscriber nacks such a message with requeue, receives it
// again and fails again, forever. Marshaler accepts headers of any type.
// Plug it into the watermill-amqp configuration:
//
//	cfg := amqp.NewDurableQueueConfig(uri)
//	cfg.Marshaler = xdeath.Marshaler{}
//
// Options of the DefaultMarshaler, such as PostprocessPublishing, go in the
// Inner field.
//
// # Metadata encoding
//
// String headers become metadata unchanged, as with the DefaultMarshaler.
// Every other header is stored as JSON in which each value carries its Go
// type as a tag, so that Marshal sends it back with the same AMQP type; see
// EncodeValue for the tags. The keys so encoded are listed under
// TypedHeadersKey, so a string header that merely looks like JSON is never
// mistaken for an encoded one. A message dead-lettered once, with a user
// header "attempt" of type int32, gets this metadata:
//
//	x-first-death-queue      orders
//	x-first-death-reason     rejected
//	x-first-death-exchange   shop
//	attempt                  {"int32":3}
//	x-death                  {"array":[{"table":{
//	                           "count":{"int64":1},
//	                           "exchange":{"string":"shop"},
//	                           "queue":{"string":"orders"},
//	                           "reason":{"string":"rejected"},
//	                           "routing-keys":{"array":[{"string":"order.created"}]},
//	                           "time":{"timestamp":1700000000}}}]}
//	amqpretry-typed-headers  ["attempt","x-death"]
//
// (x-death is shown on several lines here; it is one line.) Unmarshal also
// records the exchange and routing key the message was delivered with under
// DeliveryExchangeKey and DeliveryRoutingKeyKey. Use Header to read a single
// header with its original type and HeadersFromMetadata for all of them.
//
// # What Marshal leaves out
//
// Marshal drops the broker-owned headers (see IsBrokerOwned) from the
// metadata before publishing, along with the keys of this package. A
// consumer that publishes a copy of a dead-lettered message with its x-death
// header feeds RabbitMQ's dead-letter cycle detection, which drops messages
// that seem to have gone round a cycle without a rejection, silently (see
// celery/celery issue #9867 for a report). Nor does copying x-death keep a
// history: from RabbitMQ 4.0 the broker ignores x-death headers set by
// clients (rabbitmq/rabbitmq-server issues #10709 and #11331). x-delay,
// x-delivery-count, CC and BCC describe the delivery that just happened, not
// the next one. To set such a header on purpose, for instance x-delay for
// the delayed-message plugin, do it in Inner.PostprocessPublishing, which
// runs after the filtering.
//
// # Reading the dead-letter history
//
// Parse reads x-death and the x-first-death-* and x-last-death-* headers
// from a header table, FromMetadata from the metadata of a message
// unmarshaled by Marshaler. The result is for diagnostics only: every copy
// published by a client starts a new history with counts of 1, so the
// counts cannot tell how often a message has been retried. Keep retry
// attempts in a header of your own.
package xdeath
