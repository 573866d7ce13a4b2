package xdeath

import (
	"errors"
	"math"
	"reflect"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
)

var (
	t1 = time.Unix(1700000000, 0) // as amqp091-go decodes timestamps: local time
	t2 = time.Unix(1700000100, 0)
)

// rejectedOnce is an x-death entry as RabbitMQ writes it when a consumer
// rejects a message from queue "orders".
func rejectedOnce() amqp.Table {
	return amqp.Table{
		FieldCount:       int64(1),
		FieldExchange:    "shop",
		FieldQueue:       "orders",
		FieldReason:      ReasonRejected,
		FieldRoutingKeys: []interface{}{"order.created"},
		FieldTime:        t1,
	}
}

func TestParse(t *testing.T) {
	expiredTwice := amqp.Table{
		FieldCount:              int64(2),
		FieldExchange:           "",
		FieldQueue:              "orders.wait",
		FieldReason:             ReasonExpired,
		FieldRoutingKeys:        []interface{}{"orders.wait", "cc-key"},
		FieldTime:               t2,
		FieldOriginalExpiration: "5000",
	}
	tests := []struct {
		name    string
		headers amqp.Table
		want    Info
	}{
		{name: "nil table"},
		{name: "no dead-letter headers", headers: amqp.Table{"other": int32(1)}},
		{
			name: "one entry",
			headers: amqp.Table{
				HeaderDeath:              []interface{}{rejectedOnce()},
				HeaderFirstDeathQueue:    "orders",
				HeaderFirstDeathReason:   ReasonRejected,
				HeaderFirstDeathExchange: "shop",
			},
			want: Info{
				Deaths: []Death{{
					Queue: "orders", Reason: ReasonRejected, Exchange: "shop", Count: 1,
					Time: t1.UTC(), RoutingKeys: []string{"order.created"},
				}},
				FirstQueue: "orders", FirstReason: ReasonRejected, FirstExchange: "shop",
			},
		},
		{
			name: "two entries newest first with original expiration",
			headers: amqp.Table{
				HeaderDeath:              []interface{}{expiredTwice, rejectedOnce()},
				HeaderFirstDeathQueue:    "orders",
				HeaderFirstDeathReason:   ReasonRejected,
				HeaderFirstDeathExchange: "shop",
				HeaderLastDeathQueue:     "orders.wait",
				HeaderLastDeathReason:    ReasonExpired,
				HeaderLastDeathExchange:  "",
			},
			want: Info{
				Deaths: []Death{
					{
						Queue: "orders.wait", Reason: ReasonExpired, Count: 2, Time: t2.UTC(),
						RoutingKeys: []string{"orders.wait", "cc-key"}, OriginalExpiration: "5000",
					},
					{
						Queue: "orders", Reason: ReasonRejected, Exchange: "shop", Count: 1,
						Time: t1.UTC(), RoutingKeys: []string{"order.created"},
					},
				},
				FirstQueue: "orders", FirstReason: ReasonRejected, FirstExchange: "shop",
				LastQueue: "orders.wait", LastReason: ReasonExpired,
			},
		},
		{
			name: "unknown fields are kept",
			headers: amqp.Table{HeaderDeath: []interface{}{amqp.Table{
				FieldQueue: "q", FieldCount: int64(1), "x-future": amqp.Table{"a": true}, "n": nil,
			}}},
			want: Info{Deaths: []Death{{
				Queue: "q", Count: 1, Extra: amqp.Table{"x-future": amqp.Table{"a": true}, "n": nil},
			}}},
		},
		{
			name: "any integer width for count",
			headers: amqp.Table{HeaderDeath: []interface{}{
				amqp.Table{FieldCount: int8(1)}, amqp.Table{FieldCount: int16(2)},
				amqp.Table{FieldCount: int32(3)}, amqp.Table{FieldCount: 4},
				amqp.Table{FieldCount: uint8(5)}, amqp.Table{FieldCount: uint16(6)},
				amqp.Table{FieldCount: uint32(7)}, amqp.Table{FieldCount: uint(8)},
				amqp.Table{FieldCount: uint64(math.MaxInt64)},
			}},
			want: Info{Deaths: []Death{
				{Count: 1}, {Count: 2}, {Count: 3}, {Count: 4}, {Count: 5},
				{Count: 6}, {Count: 7}, {Count: 8}, {Count: math.MaxInt64},
			}},
		},
		{
			name:    "empty x-death and routing keys",
			headers: amqp.Table{HeaderDeath: []interface{}{amqp.Table{FieldRoutingKeys: []interface{}(nil)}}},
			want:    Info{Deaths: []Death{{RoutingKeys: []string{}}}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Parse(tt.headers)
			if err != nil {
				t.Fatalf("Parse: %v", err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("Parse =\n%#v\nwant\n%#v", got, tt.want)
			}
		})
	}
}

func TestParseMalformed(t *testing.T) {
	withDeath := func(entries ...interface{}) amqp.Table { return amqp.Table{HeaderDeath: entries} }
	tests := []struct {
		name    string
		headers amqp.Table
		want    string
	}{
		{"x-death not an array", amqp.Table{HeaderDeath: "[]"}, "x-death: want array, got string"},
		{"entry not a table", withDeath(rejectedOnce(), int32(1)), "x-death[1]: want table, got int32"},
		{"count string", withDeath(rejectedOnce(), amqp.Table{FieldCount: "1"}), "x-death[1].count: want integer, got string"},
		{"count negative", withDeath(amqp.Table{FieldCount: int64(-1)}), "x-death[0].count: want non-negative integer, got -1"},
		{"count overflows", withDeath(amqp.Table{FieldCount: uint64(math.MaxInt64 + 1)}), "x-death[0].count: want integer, got uint64"},
		{"count float", withDeath(amqp.Table{FieldCount: 1.0}), "x-death[0].count: want integer, got float64"},
		{"queue not string", withDeath(amqp.Table{FieldQueue: []byte("q")}), "x-death[0].queue: want string, got bytes"},
		{"reason nil", withDeath(amqp.Table{FieldReason: nil}), "x-death[0].reason: want string, got void"},
		{"time as integer", withDeath(amqp.Table{FieldTime: int64(1700000000)}), "x-death[0].time: want timestamp, got int64"},
		{"routing keys not array", withDeath(amqp.Table{FieldRoutingKeys: "rk"}), "x-death[0].routing-keys: want array, got string"},
		{"routing key not string", withDeath(amqp.Table{FieldRoutingKeys: []interface{}{"a", int64(1)}}), "x-death[0].routing-keys[1]: want string, got int64"},
		{"first death header", amqp.Table{HeaderFirstDeathQueue: int32(1)}, "x-first-death-queue: want string, got int32"},
		{"last death header", amqp.Table{HeaderLastDeathExchange: amqp.Table{}}, "x-last-death-exchange: want string, got table"},
		{"foreign type", amqp.Table{HeaderLastDeathReason: struct{}{}}, "x-last-death-reason: want string, got struct {}"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			info, err := Parse(tt.headers)
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("Parse error = %v, want ErrMalformed", err)
			}
			if want := "malformed value: " + tt.want; err.Error() != want {
				t.Errorf("Parse error = %q, want %q", err, want)
			}
			if !reflect.DeepEqual(info, Info{}) {
				t.Errorf("Parse returned %#v with an error, want zero Info", info)
			}
		})
	}
}

