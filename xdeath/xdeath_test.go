package xdeath

import (
	"errors"
	"math"
	"reflect"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/keys"
)

var (
	t1 = time.Unix(1700000000, 0) // as amqp091-go decodes timestamps: local time
	t2 = time.Unix(1700000100, 0)
)

// rejectedOnce is an x-death entry as RabbitMQ writes it when a consumer
// rejects a message from queue "orders".
func rejectedOnce() amqp.Table {
	return amqp.Table{
		fieldCount:       int64(1),
		fieldExchange:    "shop",
		fieldQueue:       "orders",
		fieldReason:      "rejected",
		fieldRoutingKeys: []interface{}{"order.created"},
		fieldTime:        t1,
	}
}

func TestParse(t *testing.T) {
	expiredTwice := amqp.Table{
		fieldCount:              int64(2),
		fieldExchange:           "",
		fieldQueue:              "orders.wait",
		fieldReason:             "expired",
		fieldRoutingKeys:        []interface{}{"orders.wait", "cc-key"},
		fieldTime:               t2,
		fieldOriginalExpiration: "5000",
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
				headerDeath:              []interface{}{rejectedOnce()},
				headerFirstDeathQueue:    "orders",
				headerFirstDeathReason:   "rejected",
				headerFirstDeathExchange: "shop",
			},
			want: Info{
				Deaths: []Death{{
					Queue: "orders", Reason: "rejected", Exchange: "shop", Count: 1,
					Time: t1.UTC(), RoutingKeys: []string{"order.created"},
				}},
				FirstQueue: "orders", FirstReason: "rejected", FirstExchange: "shop",
			},
		},
		{
			name: "two entries newest first with original expiration",
			headers: amqp.Table{
				headerDeath:              []interface{}{expiredTwice, rejectedOnce()},
				headerFirstDeathQueue:    "orders",
				headerFirstDeathReason:   "rejected",
				headerFirstDeathExchange: "shop",
				headerLastDeathQueue:     "orders.wait",
				headerLastDeathReason:    "expired",
				headerLastDeathExchange:  "",
			},
			want: Info{
				Deaths: []Death{
					{
						Queue: "orders.wait", Reason: "expired", Count: 2, Time: t2.UTC(),
						RoutingKeys: []string{"orders.wait", "cc-key"}, OriginalExpiration: "5000",
					},
					{
						Queue: "orders", Reason: "rejected", Exchange: "shop", Count: 1,
						Time: t1.UTC(), RoutingKeys: []string{"order.created"},
					},
				},
				FirstQueue: "orders", FirstReason: "rejected", FirstExchange: "shop",
				LastQueue: "orders.wait", LastReason: "expired",
			},
		},
		{
			name: "unknown fields are kept",
			headers: amqp.Table{headerDeath: []interface{}{amqp.Table{
				fieldQueue: "q", fieldCount: int64(1), "x-future": amqp.Table{"a": true}, "n": nil,
			}}},
			want: Info{Deaths: []Death{{
				Queue: "q", Count: 1, Extra: amqp.Table{"x-future": amqp.Table{"a": true}, "n": nil},
			}}},
		},
		{
			name: "any integer width for count",
			headers: amqp.Table{headerDeath: []interface{}{
				amqp.Table{fieldCount: int8(1)}, amqp.Table{fieldCount: int16(2)},
				amqp.Table{fieldCount: int32(3)}, amqp.Table{fieldCount: 4},
				amqp.Table{fieldCount: uint8(5)}, amqp.Table{fieldCount: uint16(6)},
				amqp.Table{fieldCount: uint32(7)}, amqp.Table{fieldCount: uint(8)},
				amqp.Table{fieldCount: uint64(math.MaxInt64)},
			}},
			want: Info{Deaths: []Death{
				{Count: 1}, {Count: 2}, {Count: 3}, {Count: 4}, {Count: 5},
				{Count: 6}, {Count: 7}, {Count: 8}, {Count: math.MaxInt64},
			}},
		},
		{
			name:    "empty x-death and routing keys",
			headers: amqp.Table{headerDeath: []interface{}{amqp.Table{fieldRoutingKeys: []interface{}(nil)}}},
			want:    Info{Deaths: []Death{{RoutingKeys: []string{}}}},
		},
		{
			name:    "empty x-death array",
			headers: amqp.Table{headerDeath: []interface{}(nil)},
			want:    Info{Deaths: []Death{}},
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

func TestParseDoesNotModifyHeaders(t *testing.T) {
	headers := amqp.Table{headerDeath: []interface{}{rejectedOnce()}, headerFirstDeathQueue: "orders"}
	if _, err := Parse(headers); err != nil {
		t.Fatal(err)
	}
	want := amqp.Table{headerDeath: []interface{}{rejectedOnce()}, headerFirstDeathQueue: "orders"}
	if !reflect.DeepEqual(headers, want) {
		t.Errorf("Parse modified its headers: %#v", headers)
	}
}

func TestParseMalformed(t *testing.T) {
	withDeath := func(entries ...interface{}) amqp.Table { return amqp.Table{headerDeath: entries} }
	tests := []struct {
		name    string
		headers amqp.Table
		want    string
	}{
		{"x-death not an array", amqp.Table{headerDeath: "[]"}, "x-death: want array, got string"},
		{"entry not a table", withDeath(rejectedOnce(), int32(1)), "x-death[1]: want table, got int32"},
		{"count string", withDeath(rejectedOnce(), amqp.Table{fieldCount: "1"}), "x-death[1].count: want integer, got string"},
		{"count negative", withDeath(amqp.Table{fieldCount: int64(-1)}), "x-death[0].count: want non-negative integer, got -1"},
		{"count overflows", withDeath(amqp.Table{fieldCount: uint64(math.MaxInt64 + 1)}), "x-death[0].count: want integer, got uint64"},
		{"count float", withDeath(amqp.Table{fieldCount: 1.0}), "x-death[0].count: want integer, got float64"},
		{"queue not string", withDeath(amqp.Table{fieldQueue: []byte("q")}), "x-death[0].queue: want string, got bytes"},
		{"reason nil", withDeath(amqp.Table{fieldReason: nil}), "x-death[0].reason: want string, got void"},
		{"time as integer", withDeath(amqp.Table{fieldTime: int64(1700000000)}), "x-death[0].time: want timestamp, got int64"},
		{"routing keys not array", withDeath(amqp.Table{fieldRoutingKeys: "rk"}), "x-death[0].routing-keys: want array, got string"},
		{"routing key not string", withDeath(amqp.Table{fieldRoutingKeys: []interface{}{"a", int64(1)}}), "x-death[0].routing-keys[1]: want string, got int64"},
		{"original expiration not string", withDeath(amqp.Table{fieldOriginalExpiration: int64(5000)}), "x-death[0].original-expiration: want string, got int64"},
		{"first death header", amqp.Table{headerFirstDeathQueue: int32(1)}, "x-first-death-queue: want string, got int32"},
		{"last death header", amqp.Table{headerLastDeathExchange: amqp.Table{}}, "x-last-death-exchange: want string, got table"},
		{"foreign type", amqp.Table{headerLastDeathReason: struct{}{}}, "x-last-death-reason: want string, got struct {}"},
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

func TestFromMetadata(t *testing.T) {
	headers := amqp.Table{
		headerDeath:            []interface{}{rejectedOnce()},
		headerFirstDeathQueue:  "orders",
		headerFirstDeathReason: "rejected",
		headerLastDeathQueue:   "orders",
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
	if len(want.Deaths) != 1 {
		t.Fatalf("Parse found %d deaths, want 1", len(want.Deaths))
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
			md:   message.Metadata{headerDeath: `{"array":[]}`},
			want: "malformed value: x-death: want array, got string",
		},
		{
			name: "typed first-death header",
			md:   message.Metadata{headerFirstDeathQueue: `{"int32":1}`, keys.TypedHeaders: `["x-first-death-queue"]`},
			want: "malformed value: x-first-death-queue: want string, got int32",
		},
		{
			name: "undecodable x-death",
			md:   message.Metadata{headerDeath: `{"array":[{"table":{"count":{"int64":"1"}}}]}`, keys.TypedHeaders: `["x-death"]`},
			want: "malformed value: x-death[0].count: int64: json: cannot unmarshal string into Go value of type int64",
		},
		{
			name: "typed-headers list",
			md:   message.Metadata{keys.TypedHeaders: `x-death`},
			want: "malformed value: amqpretry-typed-headers: want JSON array of strings: invalid character 'x' looking for beginning of value",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			info, err := FromMetadata(tt.md)
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("FromMetadata error = %v, want ErrMalformed", err)
			}
			if err.Error() != tt.want {
				t.Errorf("FromMetadata error = %q, want %q", err, tt.want)
			}
			if !reflect.DeepEqual(info, Info{}) {
				t.Errorf("FromMetadata returned %#v with an error, want zero Info", info)
			}
		})
	}
}
