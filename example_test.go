package amqpretry_test

import (
	"context"
	"errors"
	"log"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/middleware"
)

// Adding broker-side retry to a Watermill router on RabbitMQ.
func Example() {
	logger := watermill.NewStdLogger(false, false)
	amqpCfg := wamqp.NewDurableQueueConfig("amqp://guest:guest@localhost:5672/")

	retry, err := amqpretry.New(amqpretry.Config{
		Subscriber: amqpCfg,
		Delay:      delay.Config{Backend: delay.BackendTTLTiers},
		Policy:     middleware.Policy{MaxAttempts: 5},
		Logger:     logger,
	})
	if err != nil {
		log.Fatal(err)
	}
	defer retry.Close()

	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		log.Fatal(err)
	}
	// The subscriber, the handler and the retry middleware, wired in one call.
	_, err = retry.AddHandler(router, "orders", "orders", func(msg *message.Message) error {
		if len(msg.Payload) == 0 {
			return middleware.Permanent(errors.New("empty order")) // poisoned at once
		}
		return chargeCard(msg) // any other error is retried with backoff
	})
	if err != nil {
		log.Fatal(err)
	}
	_ = router.Run(context.Background())
}

func chargeCard(*message.Message) error { return nil }
