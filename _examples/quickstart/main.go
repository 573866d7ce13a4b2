// Quickstart: a Watermill router whose handler fails, retried through the broker.
//
// With AMQP_URI unset it runs in this process on Watermill's GoChannel and the memory
// delay backend: no broker needed. With AMQP_URI set it runs the same flow on RabbitMQ
// with the backend named by DELAY_BACKEND (default ttl-tiers). TOPOLOGY=verify (or none)
// runs it as a user without configure permission would: nothing is declared, and the
// work queue, named by QUEUE, must have been created with everything else by
// `amqpretry topology apply --prefix amqpretry-quickstart --tiers 1s,2s,4s --queue $QUEUE`.
//
// It prints, for each message, its attempts, the delay before each retry (requested →
// effective) and where it ended, and exits non-zero if any message is unaccounted for.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/topology"
)

// order is one message and how its handler behaves.
type order struct {
	id       string
	behaves  string
	failures int   // fail this many attempts, then succeed (-1: always fail)
	err      error // the error to fail with
	want     string
}

var orders = []order{
	{"order-1", "succeeds at once", 0, nil, "handled"},
	{"order-2", "fails once", 1, errors.New("payment service timeout"), "handled"},
	{"order-3", "fails 3 times", 3, errors.New("inventory locked"), "handled"},
	{"order-4", "is rate limited once (Retry-After 2s)", 1, middleware.RetryAfter(errors.New("429 too many requests"), 2*time.Second), "handled"},
	{"order-5", "is malformed (permanent error)", -1, middleware.Permanent(errors.New("missing customer id")), "poisoned"},
	{"order-6", "always fails", -1, errors.New("warehouse offline"), "poisoned"},
}

type outcome struct {
	attempts int
	delays   []string
	ended    string
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		os.Exit(1)
	}
}

func run() error {
	logger := watermill.NopLogger{}
	uri := os.Getenv("AMQP_URI")
	runID := watermill.NewShortUUID()[:8]
	topic := "quickstart.orders." + runID
	if q := os.Getenv("QUEUE"); q != "" {
		topic = q // a queue config: the topic is the queue
	}
	mode, err := topology.ParseMode(os.Getenv("TOPOLOGY"))
	if err != nil {
		return fmt.Errorf("TOPOLOGY: %w", err)
	}

	cfg := amqpretry.Config{
		Delay: delay.Config{
			Backend: os.Getenv("DELAY_BACKEND"),
			Prefix:  "amqpretry-quickstart",
			Tiers:   []time.Duration{time.Second, 2 * time.Second, 4 * time.Second},
		},
		Policy:   middleware.Policy{MaxAttempts: 4, InitialInterval: time.Second, Multiplier: 2, NoJitter: true},
		Topology: mode,
		Logger:   logger,
	}
	var (
		poisonSub message.Subscriber
		pub       message.Publisher
		cleanup   = func() {}
	)
	if uri == "" {
		goChannel := gochannel.NewGoChannel(gochannel.Config{}, logger)
		cfg.Delay.Backend = delay.BackendMemory
		cfg.Delay.Memory = goChannel
		poisonSub, pub = goChannel, goChannel
		fmt.Println("AMQP_URI is unset: running in-process on GoChannel with the memory delay backend (not durable).")
	} else {
		cfg.Subscriber = wamqp.NewDurableQueueConfig(uri)
		amqpPub, err := wamqp.NewPublisher(cfg.Subscriber, logger)
		if err != nil {
			return err
		}
		defer amqpPub.Close()
		pub = amqpPub
		cfg.Delay.Memory = amqpPub // used only by DELAY_BACKEND=memory: waits in-process, then publishes to the queue
	}

	retry, err := amqpretry.New(cfg)
	if err != nil {
		return err
	}
	defer retry.Close()

	if uri != "" {
		fmt.Printf("RabbitMQ at %s, delay backend %s.\n", delay.Redact(uri), retry.Backend().Name())
		if poisonSub, err = wamqp.NewSubscriber(retry.SubscriberConfig(), logger); err != nil {
			return err
		}
		if mode == topology.ModeDeclare && os.Getenv("QUEUE") == "" {
			cleanup = func() { deleteQueue(uri, topic) }
		}
	}
	defer cleanup()

	var (
		mu       sync.Mutex
		outcomes = map[string]*outcome{}
		done     = make(chan struct{}, len(orders)*2)
	)
	byID := map[string]order{}
	for _, o := range orders {
		byID[runID+"-"+o.id] = o
		outcomes[runID+"-"+o.id] = &outcome{}
	}

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		return err
	}
	// One call wires the subscriber (from retry.SubscriberConfig()), the handler and
	// the retry middleware, so that they cannot be mismatched.
	_, err = retry.AddHandler(router, "orders", topic, func(msg *message.Message) error {
		o, ok := byID[msg.UUID]
		if !ok {
			return nil // another run's message
		}
		attempt := middleware.Attempt(msg)
		mu.Lock()
		out := outcomes[msg.UUID]
		out.attempts = attempt
		if attempt > 1 {
			out.delays = append(out.delays, msg.Metadata.Get(middleware.RequestedDelayKey)+"→"+msg.Metadata.Get(middleware.EffectiveDelayKey))
		}
		mu.Unlock()
		if o.failures < 0 || attempt <= o.failures {
			return o.err
		}
		mu.Lock()
		out.ended = "handled"
		mu.Unlock()
		done <- struct{}{}
		return nil
	})
	if err != nil {
		return err
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	poisoned, err := poisonSub.Subscribe(ctx, retry.PoisonQueue())
	if err != nil {
		return err
	}
	go func() {
		for msg := range poisoned {
			mu.Lock()
			if out, ok := outcomes[msg.UUID]; ok {
				out.ended = "poisoned (" + msg.Metadata.Get(middleware.PoisonReasonKey) + ": " + msg.Metadata.Get(middleware.ErrorKey) + ")"
				done <- struct{}{}
			}
			mu.Unlock()
			msg.Ack()
		}
	}()

	go func() { _ = router.Run(ctx) }()
	<-router.Running()
	defer router.Close()

	start := time.Now()
	for _, o := range orders {
		if err := pub.Publish(topic, message.NewMessage(runID+"-"+o.id, []byte(o.behaves))); err != nil {
			return err
		}
	}
	timeout := time.After(50 * time.Second)
wait:
	for range orders {
		select {
		case <-done:
		case <-timeout:
			break wait
		}
	}

	mu.Lock()
	defer mu.Unlock()
	ids := make([]string, 0, len(outcomes))
	for id := range outcomes {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	var missing []string
	for _, id := range ids {
		o, out := byID[id], outcomes[id]
		ended := out.ended
		if ended == "" {
			ended = "UNACCOUNTED FOR"
		}
		fmt.Printf("%-8s %-38s attempts=%d  delays=[%s]  ended: %s\n", o.id, o.behaves, out.attempts, strings.Join(out.delays, " "), ended)
		if !strings.HasPrefix(ended, o.want) {
			missing = append(missing, o.id)
		}
	}
	fmt.Printf("done in %s\n", time.Since(start).Round(100*time.Millisecond))
	if len(missing) > 0 {
		return fmt.Errorf("messages not accounted for as expected: %s", strings.Join(missing, ", "))
	}
	return nil
}

// deleteQueue removes this run's work queue.
func deleteQueue(uri, queue string) {
	conn, err := amqp.Dial(uri)
	if err != nil {
		return
	}
	defer conn.Close()
	if ch, err := conn.Channel(); err == nil {
		_, _ = ch.QueueDelete(queue, false, false, false)
	}
}
