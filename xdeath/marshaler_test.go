package xdeath

import (
	"bytes"
	"errors"
	"maps"
	"math"
	"reflect"
	"strings"
	"testing"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
)

// userHeaders returns headers of every type amqp091-go decodes, as a
// publisher other than Watermill may send them.
func userHeaders() amqp.Table {
	return amqp.Table{
		wamqp.DefaultMessageUUIDHeaderKey: "uuid-1",
		"plain":                           "text",
		"json-looking":                    `{"int32":1}`,
		"not-utf8":                        "\xff\xfe",
		"bool":                            true,
		"int8":                            int8(-8),
		"int16":                           int16(-16),
		"int32":                           int32(-32),
		"int64":                           int64(math.MinInt64),
		"byte":                            byte(200),
		"float32":                         float32(1.25),
		"float64":                         math.Inf(1),
		"decimal":                         amqp.Decimal{Scale: 3, Value: 1500},
		"bytes":                           []byte("\x00raw"),
		"timestamp":                       t1,
		"void":                            nil,
		"array":                           []interface{}{"a", int32(1), []interface{}(nil), amqp.Table{}},
		"table":                           amqp.Table{"nested": amqp.Table{"n": int64(1), "s": "x"}},
	}
}

// deliveryHeaders returns userHeaders plus the headers RabbitMQ adds to a
// message dead-lettered and then delivered by the delayed-message plugin,
// plus headers named like this package's metadata keys.
func deliveryHeaders() amqp.Table {
	h := userHeaders()
	h[HeaderDeath] = []interface{}{rejectedOnce()}
	h[HeaderFirstDeathQueue] = "orders"
	h[HeaderFirstDeathReason] = ReasonRejected
	h[HeaderFirstDeathExchange] = "shop"
	h[HeaderLastDeathQueue] = "orders"
	h[HeaderLastDeathReason] = ReasonRejected
	h[HeaderLastDeathExchange] = "shop"
	h[HeaderDelay] = int32(-5000)
	h[HeaderDeliveryCount] = int64(2)
	h[HeaderCC] = []interface{}{"audit"}
	h[HeaderBCC] = []interface{}{"secret"}
	h[TypedHeadersKey] = `["plain"]`
	h[DeliveryExchangeKey] = int32(1)
	h[DeliveryRoutingKeyKey] = "forged"
	return h
}

func delivery() amqp.Delivery {
	return amqp.Delivery{
		Headers:    deliveryHeaders(),
		Exchange:   "shop",
		RoutingKey: "order.created",
		Body:       []byte(`{"id":1}`),
	}
}

func TestDefaultMarshalerFails(t *testing.T) {
	// The reason this package exists; if watermill-amqp starts accepting
	// such headers, the wrapper may no longer be needed.
	_, err := wamqp.DefaultMarshaler{}.Unmarshal(delivery())
	if err == nil || !strings.Contains(err.Error(), "is not a string") {
		t.Fatalf("DefaultMarshaler.Unmarshal error = %v, want a non-string metadata error", err)
	}
}

