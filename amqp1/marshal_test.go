package amqp1

import (
	"errors"
	"math"
	"testing"
	"time"

	amqp "github.com/Azure/go-amqp"
	"github.com/ThreeDotsLabs/watermill/message"
)

func TestMarshalRoundTrip(t *testing.T) {
	in := message.NewMessage("uuid-1", []byte("payload"))
	in.Metadata.Set("a", "1")
	in.Metadata.Set(uuidKey+"x", "not the uuid")
	m := toAMQP(in)
	if !m.Header.Durable || m.Properties.MessageID != "uuid-1" || m.ApplicationProperties[uuidKey] != "uuid-1" {
		t.Fatalf("toAMQP: %+v %+v %v", m.Header, m.Properties, m.ApplicationProperties)
	}
	out, err := fromAMQP(m)
	if err != nil {
		t.Fatal(err)
	}
	if out.UUID != in.UUID || string(out.Payload) != "payload" || len(out.Metadata) != 2 || out.Metadata.Get("a") != "1" {
		t.Fatalf("round trip: %q %q %v", out.UUID, out.Payload, out.Metadata)
	}
	if m := toAMQP(message.NewMessage("", nil)); len(m.Data) != 1 || m.Data[0] == nil || m.Properties != nil {
		t.Fatalf("empty message: %+v", m)
	}
}

func TestFromAMQPBodies(t *testing.T) {
	for _, tc := range []struct {
		m       *amqp.Message
		payload string
		err     bool
	}{
		{&amqp.Message{Data: [][]byte{[]byte("a"), []byte("b")}}, "ab", false},
		{&amqp.Message{Value: "s"}, "s", false},
		{&amqp.Message{Value: []byte("b")}, "b", false},
		{&amqp.Message{}, "", false},
		{&amqp.Message{Value: int64(1)}, "", true},
		{&amqp.Message{Value: map[string]any{"a": 1}}, "", true},
		{&amqp.Message{Sequence: [][]any{{1}}}, "", true},
	} {
		msg, err := fromAMQP(tc.m)
		if tc.err {
			if !errors.Is(err, errBody) {
				t.Errorf("%+v: error %v, want errBody", tc.m, err)
			}
			continue
		}
		if err != nil || string(msg.Payload) != tc.payload {
			t.Errorf("%+v: payload %q, err %v", tc.m, msg.Payload, err)
		}
	}
}

func TestPropertyString(t *testing.T) {
	ts := time.Date(2026, 1, 2, 3, 4, 5, 0, time.FixedZone("x", 3600))
	for _, tc := range []struct {
		v    any
		want string
	}{
		{nil, ""}, {"s", "s"}, {amqp.Symbol("sym"), "sym"}, {true, "true"},
		{int8(-8), "-8"}, {int16(16), "16"}, {int32(-32), "-32"}, {int64(math.MinInt64), "-9223372036854775808"},
		{uint8(8), "8"}, {uint16(16), "16"}, {uint32(32), "32"}, {uint64(math.MaxUint64), "18446744073709551615"},
		{float32(0.1), "0.1"}, {0.25, "0.25"}, {ts, "2026-01-02T02:04:05Z"}, {[]byte{0xff, 0}, "/wA="},
		{amqp.UUID{0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0}, "12345678-9abc-def0-1234-56789abcdef0"},
		{'c', "99"},
	} {
		if got := propertyString(tc.v); got != tc.want {
			t.Errorf("%#v: %q, want %q", tc.v, got, tc.want)
		}
	}
}
