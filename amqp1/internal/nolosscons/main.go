// Command nolosscons is the consumer process of the no-loss test of the delivery-time
// backend (amqp1's TestNoLoss). It wires amqp1.NewRetry the way the README says
// (Retry.AddHandler: a Subscriber from SubscriberConfig() with the Middleware on the
// handler) and handles a run's work queue: each message's fate is read from its payload
// (fates.Of): 20% fail on their first two attempts then succeed, 1% fail with
// amqpretry.Permanent (poisoned), the rest succeed. Every message handled successfully
// is recorded, before the handler returns nil, by a message with its UUID that the
// broker has accepted (amqp1.Publisher: the publish returns once the broker took it) in
// the run's results queue. A record whose delivery's settlement is then lost (SIGKILL,
// a closed connection, a broker stop) shows up twice: a duplicate, never a loss.
//
// The broker URI is read from AMQP_URI (never from the command line, never printed).
// It prints noloss1.Ready on stdout once its handlers run, logs to stderr, and stops
// cleanly on SIGTERM or SIGINT.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/amqp1"
	"github.com/amqpretry/amqpretry/amqp1/internal/noloss1"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/testsupport/noloss/fates"
	"github.com/amqpretry/amqpretry/middleware"
)

func main() {
	prefix := flag.String("prefix", "", "the run's prefix (queue names, container ids)")
	handlers := flag.Int("handlers", 4, "handlers (Subscribers) on the work queue")
	sabotage := flag.Int("sabotage", 0, "FOR PROVING THE TEST ONLY: ack this many transient messages on their first attempt without recording them, i.e. lose them")
	flag.Parse()
	if err := run(*prefix, *handlers, *sabotage); err != nil {
		fmt.Fprintln(os.Stderr, "nolosscons:", err)
		os.Exit(1)
	}
}

func run(prefix string, handlers, sabotage int) error {
	uri := os.Getenv("AMQP_URI")
	if uri == "" || prefix == "" || handlers < 1 {
		return errors.New("need AMQP_URI, -prefix and -handlers >= 1")
	}
	logger := watermill.NewStdLoggerWithOut(os.Stderr, false, false)
	retry, err := amqp1.NewRetry(amqp1.SubscriberConfig{URI: uri, ContainerID: noloss1.ContainerID(prefix)}, amqpretry.Config{
		Backend: delay.DeliveryTime(),
		Prefix:  prefix,
		Policy:  amqpretry.Policy{MaxAttempts: noloss1.MaxAttempts, Delays: []time.Duration{noloss1.RetryDelay}, Jitter: -1},
		// Its fates fail messages by attempt, in waves, which can look like an outage
		// (docs/outage.md): this test counts retries under faults.
		Outage: amqpretry.Outage{Consecutive: -1},
		Logger: logger,
	})
	if err != nil {
		return err
	}
	defer retry.Close()
	pub, err := amqp1.NewPublisher(amqp1.PublisherConfig{URI: uri, ContainerID: noloss1.ContainerID(prefix) + "-recorder", PublishTimeout: 10 * time.Second}, logger)
	if err != nil {
		return err
	}
	defer pub.Close()
	c := &consumer{pub: pub, results: noloss1.ResultsQueue(prefix), sabotage: int64(sabotage), logger: logger, pid: strconv.Itoa(os.Getpid())}

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 15 * time.Second}, logger)
	if err != nil {
		return err
	}
	for i := range handlers {
		// Several handlers on the topic: one Subscriber (one connection) each, their
		// records' round trips overlapping.
		if _, err := retry.AddHandler(router, fmt.Sprintf("noloss-%d", i), noloss1.WorkQueue(prefix), c.handle); err != nil {
			return err
		}
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	select {
	case <-router.Running():
		fmt.Println(noloss1.Ready)
	case err := <-done:
		return fmt.Errorf("router stopped before running: %w", err)
	}
	err = <-done
	st := retry.Stats()
	logger.Info("Consumer stopped", watermill.LogFields{"retries": st.Retries, "poisoned": st.Poisoned, "handoff_failures": st.HandoffFailures})
	return err
}

type consumer struct {
	pub      *amqp1.Publisher
	results  string
	sabotage int64
	dropped  atomic.Int64
	logger   watermill.LoggerAdapter
	pid      string
}

var errTransient = errors.New("noloss: transient failure (by the message's fate)")

func (c *consumer) handle(msg *message.Message) error {
	arrived := time.Now()
	fate, err := fates.Of(msg.Payload)
	if err != nil {
		return amqpretry.Permanent(err)
	}
	attempt := amqpretry.Attempt(msg)
	switch {
	case fate == fates.Permanent:
		return amqpretry.Permanent(errors.New("noloss: permanent failure (by the message's fate)"))
	case fate == fates.Transient && attempt <= noloss1.Failures:
		if attempt == 1 && c.sabotage > 0 && c.dropped.Add(1) <= c.sabotage {
			c.logger.Error("SABOTAGE: acking a message without recording it", errSabotage, watermill.LogFields{"message_uuid": msg.UUID})
			return nil
		}
		return fmt.Errorf("attempt %d: %w", attempt, errTransient)
	}
	rec := message.NewMessage(msg.UUID, nil)
	rec.Metadata.Set(noloss1.AttemptKey, strconv.Itoa(attempt))
	rec.Metadata.Set(noloss1.ArrivedKey, strconv.FormatInt(arrived.UnixMilli(), 10))
	rec.Metadata.Set(noloss1.ConsumerKey, c.pid)
	if due := middleware.ReadEnvelope(msg.Metadata).Due; !due.IsZero() {
		rec.Metadata.Set(noloss1.LateKey, strconv.FormatInt(arrived.Sub(due).Microseconds(), 10))
	}
	return c.record(msg.Context(), rec)
}

// record returns once the broker has accepted the record, trying again until it does.
// It gives up only when ctx ends (the router is closing): the handler then fails and
// the message is retried, never dropped.
func (c *consumer) record(ctx context.Context, rec *message.Message) error {
	for {
		rec.SetContext(ctx)
		err := c.pub.Publish(c.results, rec)
		if err == nil {
			return nil
		}
		c.logger.Error("Could not record a handled message, trying again", err, watermill.LogFields{"message_uuid": rec.UUID})
		select {
		case <-ctx.Done():
			return fmt.Errorf("record %s: %w (last error: %w)", rec.UUID, ctx.Err(), err)
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// errSabotage is the error the deliberate loss of a message is logged with.
var errSabotage = errors.New("sabotage asked for: the message is dropped on purpose")
