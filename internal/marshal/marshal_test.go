package marshal

import (
	"errors"
	"maps"
	"reflect"
	"slices"
	"strconv"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/wire"
)

// retried is a delivery as the retry subscriber receives a retry: dead-lettered by a
// ttl-tiers delay queue (x-death, the first/last death headers, the tier header it was
// routed on) from a quorum queue that counts deliveries, with its envelope and a user
// header of its own.
func retried() amqp.Delivery {
	return amqp.Delivery{
		Exchange:   "amqpretry.deliver",
		RoutingKey: "orders",
		Body:       []byte("body"),
		Headers: amqp.Table{
			DefaultUUIDKey:             "uuid-1",
			keys.XDeath:                []interface{}{rejectedOnce()},
			"x-first-death-queue":      "amqpretry.delay.5s",
			"x-first-death-reason":     "expired",
			keys.XDeliveryCount:        int64(2),
			keys.XAcquiredCount:        int64(1),
			keys.XDelay:                int32(5000),
			"CC":                       []interface{}{"audit"},
			keys.Tier:                  "5s",
			keys.Attempt:               "2",
			"tenant":                   int32(7),
			keys.Subscriber:            "forged",
			keys.DeliveryExchange:      "forged",
			keys.TypedHeaders:          `["tenant"]`,
			"amqpretry-something-else": "kept",
		},
	}
}

func TestRetryOptions(t *testing.T) {
	d := retried()
	m := Marshaler{Options{Retry: true, Delivered: deliveredAs("sub-1")}}
	msg, err := m.Unmarshal(d)
	if err != nil {
		t.Fatal(err)
	}
	want := message.Metadata{
		"x-first-death-queue":      "amqpretry.delay.5s", // string: carried, as FromMetadata reads it
		"x-first-death-reason":     "expired",
		keys.Attempt:               "2",
		"tenant":                   `{"int32":7}`,
		"amqpretry-something-else": "kept",
		keys.TypedHeaders:          `["tenant"]`,
		keys.DeliveryExchange:      "amqpretry.deliver",
		keys.DeliveryRoutingKey:    "orders",
		keys.Subscriber:            "sub-1",
	}
	if !reflect.DeepEqual(msg.Metadata, want) {
		t.Errorf("metadata\n%v\nwant\n%v", msg.Metadata, want)
	}
	if msg.UUID != "uuid-1" || string(msg.Payload) != "body" {
		t.Errorf("UUID, payload = %q, %q", msg.UUID, msg.Payload)
	}
	if !wire.Equal(d.Headers, retried().Headers) {
		t.Error("Unmarshal modified the delivery headers")
	}

	p, err := m.Marshal(msg)
	if err != nil {
		t.Fatal(err)
	}
	wantHeaders := amqp.Table{DefaultUUIDKey: "uuid-1", keys.Attempt: "2", "tenant": int32(7), "amqpretry-something-else": "kept"}
	if !reflect.DeepEqual(p.Headers, wantHeaders) {
		t.Errorf("published %#v, want %#v", p.Headers, wantHeaders)
	}

	// Without a Delivered hook the key is not written; the delivery's route still is, even
	// the default exchange's "".
	msg, err = Marshaler{Options{Retry: true}}.Unmarshal(amqp.Delivery{RoutingKey: "q", Headers: amqp.Table{keys.Subscriber: "forged"}})
	if err != nil {
		t.Fatal(err)
	}
	if want := (message.Metadata{keys.DeliveryExchange: "", keys.DeliveryRoutingKey: "q"}); !reflect.DeepEqual(msg.Metadata, want) {
		t.Errorf("metadata %v, want %v", msg.Metadata, want)
	}

	// A plain marshaler records no route and keeps the tier header.
	msg, err = Marshaler{}.Unmarshal(retried())
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{keys.DeliveryExchange, keys.DeliveryRoutingKey, keys.Subscriber} {
		if v, ok := msg.Metadata[k]; ok {
			t.Errorf("plain marshaler wrote %s = %q", k, v)
		}
	}
	if msg.Metadata[keys.Tier] != "5s" {
		t.Errorf("plain marshaler dropped the tier header: %v", msg.Metadata)
	}
}

