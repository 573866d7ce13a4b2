// Command scenario is the program scripts/walk.sh runs under `dlv trace`: one message
// whose handler fails once and then succeeds, through the middleware with the backend
// named by -backend (ttl-tiers, or delayed-retry with a quorum work queue on RabbitMQ
// 4.3+). Its names are unique per run (a prefix of its own), and it deletes what it
// declared before it exits.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp3 "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/topology"
	"github.com/amqpretry/amqpretry/wamqp3"
)

func main() {
	backend := flag.String("backend", "ttl-tiers", "ttl-tiers or delayed-retry (RabbitMQ 4.3+)")
	uri := flag.String("uri", "amqp://guest:guest@127.0.0.1:5672/", "the broker's AMQP URI")
	flag.Parse()
	prefix, err := run(*backend, *uri)
	if err != nil {
		fmt.Fprintln(os.Stderr, "scenario:", err)
		os.Exit(1)
	}
	fmt.Println("scenario: done, prefix", prefix)
}

// run sends one message that fails once, waits for its second, successful attempt,
// and deletes what the run declared. It returns the run's prefix.
func run(backend, uri string) (string, error) {
	prefix := "walk-" + watermill.NewShortUUID()[:8]
	topic := prefix + ".work"
	cfg := amqpretry.Config{Prefix: prefix}
	amqpCfg := amqp3.NewDurableQueueConfig(uri)
	switch backend {
	case "ttl-tiers":
		cfg.Backend = delay.TTLTiers(time.Second)
		// The delay is the tier's, exactly: with jitter it would pass the tier about
		// half the time, and the walk would then stamp a re-park (keys.ParkUntil).
		cfg.Policy = amqpretry.Policy{MaxAttempts: 3, Jitter: -1}
	case "delayed-retry":
		cfg.Backend = delay.DelayedRetry(time.Second)
		cfg.Policy = amqpretry.Policy{MaxAttempts: 3}
		amqpCfg.Queue.Arguments = map[string]any{"x-queue-type": "quorum"}
	default:
		return prefix, fmt.Errorf("-backend %q: use ttl-tiers or delayed-retry", backend)
	}
	plan, err := cfg.Plan(topic)
	if err != nil {
		return prefix, err
	}
	defer func() {
		if err := remove(uri, topic, plan.Queues, plan.Exchanges); err != nil {
			fmt.Fprintln(os.Stderr, "scenario: cleanup:", err)
		}
	}()

	retry, err := wamqp3.New(amqpCfg, cfg)
	if err != nil {
		return prefix, err
	}
	defer func() { _ = retry.Close() }()
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		return prefix, err
	}
	done := make(chan struct{})
	attempts := 0
	if _, err := retry.AddHandler(router, "walk", topic, func(*message.Message) error {
		attempts++
		if attempts == 1 {
			return errors.New("walk: the first attempt fails")
		}
		close(done)
		return nil
	}); err != nil {
		return prefix, err
	}
	ranErr := make(chan error, 1)
	go func() { ranErr <- router.Run(context.Background()) }()
	select {
	case <-router.Running():
	case err := <-ranErr:
		return prefix, fmt.Errorf("router: %w", err)
	}
	defer func() { _ = router.Close() }()
	pub, err := amqp3.NewPublisher(amqpCfg, watermill.NopLogger{})
	if err != nil {
		return prefix, err
	}
	defer func() { _ = pub.Close() }()
	if err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("walk"))); err != nil {
		return prefix, err
	}
	select {
	case <-done:
	case <-time.After(2 * time.Minute):
		return prefix, fmt.Errorf("no second attempt within 2m (attempts: %d)", attempts)
	}
	return prefix, nil
}

// remove deletes the work queue and what the plan names: the backend's queues and
// exchanges, the parking and poison queues.
// A failed delete closes the channel, so the first error ends it.
func remove(uri, work string, queues []topology.Queue, exchanges []topology.Exchange) error {
	conn, err := amqp.Dial(uri)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	names := []string{work}
	for _, q := range queues {
		if q.Name != work {
			names = append(names, q.Name)
		}
	}
	for _, q := range names {
		if _, err := ch.QueueDelete(q, false, false, false); err != nil {
			return fmt.Errorf("delete queue %s: %w", q, err)
		}
	}
	for _, x := range exchanges {
		if err := ch.ExchangeDelete(x.Name, false, false); err != nil {
			return fmt.Errorf("delete exchange %s: %w", x.Name, err)
		}
	}
	return nil
}
