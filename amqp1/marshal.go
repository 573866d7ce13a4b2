package amqp1

import (
	"bytes"
	"encoding/base64"
	"errors"
	"fmt"
	"strconv"
	"time"

	amqp "github.com/Azure/go-amqp"
	"github.com/ThreeDotsLabs/watermill/message"
)

// uuidKey is the application property that carries the Watermill message UUID. It is
// the header name watermill-amqp uses, and RabbitMQ maps AMQP 0-9-1 headers to AMQP 1.0
// application properties and back, so messages interoperate with watermill-amqp
// publishers and subscribers in both directions.
// TestPinnedFacts pins it to watermill-amqp's own constant, the home of that fact, without
// making this module compile a watermill-amqp major for one string.
const uuidKey = "_watermill_message_uuid"

// toAMQP builds the AMQP 1.0 message for a Watermill message: the payload as one data
// section, the metadata and the UUID as application properties (strings), the UUID
// also as the message-id, and a durable header.
func toAMQP(msg *message.Message) *amqp.Message {
	props := make(map[string]any, len(msg.Metadata)+1)
	for k, v := range msg.Metadata {
		props[k] = v
	}
	props[uuidKey] = msg.UUID
	payload := msg.Payload
	if payload == nil {
		payload = []byte{}
	}
	m := &amqp.Message{
		Header:                &amqp.MessageHeader{Durable: true},
		ApplicationProperties: props,
		Data:                  [][]byte{payload},
	}
	if msg.UUID != "" {
		m.Properties = &amqp.MessageProperties{MessageID: msg.UUID}
	}
	return m
}

// errBody is a message body that cannot be a Watermill payload.
var errBody = errors.New("body is neither data sections nor a string or binary amqp-value")

// fromAMQP builds the Watermill message for a delivery. The payload is the data
// sections, concatenated (or an amqp-value that is a string or binary); any other body
// is an error. Application properties become metadata: strings as they are, other
// values as text (see propertyString); a property never makes this fail. The UUID is
// the uuidKey property, else a string message-id, else empty.
func fromAMQP(m *amqp.Message) (*message.Message, error) {
	var payload []byte
	switch {
	case len(m.Data) == 1:
		payload = m.Data[0]
	case len(m.Data) > 1:
		payload = bytes.Join(m.Data, nil)
	case m.Value != nil:
		switch v := m.Value.(type) {
		case string:
			payload = []byte(v)
		case []byte:
			payload = v
		default:
			return nil, errBody
		}
	case len(m.Sequence) > 0:
		return nil, errBody
	}

	var uuid string
	if v, ok := m.ApplicationProperties[uuidKey]; ok {
		uuid = propertyString(v)
	} else if m.Properties != nil {
		if id, ok := m.Properties.MessageID.(string); ok {
			uuid = id
		}
	}
	msg := message.NewMessage(uuid, payload)
	for k, v := range m.ApplicationProperties {
		if k == uuidKey {
			continue
		}
		msg.Metadata[k] = propertyString(v)
	}
	return msg, nil
}

// propertyString is the metadata text of an application property value: a string as it
// is; integers in decimal; floats in the shortest form that reads back the same; bools
// "true"/"false"; a timestamp in RFC 3339 with nanoseconds, UTC; binary in standard
// base64; a symbol or UUID as its text; null as ""; anything else as fmt's %v.
func propertyString(v any) string {
	switch v := v.(type) {
	case nil:
		return ""
	case string:
		return v
	case amqp.Symbol:
		return string(v)
	case bool:
		return strconv.FormatBool(v)
	case int8:
		return strconv.FormatInt(int64(v), 10)
	case int16:
		return strconv.FormatInt(int64(v), 10)
	case int32:
		return strconv.FormatInt(int64(v), 10)
	case int64:
		return strconv.FormatInt(v, 10)
	case int:
		return strconv.Itoa(v)
	case uint8:
		return strconv.FormatUint(uint64(v), 10)
	case uint16:
		return strconv.FormatUint(uint64(v), 10)
	case uint32:
		return strconv.FormatUint(uint64(v), 10)
	case uint64:
		return strconv.FormatUint(v, 10)
	case uint:
		return strconv.FormatUint(uint64(v), 10)
	case float32:
		return strconv.FormatFloat(float64(v), 'g', -1, 32)
	case float64:
		return strconv.FormatFloat(v, 'g', -1, 64)
	case time.Time:
		return v.UTC().Format(time.RFC3339Nano)
	case []byte:
		return base64.StdEncoding.EncodeToString(v)
	case amqp.UUID:
		return v.String()
	default:
		return fmt.Sprint(v)
	}
}