func TestInfoCounts(t *testing.T) {
	info := Info{Deaths: []Death{
		{Queue: "orders.wait", Reason: ReasonExpired, Count: 3},
		{Queue: "orders", Reason: ReasonRejected, Count: 2},
	}}
	if got := info.Total(); got != 5 {
		t.Errorf("Total = %d, want 5", got)
	}
	if got := info.Count("orders", ReasonRejected); got != 2 {
		t.Errorf("Count(orders, rejected) = %d, want 2", got)
	}
	if got := info.Count("orders", ReasonExpired); got != 0 {
		t.Errorf("Count(orders, expired) = %d, want 0", got)
	}
	huge := Info{Deaths: []Death{{Count: math.MaxInt64}, {Count: 1}}}
	if got := huge.Total(); got != math.MaxInt64 {
		t.Errorf("Total = %d, want saturation at MaxInt64", got)
	}
	if got := (Info{}).Total(); got != 0 {
		t.Errorf("zero Info Total = %d", got)
	}
}

func TestIsBrokerOwned(t *testing.T) {
	owned := []string{
		HeaderDeath, HeaderFirstDeathQueue, HeaderFirstDeathReason, HeaderFirstDeathExchange,
		HeaderLastDeathQueue, HeaderLastDeathReason, HeaderLastDeathExchange,
		"x-first-death-future", "x-last-death-future",
		HeaderDelay, HeaderDeliveryCount, HeaderCC, HeaderBCC,
	}
	for _, h := range owned {
		if !IsBrokerOwned(h) {
			t.Errorf("IsBrokerOwned(%q) = false", h)
		}
	}
	for _, h := range []string{"", "x-deaths", "X-Death", "cc", "bcc", "x-delay-ms", "x-first-death", "attempt", TypedHeadersKey} {
		if IsBrokerOwned(h) {
			t.Errorf("IsBrokerOwned(%q) = true", h)
		}
	}
}

