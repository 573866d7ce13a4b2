// The quickstart's scenario. Six orders go through a handler that fails as each order
// says; the program prints, for each, its attempts, the delay before each retry
// (requested → effective) and where it ended, and fails if one is unaccounted for.
// (amqp1/examples/quickstart runs the same scenario over AMQP 1.0: each example is
// complete by itself, so that it can be copied.)

package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

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
	{"order-4", "is rate limited once (Retry-After 2s)", 1, amqpretry.RetryAfter(errors.New("429 too many requests"), 2*time.Second), "handled"},
	{"order-5", "is malformed (permanent error)", -1, amqpretry.Permanent(errors.New("missing customer id")), "poisoned"},
	{"order-6", "always fails", -1, errors.New("warehouse offline"), "poisoned"},
}

// retrier is what the scenario uses of a transport package's Retry.
type retrier interface {
	AddHandler(router *message.Router, handlerName, topic string, handler message.NoPublishHandlerFunc) (*message.Handler, error)
	Close() error
}

// setup is a transport's side of a run: the Retry, a publisher to the topic and a
// subscriber to the poison queue.
type setup struct {
	Retry     retrier
	Publisher message.Publisher
	Poison    message.Subscriber
	// PoisonQueue is the queue (in-process: the topic) poisoned messages go to.
	PoisonQueue string
	// Cleanup, if set, removes what the run declared, once it is over.
	Cleanup func()
}

// scenarioConfig is the run's amqpretry configuration: the backend from DELAY_BACKEND, a prefix
// of the run's own unless PREFIX is set, a short policy.
func scenarioConfig(runID string, logger watermill.LoggerAdapter) amqpretry.Config {
	prefix := "amqpretry-qs-" + runID
	if p := os.Getenv("PREFIX"); p != "" {
		prefix = p
	}
	return amqpretry.Config{
		// HELD_RETRIES (RabbitMQ 4.3): the first retries held in the work queue, 1s apart.
		Backend: must(delay.Parse(os.Getenv("DELAY_BACKEND"), delay.Settings{
			Tiers:       []time.Duration{time.Second, 2 * time.Second, 4 * time.Second},
			HeldRetries: must(strconv.Atoi(cmp.Or(os.Getenv("HELD_RETRIES"), "0"))),
		})),
		Prefix:   prefix,
		Policy:   amqpretry.Policy{MaxAttempts: 4, Jitter: -1},
		Topology: topology.Mode(os.Getenv("TOPOLOGY")),
		Logger:   logger,
	}
}

// must returns v, or exits with err: a backend name the run cannot parse.
func must[T any](v T, err error) T {
	if err != nil {
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		os.Exit(2)
	}
	return v
}

// scenarioTopic is the run's topic (the queue, with queue configs): QUEUE, or one of its own.
func scenarioTopic(cfg amqpretry.Config) string {
	if q := os.Getenv("QUEUE"); q != "" {
		return q
	}
	return cfg.Prefix + ".orders"
}

type outcome struct {
	attempts int
	delays   []string
	ended    string
}

// runScenario publishes the orders to topic, runs the handler until each is handled or
// poisoned (or 50 s pass), and prints what became of them.
func runScenario(runID, topic string, s setup, logger watermill.LoggerAdapter) error {
	defer func() {
		if s.Cleanup != nil {
			s.Cleanup()
		}
	}()
	// Closed before the queues are deleted: a subscriber still open would declare the
	// poison queue again when its consumer is cancelled.
	defer s.Poison.Close()
	defer s.Retry.Close()
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
	// One call wires the subscriber, the handler and the retry middleware, so that
	// they cannot be mismatched.
	_, err = s.Retry.AddHandler(router, "orders", topic, func(msg *message.Message) error {
		o, ok := byID[msg.UUID]
		if !ok {
			return nil // another run's message
		}
		attempt := amqpretry.Attempt(msg)
		env := middleware.ReadEnvelope(msg.Metadata)
		mu.Lock()
		out := outcomes[msg.UUID]
		out.attempts = attempt
		switch {
		case attempt > 1 && env.EffectiveDelay > 0:
			out.delays = append(out.delays, env.RequestedDelay.String()+"→"+env.EffectiveDelay.String())
		case attempt > 1:
			out.delays = append(out.delays, "held in queue")
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
	poisoned, err := s.Poison.Subscribe(ctx, s.PoisonQueue)
	if err != nil {
		return err
	}
	go func() {
		for msg := range poisoned {
			mu.Lock()
			out, ours := outcomes[msg.UUID]
			if ours {
				env := middleware.ReadEnvelope(msg.Metadata)
				out.ended = "poisoned (" + string(env.Reason) + ": " + env.Error + ")"
				done <- struct{}{}
			}
			mu.Unlock()
			if ours {
				msg.Ack()
			} else {
				msg.Nack() // another run's: leave it in the poison queue
				time.Sleep(100 * time.Millisecond)
			}
		}
	}()

	// Run returns at once when the router cannot start (a subscription the broker
	// refused, say): wait for whichever comes first, so that its error is not lost.
	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(ctx) }()
	select {
	case <-router.Running():
	case err := <-runErr:
		return fmt.Errorf("the router did not start: %w", err)
	}
	defer router.Close()

	start := time.Now()
	for _, o := range orders {
		if err := s.Publisher.Publish(topic, message.NewMessage(runID+"-"+o.id, []byte(o.behaves))); err != nil {
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