// TestRetryDropsBrokerOwnedWithoutEncoding: the retry subscriber drops the
// broker-owned non-string headers before encoding them, so one that no encoding could
// carry (a Go type the AMQP codec has no field type for) costs nothing and fails
// nothing; the plain marshaler, which keeps them, cannot carry it.
func TestRetryDropsBrokerOwnedWithoutEncoding(t *testing.T) {
	for _, h := range []string{keys.XDeath, keys.XDeliveryCount, keys.XAcquiredCount, keys.XDelay, "CC", "BCC", "x-last-death-future"} {
		d := amqp.Delivery{Headers: amqp.Table{h: amqp.Table{"\xff": uint64(1)}, "n": int64(1)}}
		if _, err := (Marshaler{}).Unmarshal(d); !errors.Is(err, wire.ErrUnsupported) {
			t.Fatalf("%s: plain Unmarshal: %v, want ErrUnsupported", h, err)
		}
		msg, err := Marshaler{Options{Retry: true}}.Unmarshal(d)
		if err != nil {
			t.Fatalf("%s: retry Unmarshal: %v", h, err)
		}
		if _, ok := msg.Metadata[h]; ok {
			t.Errorf("%s kept", h)
		}
		if _, ok := msg.Metadata[keys.RawHeaders]; ok {
			t.Errorf("%s: kept raw", h)
		}
		if got := slices.Sorted(maps.Keys(msg.Metadata)); !slices.Equal(got, []string{keys.DeliveryExchange, keys.DeliveryRoutingKey, keys.TypedHeaders, "n"}) {
			t.Errorf("%s: metadata keys %v", h, got)
		}
	}
	// The tier header goes whatever its type.
	msg, err := Marshaler{Options{Retry: true}}.Unmarshal(amqp.Delivery{Headers: amqp.Table{keys.Tier: amqp.Table{"\xff": uint64(1)}}})
	if err != nil || len(msg.Metadata) != 2 {
		t.Errorf("tier header of a foreign type: %v, %v", msg.Metadata, err)
	}
}

