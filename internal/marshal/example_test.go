package marshal_test

import (
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/marshal"
)

func ExampleEncodeValue() {
	s, err := marshal.EncodeValue(amqp.Table{
		"retries": int32(3),
		"price":   amqp.Decimal{Scale: 2, Value: 1999},
		"tags":    []interface{}{"a", []byte{0xff}},
	})
	if err != nil {
		panic(err)
	}
	fmt.Println(s)

	v, err := marshal.DecodeValue(s)
	if err != nil {
		panic(err)
	}
	fmt.Printf("%T\n", v.(amqp.Table)["retries"])
	// Output:
	// {"table":{"price":{"decimal":{"scale":2,"value":1999}},"retries":{"int32":3},"tags":{"array":[{"string":"a"},{"bytes":"/w=="}]}}}
	// int32
}
