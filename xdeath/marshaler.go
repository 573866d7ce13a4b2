package xdeath

import (
	"encoding/base64"
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

// SubscriberKey is the metadata key under which Marshaler.Unmarshal records
// Marshaler.Subscriber, the identity of the subscriber configuration that
// received the delivery. A retry middleware uses it to act only on messages
// its own subscriber delivered. Like the other keys of this package it is
// never published: a value arriving in a header of that name is dropped.
const SubscriberKey = "amqpretry-subscriber"

// RawHeadersKey is the metadata key under which Marshaler.Unmarshal keeps the
// headers that the typed encoding cannot carry: a non-string header whose name
// is not valid UTF-8, a table key that is not, nesting deeper than MaxDepth,
// or a non-string message UUID header. The value is the standard base64 of
// those headers as one AMQP field table in wire format; Marshal sends them
// back unchanged. Handlers should leave it alone.
const RawHeadersKey = "amqpretry-raw-headers"

// Marshaler is a watermill-amqp Marshaler that accepts AMQP headers of any
// type, where the DefaultMarshaler accepts only strings. The zero value is
// ready to use.
type Marshaler struct {
	// Inner marshals the message UUID, the payload and the string headers,
	// and its options (PostprocessPublishing, NotPersistentDeliveryMode,
	// MessageUUIDHeaderKey) apply as usual.
	Inner wamqp.DefaultMarshaler
	// Subscriber, if set, is recorded under SubscriberKey on every message
	// Unmarshal returns. amqpretry sets it to tell its own deliveries apart.
	Subscriber string
}

var _ wamqp.Marshaler = Marshaler{}

// Unmarshal converts a delivery to a message. String headers go through
// Inner unchanged. Every other header is stored in the metadata encoded by
// EncodeValue and listed under TypedHeadersKey; one that the encoding cannot
// carry is kept, losslessly, under RawHeadersKey. The delivery's exchange and
// routing key are stored under DeliveryExchangeKey and
// DeliveryRoutingKeyKey, and Subscriber under SubscriberKey. Headers named
// like the keys this package reserves are ignored.
//
// Unmarshal fails only if Inner does, which it does not for the headers it
// is given: a delivery is never refused for its headers, so it cannot be
// nacked and redelivered forever for them.
func (m Marshaler) Unmarshal(d amqp.Delivery) (*message.Message, error) {
	uuidKey := m.uuidKey()
	strs := make(amqp.Table, len(d.Headers))
	typed := map[string]string{}
	raw := amqp.Table{}
	for k, v := range d.Headers {
		if isReserved(k) {
			continue
		}
		if _, ok := v.(string); ok {
			strs[k] = v
			continue
		}
		if k != uuidKey && utf8.ValidString(k) {
			if enc, err := encodeValue(v, k); err == nil {
				typed[k] = enc
				continue
			}
		}
		raw[k] = v
	}

	inner := d
	inner.Headers = strs
	msg, err := m.Inner.Unmarshal(inner)
	if err != nil {
		return nil, err
	}

	if len(typed) > 0 {
		keys := make([]string, 0, len(typed))
		for k, enc := range typed {
			msg.Metadata[k] = enc
			keys = append(keys, k)
		}
		sort.Strings(keys)
		if msg.Metadata[TypedHeadersKey], err = marshalJSON(keys); err != nil {
			return nil, err
		}
	}
	if len(raw) > 0 {
		b, err := appendTable(nil, raw)
		if err != nil {
			return nil, err
		}
		msg.Metadata[RawHeadersKey] = base64.StdEncoding.EncodeToString(b)
	}
	msg.Metadata[DeliveryExchangeKey] = d.Exchange
	msg.Metadata[DeliveryRoutingKeyKey] = d.RoutingKey
	if m.Subscriber != "" {
		msg.Metadata[SubscriberKey] = m.Subscriber
	}
	return msg, nil
}

// Marshal converts a message to a publishing without modifying the message.
// Typed metadata is decoded back to the original AMQP types and the headers
// under RawHeadersKey are restored. Left out are the keys reserved by this
// package and every broker-owned header (see IsBrokerOwned): sent back,
// x-death would feed RabbitMQ's dead-letter cycle detection, which can drop
// the message silently. Inner then builds the publishing; its
// PostprocessPublishing runs last and sees every header.
//
// Marshal does not fail on metadata: a value listed under TypedHeadersKey
// that no longer decodes (a handler set a plain string there) is sent as the
// string it now is, and a RawHeadersKey value that is not one Unmarshal wrote
// is left out.
func (m Marshaler) Marshal(msg *message.Message) (amqp.Publishing, error) {
	uuidKey := m.uuidKey()
	typed, err := typedKeys(msg.Metadata)
	if err != nil {
		typed = nil // an unreadable list: every value is the string it is
	}
	headers := make(amqp.Table, len(msg.Metadata))
	strs := make(message.Metadata, len(msg.Metadata))
	for k, s := range msg.Metadata {
		if isReserved(k) || IsBrokerOwned(k) || k == uuidKey {
			continue
		}
		if v, _, err := lookup(msg.Metadata, typed, k); err == nil {
			if _, ok := v.(string); !ok {
				headers[k] = v
				continue
			}
		}
		strs[k] = s
	}
	if s, ok := msg.Metadata[RawHeadersKey]; ok {
		if b, err := base64.StdEncoding.DecodeString(s); err == nil {
			if raw, err := parseTable(b); err == nil {
				for k, v := range raw {
					delete(strs, k)
					headers[k] = v
				}
			}
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
