// Quickstart over AMQP 1.0: the quickstart's orders through this module's Subscriber,
// retried by the delivery-time backend on RabbitMQ 4.3+: each failed delivery is settled
// modified with x-opt-delivery-time, and the broker holds it in its quorum queue until
// exactly then. No queue or exchange is declared beyond the work queue and the poison
// queue, and the run deletes both. AMQP_URI names the broker (default
// amqp://guest:guest@127.0.0.1:5672/).
package main

import (
	"fmt"
	"net/url"
	"os"

	"github.com/ThreeDotsLabs/watermill"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/amqp1"
	"github.com/amqpretry/amqpretry/delay"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		os.Exit(1)
	}
}

func run() error {
	logger := watermill.NopLogger{}
	uri := os.Getenv("AMQP_URI")
	if uri == "" {
		uri = "amqp://guest:guest@127.0.0.1:5672/"
	}
	runID := watermill.NewShortUUID()[:8]
	cfg := scenarioConfig(runID, logger)
	cfg.Backend = delay.DeliveryTime()
	topic := scenarioTopic(cfg)

	retry, err := amqp1.NewRetry(amqp1.SubscriberConfig{URI: uri}, cfg)
	if err != nil {
		return err
	}
	pub, err := amqp1.NewPublisher(amqp1.PublisherConfig{URI: uri}, logger)
	if err != nil {
		return err
	}
	defer pub.Close()
	poison, err := amqp1.NewSubscriber(amqp1.SubscriberConfig{URI: uri, Queue: amqp1.QueueConfig{NoDeclare: true}}, logger)
	if err != nil {
		return err
	}
	fmt.Printf("RabbitMQ at %s over AMQP 1.0, delay backend %s.\n", redactURI(uri), delay.DeliveryTime())
	return runScenario(runID, topic, setup{
		Retry: retry, Publisher: pub, Poison: poison,
		PoisonQueue: cfg.WithDefaults().PoisonQueue,
		Cleanup:     func() { remove(uri, topic, cfg.WithDefaults().PoisonQueue) },
	}, logger)
}

// remove deletes the run's work and poison queues, and says so.
func remove(uri string, queues ...string) {
	conn, err := amqp091.Dial(uri)
	if err != nil {
		fmt.Println("left on the broker (could not connect to delete them):", queues)
		return
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return
	}
	n := 0
	for _, q := range queues {
		if _, err := ch.QueueDelete(q, false, false, false); err == nil {
			n++
		}
	}
	fmt.Printf("removed what this run declared: %d queues (the work and poison queues)\n", n)
}

// redactURI hides the password of uri, for printing.
func redactURI(uri string) string {
	u, err := url.Parse(uri)
	if err != nil || (u.Scheme != "amqp" && u.Scheme != "amqps") || u.Host == "" || u.Opaque != "" {
		return "(unparseable amqp uri)" // url.Parse takes "amqp//user:pass@host/" for a path
	}
	return u.Redacted()
}
