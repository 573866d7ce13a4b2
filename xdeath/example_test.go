package xdeath_test

import (
	"fmt"
	"sort"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/xdeath"
)

// deadLettered is a delivery as RabbitMQ hands out a message that a
// consumer rejected from queue "orders".
func deadLettered() amqp.Delivery {
	return amqp.Delivery{
		Exchange:   "orders.dlx",
		RoutingKey: "order.created",
		Body:       []byte(`{"id":42}`),
		Headers: amqp.Table{
			"attempt": int32(3),
			"tenant":  "acme",
			"x-death": []interface{}{amqp.Table{
				"count":        int64(1),
				"exchange":     "shop",
				"queue":        "orders",
				"reason":       "rejected",
				"routing-keys": []interface{}{"order.created"},
				"time":         time.Unix(1700000000, 0),
			}},
			"x-first-death-exchange": "shop",
			"x-first-death-queue":    "orders",
			"x-first-death-reason":   "rejected",
		},
	}
}

func ExampleParse() {
	info, err := xdeath.Parse(deadLettered().Headers)
	if err != nil {
		panic(err)
	}
	for _, d := range info.Deaths {
		fmt.Printf("%s from %s: %d time(s), first at %s\n", d.Reason, d.Queue, d.Count, d.Time.Format(time.RFC3339))
	}
	fmt.Println("first death queue:", info.FirstQueue)
	fmt.Println("rejected from orders:", info.Count("orders", xdeath.ReasonRejected))
	// Output:
	// rejected from orders: 1 time(s), first at 2023-11-14T22:13:20Z
	// first death queue: orders
	// rejected from orders: 1
}

func ExampleMarshaler() {
	// In a real application: cfg.Marshaler = xdeath.Marshaler{}
	m := xdeath.Marshaler{}

	msg, err := m.Unmarshal(deadLettered())
	if err != nil {
		panic(err)
	}
	fmt.Println("attempt:", msg.Metadata.Get("attempt"))
	fmt.Println("typed:", msg.Metadata.Get(xdeath.TypedHeadersKey))
	fmt.Println("delivered via:", msg.Metadata.Get(xdeath.DeliveryExchangeKey))

	info, err := xdeath.FromMetadata(msg.Metadata)
	if err != nil {
		panic(err)
	}
	fmt.Println("deaths:", info.Total())

	p, err := m.Marshal(msg)
	if err != nil {
		panic(err)
	}
	var names []string
	for name := range p.Headers {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		fmt.Printf("published %s: %T\n", name, p.Headers[name])
	}
	// Output:
	// attempt: {"int32":3}
	// typed: ["attempt","x-death"]
	// delivered via: orders.dlx
	// deaths: 1
	// published _watermill_message_uuid: string
	// published attempt: int32
	// published tenant: string
}

func ExampleEncodeValue() {
	s, err := xdeath.EncodeValue(amqp.Table{
		"retries": int32(3),
		"price":   amqp.Decimal{Scale: 2, Value: 1999},
		"tags":    []interface{}{"a", []byte{0xff}},
	})
	if err != nil {
		panic(err)
	}
	fmt.Println(s)

	v, err := xdeath.DecodeValue(s)
	if err != nil {
		panic(err)
	}
	fmt.Printf("%T\n", v.(amqp.Table)["retries"])
	// Output:
	// {"table":{"price":{"decimal":{"scale":2,"value":1999}},"retries":{"int32":3},"tags":{"array":[{"string":"a"},{"bytes":"/w=="}]}}}
	// int32
}

func ExampleHeader() {
	d := amqp.Delivery{Headers: amqp.Table{xdeath.HeaderDeliveryCount: int64(4)}}
	msg, err := xdeath.Marshaler{Inner: wamqp.DefaultMarshaler{}}.Unmarshal(d)
	if err != nil {
		panic(err)
	}
	v, ok, err := xdeath.Header(msg.Metadata, xdeath.HeaderDeliveryCount)
	fmt.Printf("%v %T %v %v\n", v, v, ok, err)
	// Output:
	// 4 int64 true <nil>
}