func TestReturnedAttempts(t *testing.T) {
	for _, tt := range []struct {
		name     string
		attempt  interface{} // the keys.Attempt header; nil for none
		acquired interface{} // the x-acquired-count header; nil for none
		want     string      // "" for no keys.Attempt
	}{
		{"first return, no attempt", nil, int64(1), "2"},
		{"two returns, no attempt", nil, int64(2), "3"},
		{"attempt 1", "1", int64(2), "3"},
		{"attempt carried by a copy", "4", int64(1), "5"},
		{"unreadable attempt counts as 1", "x", int64(1), "2"},
		{"attempt 0 counts as 1", "0", int64(1), "2"},
		{"negative attempt counts as 1", "-3", int64(1), "2"},
		{"any integer width", nil, int32(3), "4"},
		{"never returned", "3", nil, "3"},
		{"never returned, no attempt", nil, nil, ""},
		{"zero returns", "3", int64(0), "3"},
		{"a string count is not the broker's", "3", "2", "3"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			headers := amqp.Table{}
			if tt.attempt != nil {
				headers[keys.Attempt] = tt.attempt
			}
			if tt.acquired != nil {
				headers[keys.XAcquiredCount] = tt.acquired
			}
			msg, err := Marshaler{Options{Retry: true, ReturnedAttempts: true}}.Unmarshal(amqp.Delivery{Headers: headers})
			if err != nil {
				t.Fatal(err)
			}
			got, ok := msg.Metadata[keys.Attempt]
			if got != tt.want || ok != (tt.want != "") {
				t.Errorf("attempt %q (set: %v), want %q", got, ok, tt.want)
			}
			if _, isString := tt.acquired.(string); !isString {
				if v, ok := msg.Metadata[keys.XAcquiredCount]; ok {
					t.Errorf("x-acquired-count kept in the metadata: %q", v)
				}
			}
		})
	}

	// Without the option the returns are not counted.
	msg, err := Marshaler{Options{Retry: true}}.Unmarshal(amqp.Delivery{Headers: amqp.Table{keys.Attempt: "2", keys.XAcquiredCount: int64(3)}})
	if err != nil || msg.Metadata[keys.Attempt] != "2" {
		t.Errorf("without ReturnedAttempts: attempt %q, %v; want 2", msg.Metadata[keys.Attempt], err)
	}
	// Without Retry the count is counted and kept, typed; it is never published.
	msg, err = Marshaler{Options{ReturnedAttempts: true}}.Unmarshal(amqp.Delivery{Headers: amqp.Table{keys.XAcquiredCount: int64(3)}})
	if err != nil || msg.Metadata[keys.Attempt] != "4" || msg.Metadata[keys.XAcquiredCount] != `{"int64":3}` {
		t.Errorf("ReturnedAttempts without Retry: %v, %v", msg.Metadata, err)
	}
	p, err := Marshaler{}.Marshal(msg)
	if err != nil {
		t.Fatal(err)
	}
	if want := (amqp.Table{DefaultUUIDKey: msg.UUID, keys.Attempt: "4"}); !reflect.DeepEqual(p.Headers, want) {
		t.Errorf("published %#v, want %#v", p.Headers, want)
	}
}

func TestOptionsUUIDKey(t *testing.T) {
	if got := DefaultUUIDKey; got != "_watermill_message_uuid" {
		t.Errorf("default UUIDKey %q", got)
	}
	m := Marshaler{Options{MessageUUIDHeaderKey: "id", Retry: true}}
	msg, err := m.Unmarshal(amqp.Delivery{Headers: amqp.Table{"id": "u-1", DefaultUUIDKey: "other"}})
	if err != nil {
		t.Fatal(err)
	}
	if msg.UUID != "u-1" || msg.Metadata[DefaultUUIDKey] != "other" {
		t.Errorf("UUID %q, metadata %v", msg.UUID, msg.Metadata)
	}
	p, err := m.Marshal(msg)
	if err != nil {
		t.Fatal(err)
	}
	if want := (amqp.Table{"id": "u-1", DefaultUUIDKey: "other"}); !reflect.DeepEqual(p.Headers, want) {
		t.Errorf("published %#v, want %#v", p.Headers, want)
	}
}

func TestTypedKeys(t *testing.T) {
	got, err := TypedKeys(message.Metadata{keys.TypedHeaders: `["x-death","amqpretry-delivery-exchange","listed-but-gone"]`})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]bool{"x-death": true, "amqpretry-delivery-exchange": false, "listed-but-gone": true}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("TypedKeys = %v, want %v (a reserved key is never decoded)", got, want)
	}
	if got, err := TypedKeys(message.Metadata{}); got != nil || err != nil {
		t.Errorf("TypedKeys without a list = %v, %v", got, err)
	}
	_, err = TypedKeys(message.Metadata{keys.TypedHeaders: `{"a":1}`})
	if !errors.Is(err, wire.ErrMalformed) || err.Error() != "malformed value: amqpretry-typed-headers: want JSON array of strings: json: cannot unmarshal object into Go value of type []string" {
		t.Errorf("TypedKeys of an object: %v", err)
	}
}