func TestFromMetadata(t *testing.T) {
	headers := amqp.Table{
		HeaderDeath:            []interface{}{rejectedOnce()},
		HeaderFirstDeathQueue:  "orders",
		HeaderFirstDeathReason: ReasonRejected,
		"unrelated":            int32(1),
	}
	msg, err := Marshaler{}.Unmarshal(amqp.Delivery{Headers: headers})
	if err != nil {
		t.Fatal(err)
	}
	want, err := Parse(headers)
	if err != nil {
		t.Fatal(err)
	}
	got, err := FromMetadata(msg.Metadata)
	if err != nil {
		t.Fatalf("FromMetadata: %v", err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("FromMetadata =\n%#v\nwant\n%#v", got, want)
	}

	info, err := FromMetadata(message.Metadata{"other": "x"})
	if err != nil || !reflect.DeepEqual(info, Info{}) {
		t.Errorf("FromMetadata without dead-letter metadata = %#v, %v", info, err)
	}
}

func TestFromMetadataMalformed(t *testing.T) {
	tests := []struct {
		name string
		md   message.Metadata
		want string
	}{
		{
			name: "x-death as plain string",
			md:   message.Metadata{HeaderDeath: `{"array":[]}`},
			want: "malformed value: x-death: want array, got string",
		},
		{
			name: "typed first-death header",
			md:   message.Metadata{HeaderFirstDeathQueue: `{"int32":1}`, TypedHeadersKey: `["x-first-death-queue"]`},
			want: "malformed value: x-first-death-queue: want string, got int32",
		},
		{
			name: "undecodable x-death",
			md:   message.Metadata{HeaderDeath: `{"array":[{"table":{"count":{"int64":"1"}}}]}`, TypedHeadersKey: `["x-death"]`},
			want: "malformed value: x-death[0].count: int64: json: cannot unmarshal string into Go value of type int64",
		},
		{
			name: "typed-headers list",
			md:   message.Metadata{TypedHeadersKey: `x-death`},
			want: "malformed value: amqpretry-typed-headers: want JSON array of strings: invalid character 'x' looking for beginning of value",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := FromMetadata(tt.md)
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("FromMetadata error = %v, want ErrMalformed", err)
			}
			if err.Error() != tt.want {
				t.Errorf("FromMetadata error = %q, want %q", err, tt.want)
			}
		})
	}
}