func TestMarshalerRoundTrip(t *testing.T) {
	d := delivery()
	msg, err := Marshaler{}.Unmarshal(d)
	if err != nil {
		t.Fatalf("Unmarshal: %v", err)
	}
	if !sameValue(d.Headers, deliveryHeaders()) {
		t.Error("Unmarshal modified the delivery headers")
	}
	if msg.UUID != "uuid-1" || string(msg.Payload) != `{"id":1}` {
		t.Errorf("Unmarshal UUID, payload = %q, %q", msg.UUID, msg.Payload)
	}
	for key, want := range map[string]string{
		"plain":               "text",
		"json-looking":        `{"int32":1}`,
		"int32":               `{"int32":-32}`,
		HeaderFirstDeathQueue: "orders",
		HeaderDeliveryCount:   `{"int64":2}`,
		DeliveryExchangeKey:   "shop",
		DeliveryRoutingKeyKey: "order.created",
		TypedHeadersKey: `["BCC","CC","array","bool","byte","bytes","decimal","float32","float64",` +
			`"int16","int32","int64","int8","table","timestamp","void","x-death","x-delay","x-delivery-count"]`,
	} {
		if got := msg.Metadata[key]; got != want {
			t.Errorf("metadata %q = %q, want %q", key, got, want)
		}
	}

	p, err := Marshaler{}.Marshal(msg)
	if err != nil {
		t.Fatalf("Marshal: %v", err)
	}
	if !sameValue(p.Headers, userHeaders()) {
		t.Errorf("Marshal headers =\n%#v\nwant\n%#v", p.Headers, userHeaders())
	}
	if err := p.Headers.Validate(); err != nil {
		t.Errorf("published headers are not a valid AMQP table: %v", err)
	}
	if string(p.Body) != `{"id":1}` || p.DeliveryMode != amqp.Persistent {
		t.Errorf("Marshal body, delivery mode = %q, %d", p.Body, p.DeliveryMode)
	}
}

func TestMarshalerPlainMessageLikeDefault(t *testing.T) {
	msg := message.NewMessage("uuid-2", []byte("payload"))
	msg.Metadata.Set("a", "1")
	msg.Metadata.Set("b", `{"bool":true}`)
	want, err := wamqp.DefaultMarshaler{}.Marshal(msg)
	if err != nil {
		t.Fatal(err)
	}
	msg.Metadata.Set(HeaderDeath, "forged") // broker-owned: dropped
	got, err := Marshaler{}.Marshal(msg)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Marshal = %#v, want %#v", got, want)
	}
}

func TestMarshalDoesNotModifyMessage(t *testing.T) {
	msg, err := Marshaler{}.Unmarshal(delivery())
	if err != nil {
		t.Fatal(err)
	}
	md := maps.Clone(msg.Metadata)
	payload := append([]byte(nil), msg.Payload...)
	uuid := msg.UUID

	if _, err := (Marshaler{}).Marshal(msg); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(msg.Metadata, md) {
		t.Errorf("Marshal modified the metadata: %v, was %v", msg.Metadata, md)
	}
	if !bytes.Equal(msg.Payload, payload) || msg.UUID != uuid {
		t.Error("Marshal modified the message")
	}
}

func TestMarshalerInnerOptions(t *testing.T) {
	var seen amqp.Table
	m := Marshaler{Inner: wamqp.DefaultMarshaler{
		MessageUUIDHeaderKey:      "id",
		NotPersistentDeliveryMode: true,
		PostprocessPublishing: func(p amqp.Publishing) amqp.Publishing {
			seen = maps.Clone(p.Headers)
			p.Headers[HeaderDelay] = int32(1000)
			return p
		},
	}}
	msg, err := m.Unmarshal(amqp.Delivery{Headers: amqp.Table{"id": "uuid-3", "n": int64(1), HeaderDelay: int32(-10)}})
	if err != nil {
		t.Fatal(err)
	}
	if msg.UUID != "uuid-3" {
		t.Errorf("UUID = %q, want uuid-3", msg.UUID)
	}
	p, err := m.Marshal(msg)
	if err != nil {
		t.Fatal(err)
	}
	if want := (amqp.Table{"id": "uuid-3", "n": int64(1)}); !reflect.DeepEqual(seen, want) {
		t.Errorf("PostprocessPublishing saw %#v, want %#v", seen, want)
	}
	if want := (amqp.Table{"id": "uuid-3", "n": int64(1), HeaderDelay: int32(1000)}); !reflect.DeepEqual(p.Headers, want) {
		t.Errorf("headers = %#v, want %#v", p.Headers, want)
	}
	if p.DeliveryMode != 0 {
		t.Errorf("DeliveryMode = %d, want transient", p.DeliveryMode)
	}
}

