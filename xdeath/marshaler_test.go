package xdeath

import (
	"bytes"
	"errors"
	"maps"
	"math"
	"reflect"
	"slices"
	"strings"
	"testing"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/marshal"
	"github.com/amqpretry/amqpretry/internal/wire"
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
// message dead-lettered, then delivered by the delayed-message plugin from a
// quorum queue, plus headers named like the marshaler's reserved metadata
// keys.
func deliveryHeaders() amqp.Table {
	h := userHeaders()
	h[headerDeath] = []interface{}{rejectedOnce()}
	h[headerFirstDeathQueue] = "orders"
	h[headerFirstDeathReason] = "rejected"
	h[headerFirstDeathExchange] = "shop"
	h[headerLastDeathQueue] = "orders"
	h[headerLastDeathReason] = "rejected"
	h[headerLastDeathExchange] = "shop"
	h[keys.XDelay] = int32(-5000)
	h[keys.XDeliveryCount] = int64(2)
	h[keys.XAcquiredCount] = int64(1)
	h["CC"] = []interface{}{"audit"}
	h["BCC"] = []interface{}{"secret"}
	h[keys.TypedHeaders] = `["plain"]`
	h[keys.RawHeaders] = "forged"
	h[keys.DeliveryExchange] = int32(1)
	h[keys.DeliveryRoutingKey] = "forged"
	h[keys.Subscriber] = "forged"
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
	// such headers, the marshaler may no longer be needed.
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
	if !wire.Equal(d.Headers, deliveryHeaders()) {
		t.Error("Unmarshal modified the delivery headers")
	}
	if msg.UUID != "uuid-1" || string(msg.Payload) != `{"id":1}` {
		t.Errorf("Unmarshal UUID, payload = %q, %q", msg.UUID, msg.Payload)
	}
	typed := []string{"BCC", "CC", "array", "bool", "byte", "bytes", "decimal", "float32", "float64",
		"int16", "int32", "int64", "int8", "table", "timestamp", "void",
		"x-acquired-count", "x-death", "x-delay", "x-delivery-count"}
	for key, want := range map[string]string{
		"plain":               "text",
		"json-looking":        `{"int32":1}`,
		"not-utf8":            "\xff\xfe",
		"int32":               `{"int32":-32}`,
		headerFirstDeathQueue: "orders",
		keys.XDeliveryCount:   `{"int64":2}`,
		keys.TypedHeaders:     `["` + strings.Join(typed, `","`) + `"]`,
	} {
		if got := msg.Metadata[key]; got != want {
			t.Errorf("metadata %q = %q, want %q", key, got, want)
		}
	}
	// Exactly the headers, less the UUID and the reserved names, plus the typed list:
	// a plain Marshaler records nothing of the delivery's route or subscriber.
	var wantKeys []string
	for k := range deliveryHeaders() {
		if !keys.Reserved(k) && k != wamqp.DefaultMessageUUIDHeaderKey {
			wantKeys = append(wantKeys, k)
		}
	}
	wantKeys = append(wantKeys, keys.TypedHeaders)
	slices.Sort(wantKeys)
	if got := slices.Sorted(maps.Keys(msg.Metadata)); !slices.Equal(got, wantKeys) {
		t.Errorf("metadata keys\n%q\nwant\n%q", got, wantKeys)
	}

	p, err := Marshaler{}.Marshal(msg)
	if err != nil {
		t.Fatalf("Marshal: %v", err)
	}
	if !wire.Equal(p.Headers, userHeaders()) {
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
	for _, owned := range []string{headerDeath, headerLastDeathQueue, keys.XDelay, keys.XDeliveryCount, keys.XAcquiredCount, "CC", "BCC"} {
		msg.Metadata.Set(owned, "forged") // broker-owned: dropped
	}
	for _, reserved := range []string{keys.TypedHeaders, keys.DeliveryExchange, keys.DeliveryRoutingKey, keys.Subscriber} {
		msg.Metadata.Set(reserved, `[]`) // the marshaler's own: never published
	}
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

// TestMarshalerOptions: the DefaultMarshaler's options, now fields of Marshaler
// (they were the fields of its Inner DefaultMarshaler).
func TestMarshalerOptions(t *testing.T) {
	var seen amqp.Table
	m := Marshaler{
		MessageUUIDHeaderKey:      "id",
		NotPersistentDeliveryMode: true,
		PostprocessPublishing: func(p amqp.Publishing) amqp.Publishing {
			seen = maps.Clone(p.Headers)
			p.Headers[keys.XDelay] = int32(1000)
			return p
		},
	}
	msg, err := m.Unmarshal(amqp.Delivery{Headers: amqp.Table{"id": "uuid-3", "n": int64(1), keys.XDelay: int32(-10)}})
	if err != nil {
		t.Fatal(err)
	}
	if msg.UUID != "uuid-3" {
		t.Errorf("UUID = %q, want uuid-3", msg.UUID)
	}
	if _, ok := msg.Metadata["id"]; ok {
		t.Errorf("the UUID header is in the metadata: %v", msg.Metadata)
	}
	p, err := m.Marshal(msg)
	if err != nil {
		t.Fatal(err)
	}
	if want := (amqp.Table{"id": "uuid-3", "n": int64(1)}); !reflect.DeepEqual(seen, want) {
		t.Errorf("PostprocessPublishing saw %#v, want %#v", seen, want)
	}
	if want := (amqp.Table{"id": "uuid-3", "n": int64(1), keys.XDelay: int32(1000)}); !reflect.DeepEqual(p.Headers, want) {
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
		"nesting deeper than MaxDepth":    {"deep": nested(marshal.MaxDepth+5, int64(7)), "shallow": nested(2, true)},
		"deep array":                      {"a": []interface{}{nested(marshal.MaxDepth+1, []byte{})}},
	}
	for name, headers := range tests {
		t.Run(name, func(t *testing.T) {
			msg, err := Marshaler{}.Unmarshal(amqp.Delivery{Headers: headers})
			if err != nil {
				t.Fatalf("Unmarshal: %v", err)
			}
			if msg.Metadata[keys.RawHeaders] == "" {
				t.Fatalf("no %s in %v", keys.RawHeaders, msg.Metadata)
			}
			p, err := Marshaler{}.Marshal(msg)
			if err != nil {
				t.Fatalf("Marshal: %v", err)
			}
			want := maps.Clone(headers)
			if _, ok := want[wamqp.DefaultMessageUUIDHeaderKey]; !ok {
				want[wamqp.DefaultMessageUUIDHeaderKey] = ""
			}
			if !wire.Equal(p.Headers, want) {
				t.Errorf("round trip gave\n%#v\nwant\n%#v", p.Headers, want)
			}
		})
	}

	// A broker-owned header kept raw is left out all the same.
	for _, h := range []string{headerDeath, keys.XDelay, "CC"} {
		msg, err := Marshaler{}.Unmarshal(amqp.Delivery{Headers: amqp.Table{h: nested(marshal.MaxDepth+1, int64(1)), "n": int32(1)}})
		if err != nil {
			t.Fatal(err)
		}
		if msg.Metadata[keys.RawHeaders] == "" {
			t.Fatalf("%s: no %s in %v", h, keys.RawHeaders, msg.Metadata)
		}
		p, err := Marshaler{}.Marshal(msg)
		if err != nil {
			t.Fatal(err)
		}
		if want := (amqp.Table{"n": int32(1), wamqp.DefaultMessageUUIDHeaderKey: ""}); !wire.Equal(p.Headers, want) {
			t.Errorf("%s kept raw: published %#v, want %#v", h, p.Headers, want)
		}
	}

	// A Go type amqp091-go never reads off the wire cannot be carried at all.
	d := amqp.Delivery{Headers: amqp.Table{"h": amqp.Table{"\xff": uint64(1)}}}
	if _, err := (Marshaler{}).Unmarshal(d); !errors.Is(err, wire.ErrUnsupported) {
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
			md:   message.Metadata{keys.TypedHeaders: "x", "n": `{"int32":5}`},
			want: amqp.Table{"n": `{"int32":5}`},
		},
		{
			name: "a handler changed a typed value to a plain string",
			md:   message.Metadata{"n": "6", keys.TypedHeaders: `["n"]`},
			want: amqp.Table{"n": "6"},
		},
		{
			name: "a typed value listed but gone",
			md:   message.Metadata{"a": "b", keys.TypedHeaders: `["gone"]`},
			want: amqp.Table{"a": "b"},
		},
		{
			name: "raw headers that are not base64",
			md:   message.Metadata{keys.RawHeaders: "%%%", "a": "b"},
			want: amqp.Table{"a": "b"},
		},
		{
			name: "raw headers that are not a table",
			md:   message.Metadata{keys.RawHeaders: "AAAA/w==", "a": "b"},
			want: amqp.Table{"a": "b"},
		},
		{
			name: "a malformed broker-owned header is dropped before decoding",
			md:   message.Metadata{headerDeath: "garbage", keys.TypedHeaders: `["x-death"]`},
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
