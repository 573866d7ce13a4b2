package amqp1_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/amqp1"
)

// A router consuming the queue "orders" and publishing to the queue "invoices", both
// over AMQP 1.0.
func Example() {
	logger := watermill.NewStdLogger(false, false)
	uri := "amqp://guest:guest@localhost:5672/"

	sub, err := amqp1.NewSubscriber(amqp1.SubscriberConfig{URI: uri}, logger)
	if err != nil {
		panic(err)
	}
	pub, err := amqp1.NewPublisher(amqp1.PublisherConfig{URI: uri}, logger)
	if err != nil {
		panic(err)
	}

	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		panic(err)
	}
	router.AddHandler("invoice", "orders", sub, "invoices", pub, func(msg *message.Message) ([]*message.Message, error) {
		invoice := message.NewMessage(watermill.NewUUID(), msg.Payload)
		return []*message.Message{invoice}, nil
	})
	if err := router.Run(context.Background()); err != nil {
		panic(err)
	}
}

// Fan-out through an exchange: publish to a topic exchange with the topic as routing
// key; each consumer group has its own queue, bound to the exchange by the operator.
func ExampleExchangeAddress() {
	pub, err := amqp1.NewPublisher(amqp1.PublisherConfig{
		URI: "amqp://guest:guest@localhost:5672/",
		Address: func(topic string) string {
			return amqp1.ExchangeAddress("events", topic)
		},
	}, nil)
	if err != nil {
		panic(err)
	}
	defer pub.Close()

	err = pub.Publish("order.created", message.NewMessage(watermill.NewUUID(), []byte(`{"id":42}`)))
	if errors.Is(err, amqp1.ErrNotAccepted) {
		fmt.Println("released: no queue is bound for order.created")
	}
}

// A middleware that asks the broker to bring a failed message back later, with a
// delay growing with the broker's own delivery count, instead of at once.
func ExampleRedeliver() {
	backoff := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil {
				return out, nil
			}
			count, ok := amqp1.DeliveryCount(msg)
			if !ok || count >= 5 {
				return nil, err // not ours, or enough: leave it to the next middleware
			}
			delay := time.Second << count // 1s, 2s, 4s, ...
			if rerr := amqp1.Redeliver(msg, time.Now().Add(delay), map[string]any{
				"x-opt-last-error": err.Error(),
			}); rerr != nil {
				return nil, errors.Join(err, rerr)
			}
			return nil, err // the router nacks: settled modified, back after delay
		}
	}
	router, err := message.NewRouter(message.RouterConfig{}, nil)
	if err != nil {
		panic(err)
	}
	router.AddMiddleware(backoff)
}

// Reading what the broker says about a delivery.
func ExampleAnnotations() {
	handler := func(msg *message.Message) error {
		count, _ := amqp1.DeliveryCount(msg)
		annotations := amqp1.Annotations(msg)
		_ = annotations["x-opt-last-error"] // set by an earlier Redeliver
		_ = annotations["x-routing-key"]    // set by the broker
		_ = count
		return nil
	}
	_ = handler
}