// nested returns v inside n tables.
func nested(n int, v interface{}) interface{} {
	for range n {
		v = amqp.Table{"k": v}
	}
	return v
}

func TestUnmarshalKeepsHeadersTheTypedEncodingCannotCarry(t *testing.T) {
	tests := map[string]amqp.Table{
		"non-string UUID":                 {wamqp.DefaultMessageUUIDHeaderKey: int64(1), "plain": "p"},
		"non-UTF-8 name, non-string":      {"\xff": int64(1), "n": int32(2)},
		"non-UTF-8 key in a nested table": {"h": amqp.Table{"\xfe": "v"}},
		"nesting deeper than MaxDepth":    {"deep": nested(MaxDepth+5, int64(7)), "shallow": nested(2, true)},
		"deep array":                      {"a": []interface{}{nested(MaxDepth+1, []byte{})}},
	}
	for name, headers := range tests {
		t.Run(name, func(t *testing.T) {
			msg, err := Marshaler{}.Unmarshal(amqp.Delivery{Headers: headers})
			if err != nil {
				t.Fatalf("Unmarshal: %v", err)
			}
			if msg.Metadata[RawHeadersKey] == "" {
				t.Fatalf("no %s in %v", RawHeadersKey, msg.Metadata)
			}
			p, err := Marshaler{}.Marshal(msg)
			if err != nil {
				t.Fatalf("Marshal: %v", err)
			}
			want := maps.Clone(headers)
			if _, ok := want[wamqp.DefaultMessageUUIDHeaderKey]; !ok {
				want[wamqp.DefaultMessageUUIDHeaderKey] = ""
			}
			if !sameValue(p.Headers, want) {
				t.Errorf("round trip gave\n%#v\nwant\n%#v", p.Headers, want)
			}
		})
	}

	// A Go type amqp091-go never reads off the wire cannot be carried at all.
	d := amqp.Delivery{Headers: amqp.Table{"h": amqp.Table{"\xff": uint64(1)}}}
	if _, err := (Marshaler{}).Unmarshal(d); !errors.Is(err, ErrUnsupported) {
		t.Errorf("Unmarshal of an unsupported type error = %v, want ErrUnsupported", err)
	}
}

func TestMarshalToleratesChangedMetadata(t *testing.T) {
	tests := []struct {
		name string
		md   message.Metadata
		want amqp.Table
	}{
		{
			name: "malformed typed-headers list: every value is a string",
			md:   message.Metadata{TypedHeadersKey: "x", "n": `{"int32":5}`},
			want: amqp.Table{"n": `{"int32":5}`},
		},
		{
			name: "a handler changed a typed value to a plain string",
			md:   message.Metadata{"n": "6", TypedHeadersKey: `["n"]`},
			want: amqp.Table{"n": "6"},
		},
		{
			name: "raw headers that are not base64",
			md:   message.Metadata{RawHeadersKey: "%%%", "a": "b"},
			want: amqp.Table{"a": "b"},
		},
		{
			name: "raw headers that are not a table",
			md:   message.Metadata{RawHeadersKey: "AAAA/w==", "a": "b"},
			want: amqp.Table{"a": "b"},
		},
		{
			name: "a malformed broker-owned header is dropped before decoding",
			md:   message.Metadata{HeaderDeath: "garbage", TypedHeadersKey: `["x-death"]`},
			want: amqp.Table{},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			msg := message.NewMessage("u", nil)
			msg.Metadata = tt.md
			p, err := Marshaler{}.Marshal(msg)
			if err != nil {
				t.Fatalf("Marshal: %v", err)
			}
			tt.want[wamqp.DefaultMessageUUIDHeaderKey] = "u"
			if !reflect.DeepEqual(p.Headers, tt.want) {
				t.Errorf("headers = %#v, want %#v", p.Headers, tt.want)
			}
		})
	}
}
