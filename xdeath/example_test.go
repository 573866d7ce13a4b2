package xdeath_test

import (
	"fmt"
	"sort"
	"time"

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
	// Output:
	// rejected from orders: 1 time(s), first at 2023-11-14T22:13:20Z
	// first death queue: orders
}

func ExampleMarshaler() {
	// In a real application: cfg.Marshaler = xdeath.Marshaler{}
	m := xdeath.Marshaler{}

	msg, err := m.Unmarshal(deadLettered())
	if err != nil {
		panic(err)
	}
	fmt.Println("tenant:", msg.Metadata.Get("tenant"))

	info, err := xdeath.FromMetadata(msg.Metadata)
	if err != nil {
		panic(err)
	}
	fmt.Println("deaths:", len(info.Deaths), "from", info.Deaths[0].Queue)

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
	// tenant: acme
	// deaths: 1 from orders
	// published _watermill_message_uuid: string
	// published attempt: int32
	// published tenant: string
}
