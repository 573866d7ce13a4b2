package wamqp3_test

import (
	"context"
	"log"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/cqrs"
	"github.com/ThreeDotsLabs/watermill/message"

	amqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/wamqp3"
)

type BookRoom struct{ RoomID string }

// One Retry serves every handler of Watermill's CQRS processors, each handler with a
// queue of its own: its subscriber config comes from SubscriberConfigFor, one line in
// each processor's SubscriberConstructor, and the Retry's Middleware is on the router.
// One hand-off connection, one topology, one Stats, one Close.
func ExampleRetry_SubscriberConfigFor() {
	uri := "amqp://guest:guest@localhost:5672/"
	logger := watermill.NewStdLogger(false, false)
	// A pub/sub config: each topic is a fanout exchange, each handler's queue bound to it.
	amqpCfg := amqp.NewDurablePubSubConfig(uri, amqp.GenerateQueueNameTopicNameWithSuffix("bookings"))
	retry, err := wamqp3.New(amqpCfg, amqpretry.Config{Policy: amqpretry.Policy{MaxAttempts: 5}})
	if err != nil {
		log.Fatal(err)
	}
	defer retry.Close() // after the router

	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		log.Fatal(err)
	}
	router.AddMiddleware(retry.Middleware)
	marshaler := cqrs.JSONMarshaler{}
	commands, err := cqrs.NewCommandProcessorWithConfig(router, cqrs.CommandProcessorConfig{
		GenerateSubscribeTopic: func(p cqrs.CommandProcessorGenerateSubscribeTopicParams) (string, error) {
			return p.CommandName, nil
		},
		SubscriberConstructor: func(p cqrs.CommandProcessorSubscriberConstructorParams) (message.Subscriber, error) {
			return amqp.NewSubscriber(retry.SubscriberConfigFor(amqp.GenerateQueueNameTopicNameWithSuffix(p.HandlerName)), logger)
		},
		Marshaler: marshaler,
	})
	if err != nil {
		log.Fatal(err)
	}
	err = commands.AddHandlers(cqrs.NewCommandHandler("book-room", func(ctx context.Context, cmd *BookRoom) error {
		return nil // an error here is retried through the broker, to this handler's queue only
	}))
	if err != nil {
		log.Fatal(err)
	}
	// The event processor's SubscriberConstructor is the same line, with
	// cqrs.EventProcessorSubscriberConstructorParams.
	if err := router.Run(context.Background()); err != nil {
		log.Fatal(err)
	}
}

// The poison queue is read with a subscriber built from PoisonSubscriberConfig: any
// topic subscribes to it, and each message carries its failure envelope.
func ExampleRetry_PoisonSubscriberConfig() {
	var retry *wamqp3.Retry // built with wamqp3.New
	sub, err := amqp.NewSubscriber(retry.PoisonSubscriberConfig(), watermill.NopLogger{})
	if err != nil {
		log.Fatal(err)
	}
	defer sub.Close()
	messages, err := sub.Subscribe(context.Background(), "poison")
	if err != nil {
		log.Fatal(err)
	}
	for msg := range messages {
		env := middleware.ReadEnvelope(msg.Metadata)
		log.Printf("%s failed for good (%s) in %s after %d attempts: %s", msg.UUID, env.Reason, env.Queue, env.Attempt, env.Error)
		msg.Ack()
	}
}
