package xdeath

import (
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/marshal"
)

// Marshaler is a watermill-amqp Marshaler (v2 and v3 alike) that accepts AMQP headers
// of any type, where the DefaultMarshaler accepts only strings. The zero value is ready
// to use; its fields are the DefaultMarshaler's, with the same meaning.
type Marshaler struct {
	// PostprocessPublishing, if set, edits each publishing last (for example to set a
	// CorrelationId or ContentType).
	PostprocessPublishing func(amqp.Publishing) amqp.Publishing
	// NotPersistentDeliveryMode sends messages transient instead of persistent.
	NotPersistentDeliveryMode bool
	// MessageUUIDHeaderKey is the header with the message UUID. Default:
	// "_watermill_message_uuid".
	MessageUUIDHeaderKey string
}

func (m Marshaler) impl() marshal.Marshaler {
	return marshal.Marshaler{Options: marshal.Options{
		PostprocessPublishing:     m.PostprocessPublishing,
		NotPersistentDeliveryMode: m.NotPersistentDeliveryMode,
		MessageUUIDHeaderKey:      m.MessageUUIDHeaderKey,
	}}
}

// Unmarshal converts a delivery to a message. String headers become metadata as they
// are. Every other header is stored in the metadata in a typed JSON encoding, so that
// Marshal sends it back with its AMQP type; a header that encoding cannot carry (a
// non-string value under a name that is not UTF-8, nesting deeper than 64) is kept
// losslessly in a metadata key of its own. Unmarshal never fails for a
// header: a delivery is never nacked and redelivered forever for one.
//
// It refuses only the zero amqp.Delivery, which no broker sends: watermill-amqp
// (v2.1.3, v3.0.1) can read one from its consumer's closed delivery channel as a
// connection drops, and would otherwise hand the handler a message with no UUID, no
// headers and no body. Refused, it reaches no handler, and the subscriber reconnects.
func (m Marshaler) Unmarshal(d amqp.Delivery) (*message.Message, error) {
	return m.impl().Unmarshal(d)
}

// Marshal converts a message to a publishing without modifying the message: typed
// metadata goes back with its AMQP type. Every header RabbitMQ owns is left out
// (x-death, x-first-death-*, x-last-death-*, x-delay, x-delivery-count,
// x-acquired-count, CC, BCC): sent back, x-death feeds RabbitMQ's dead-letter cycle
// detection, which can drop the message silently. To set such a header on purpose, do
// it in PostprocessPublishing, which runs last.
func (m Marshaler) Marshal(msg *message.Message) (amqp.Publishing, error) {
	return m.impl().Marshal(msg)
}
