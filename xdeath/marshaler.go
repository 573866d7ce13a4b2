package xdeath

import (
	"sort"
	"unicode/utf8"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
)

// Metadata keys under which Marshaler.Unmarshal records where the delivery
// was published: its exchange ("" for the default exchange) and routing key.
const (
	DeliveryExchangeKey   = "amqpretry-delivery-exchange"
	DeliveryRoutingKeyKey = "amqpretry-delivery-routing-key"
)

// Marshaler is a watermill-amqp Marshaler that accepts AMQP headers of any
// type, where the DefaultMarshaler accepts only strings. The zero value is
// ready to use.
type Marshaler struct {
	// Inner marshals the message UUID, the payload and the string headers,
	// and its options (PostprocessPublishing, NotPersistentDeliveryMode,
	// MessageUUIDHeaderKey) apply as usual.
	Inner wamqp.DefaultMarshaler
}

var _ wamqp.Marshaler = Marshaler{}

// Unmarshal converts a delivery to a message. String headers go through
// Inner unchanged. Every other header is stored in the metadata encoded by
// EncodeValue and listed under TypedHeadersKey. The delivery's exchange and
// routing key are stored under DeliveryExchangeKey and
// DeliveryRoutingKeyKey. Headers named like these three keys are ignored.
//
// Unmarshal fails only if Inner does, or for a non-string header whose name
// or nested table keys are not valid UTF-8, which JSON cannot carry.
func (m Marshaler) Unmarshal(d amqp.Delivery) (*message.Message, error) {
	uuidKey := m.uuidKey()
	strs := make(amqp.Table, len(d.Headers))
	var typed []string
	for k, v := range d.Headers {
		if isReserved(k) {
			continue
		}
		// The UUID header always goes to Inner, which decides what a
		// non-string one means.
		if _, ok := v.(string); ok || k == uuidKey {
			strs[k] = v
			continue
		}
		if !utf8.ValidString(k) {
			return nil, pathError(ErrUnsupported, "", "header name %q is not valid utf-8", k)
		}
		typed = append(typed, k)
	}

	inner := d
	inner.Headers = strs
	msg, err := m.Inner.Unmarshal(inner)
	if err != nil {
		return nil, err
	}

	if len(typed) > 0 {
		for _, k := range typed {
			if msg.Metadata[k], err = encodeValue(d.Headers[k], k); err != nil {
				return nil, err
			}
		}
		sort.Strings(typed)
		if msg.Metadata[TypedHeadersKey], err = marshalJSON(typed); err != nil {
			return nil, err
		}
	}
	msg.Metadata[DeliveryExchangeKey] = d.Exchange
	msg.Metadata[DeliveryRoutingKeyKey] = d.RoutingKey
	return msg, nil
}

// Marshal converts a message to a publishing without modifying the message.
// Typed metadata is decoded back to the original AMQP types. Left out are
// the keys reserved by this package and every broker-owned header (see
// IsBrokerOwned): sent back, x-death would feed RabbitMQ's dead-letter cycle
// detection, which can drop the message silently. Inner then builds the
// publishing; its PostprocessPublishing runs last and sees every header.
//
// Marshal fails, wrapping ErrMalformed, if typed metadata cannot be decoded.
func (m Marshaler) Marshal(msg *message.Message) (amqp.Publishing, error) {
	uuidKey := m.uuidKey()
	headers, err := decodeHeaders(msg.Metadata, func(k string) bool {
		return isReserved(k) || IsBrokerOwned(k) || k == uuidKey
	})
	if err != nil {
		return amqp.Publishing{}, err
	}

	strs := make(message.Metadata, len(headers))
	for k, v := range headers {
		if s, ok := v.(string); ok {
			strs[k] = s
			delete(headers, k)
		}
	}

	inner := m.Inner
	inner.PostprocessPublishing = nil
	p, err := inner.Marshal(&message.Message{UUID: msg.UUID, Metadata: strs, Payload: msg.Payload})
	if err != nil {
		return amqp.Publishing{}, err
	}
	for k, v := range headers {
		p.Headers[k] = v
	}
	if post := m.Inner.PostprocessPublishing; post != nil {
		p = post(p)
	}
	return p, nil
}

func (m Marshaler) uuidKey() string {
	if m.Inner.MessageUUIDHeaderKey != "" {
		return m.Inner.MessageUUIDHeaderKey
	}
	return wamqp.DefaultMessageUUIDHeaderKey
}