func TestHeader(t *testing.T) {
	md := message.Metadata{keys.XDeath: `{"array":[]}`, "plain": `{"int64":1}`, "broken": `{"int64":"1"}`}
	typed := map[string]bool{keys.XDeath: true, "broken": true}
	for _, tt := range []struct {
		key  string
		want interface{}
		ok   bool
	}{
		{keys.XDeath, []interface{}(nil), true},
		{"plain", `{"int64":1}`, true},
		{"absent", nil, false},
	} {
		v, ok, err := Header(md, typed, tt.key)
		if err != nil || ok != tt.ok || !reflect.DeepEqual(v, tt.want) {
			t.Errorf("Header(%q) = %#v, %v, %v; want %#v, %v", tt.key, v, ok, err, tt.want, tt.ok)
		}
	}
	if v, ok, err := Header(md, typed, "broken"); !errors.Is(err, wire.ErrMalformed) || ok || v != nil {
		t.Errorf("Header(broken) = %#v, %v, %v", v, ok, err)
	}
}

// TestBrokerOwned lists what the marshalers never publish (keys.BrokerOwned and
// keys.Reserved).
func TestBrokerOwned(t *testing.T) {
	owned := []string{
		"x-death", "x-first-death-queue", "x-first-death-reason", "x-first-death-exchange",
		"x-last-death-queue", "x-last-death-reason", "x-last-death-exchange",
		"x-first-death-future", "x-last-death-future",
		"x-delay", "x-delivery-count", "x-acquired-count", "CC", "BCC",
	}
	for _, h := range owned {
		if !keys.BrokerOwned(h) {
			t.Errorf("BrokerOwned(%q) = false", h)
		}
	}
	for _, h := range []string{"", "x-deaths", "X-Death", "cc", "bcc", "x-delay-ms", "x-first-death", "attempt", keys.TypedHeaders, keys.Tier} {
		if keys.BrokerOwned(h) {
			t.Errorf("BrokerOwned(%q) = true", h)
		}
	}
	for _, k := range []string{keys.TypedHeaders, keys.RawHeaders, keys.DeliveryExchange, keys.DeliveryRoutingKey, keys.Subscriber} {
		if !keys.Reserved(k) {
			t.Errorf("Reserved(%q) = false", k)
		}
	}
	for _, k := range []string{keys.Attempt, keys.Tier, "x-death", ""} {
		if keys.Reserved(k) {
			t.Errorf("Reserved(%q) = true", k)
		}
	}
}

// deliveredAs is a Delivered hook that marks each message as the given Retry's, as
// middleware.Retry.Delivered does.
func deliveredAs(id string) func(*message.Message, int) {
	return func(msg *message.Message, attempt int) {
		msg.Metadata[keys.Subscriber] = id
		if attempt > 0 {
			msg.Metadata[keys.Attempt] = strconv.Itoa(attempt)
		}
	}
}

// TestZeroDeliveryIsRefused: the zero Delivery, which watermill-amqp can read from a
// consumer's closed delivery channel, is refused before anything sees it (Delivered
// is not called). A real delivery with no headers and no body is a message: the broker
// gave it a delivery tag, and the channel acknowledges it.
func TestZeroDeliveryIsRefused(t *testing.T) {
	delivered := 0
	for _, m := range []Marshaler{{}, {Options{Retry: true, Delivered: func(*message.Message, int) { delivered++ }}}} {
		msg, err := m.Unmarshal(amqp.Delivery{})
		if !errors.Is(err, ErrZeroDelivery) || msg != nil {
			t.Errorf("Unmarshal(zero Delivery), retry %v = %v, %v; want ErrZeroDelivery", m.Retry, msg, err)
		}
		for _, d := range []amqp.Delivery{{DeliveryTag: 1}, {Body: []byte{}}, {Headers: amqp.Table{}}, {RoutingKey: "q"}, {Redelivered: true}} {
			if msg, err := m.Unmarshal(d); err != nil || msg == nil {
				t.Errorf("Unmarshal(%+v), retry %v = %v; want a message", d, m.Retry, err)
			}
		}
	}
	if delivered != 5 {
		t.Errorf("Delivered called %d times, want 5 (never for the zero Delivery)", delivered)
	}
}
