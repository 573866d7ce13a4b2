// Command consumer is the consumer process of the no-loss test (internal/noloss). It
// wires amqpretry the way the README says (amqpretry.New, then Retry.AddHandler: a
// subscriber from SubscriberConfig with the Middleware on the handler) and handles the
// work queue of a run:
// each message's fate is read from its payload (noloss.FateOf), and every message
// handled successfully is recorded, before the handler returns nil, by a persistent
// message with its UUID published with a publisher confirm to the run's results queue.
// A record whose delivery's ack is then lost (SIGKILL, a closed connection) shows up
// twice: a duplicate, never a loss.
//
// The broker URI is read from AMQP_URI (never from the command line, never printed).
// It prints noloss.Ready on stdout once its handlers are subscribed, logs to stderr, and
// stops cleanly on SIGTERM or SIGINT.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/noloss"
	"github.com/amqpretry/amqpretry/middleware"
)

func main() {
	backend := flag.String("backend", "", "delay backend")
	prefix := flag.String("prefix", "", "the run's prefix (queue and exchange names)")
	handlers := flag.Int("handlers", 4, "handlers (consumers) on the work queue")
	sabotage := flag.Int("sabotage", 0, "FOR PROVING THE TEST ONLY: ack this many transient messages on their first attempt without handing them off or recording them, i.e. lose them")
	flag.Parse()
	if err := run(*backend, *prefix, *handlers, *sabotage); err != nil {
		fmt.Fprintln(os.Stderr, "noloss-consumer:", err)
		os.Exit(1)
	}
}

func run(backend, prefix string, handlers, sabotage int) error {
	uri := os.Getenv("AMQP_URI")
	if uri == "" || prefix == "" || handlers < 1 {
		return errors.New("need AMQP_URI, -prefix and -handlers >= 1")
	}
	logger := watermill.NewStdLoggerWithOut(os.Stderr, false, false)

	cfg := noloss.Config(uri, backend, prefix)
	cfg.Logger = logger
	retry, err := amqpretry.New(cfg)
	if err != nil {
		return err
	}
	defer retry.Close()
	rec := &recorder{uri: uri, queue: noloss.ResultsQueue(prefix), logger: logger}
	defer rec.close()
	c := &consumer{rec: rec, sabotage: int64(sabotage), logger: logger}

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 15 * time.Second}, logger)
	if err != nil {
		return err
	}
	topic := noloss.WorkQueue(prefix)
	for i := range handlers {
		// The README's one-call wiring: a subscriber from retry.SubscriberConfig() and
		// retry.Middleware on the handler. Several handlers on the topic overlap the
		// confirm waits (one consumer each).
		if _, err := retry.AddHandler(router, fmt.Sprintf("noloss-%d", i), topic, c.handle); err != nil {
			return err
		}
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	select {
	case <-router.Running():
		fmt.Println(noloss.Ready)
	case err := <-done:
		return fmt.Errorf("router stopped before running: %w", err)
	}
	return <-done
}

type consumer struct {
	rec      *recorder
	sabotage int64
	dropped  atomic.Int64
	logger   watermill.LoggerAdapter
}

var errTransient = errors.New("noloss: transient failure (by the message's fate)")

func (c *consumer) handle(msg *message.Message) error {
	fate, err := noloss.FateOf(msg.Payload)
	if err != nil {
		return middleware.Permanent(err)
	}
	attempt := middleware.Attempt(msg)
	switch {
	case fate == noloss.FatePermanent:
		return middleware.Permanent(errors.New("noloss: permanent failure (by the message's fate)"))
	case fate == noloss.FateTransient && attempt <= noloss.TransientFailures:
		if attempt == 1 && c.sabotage > 0 && c.dropped.Add(1) <= c.sabotage {
			c.logger.Error("SABOTAGE: acking a message without handing it off or recording it", nil, watermill.LogFields{"message_uuid": msg.UUID})
			return nil
		}
		return fmt.Errorf("attempt %d: %w", attempt, errTransient)
	}
	return c.rec.record(msg.Context(), msg.UUID, attempt)
}

// recorder publishes one persistent record per handled message to the results queue,
// on a confirm-mode channel of its own connection, reconnecting as needed.
type recorder struct {
	uri, queue string
	logger     watermill.LoggerAdapter

	mu   sync.Mutex
	conn *amqp.Connection
	ch   *amqp.Channel
}

// record returns once the broker has confirmed the record, trying again (with a fresh
// connection) until it does. It gives up only when ctx ends (the router is closing);
// the handler then fails and the message is retried, never dropped.
func (r *recorder) record(ctx context.Context, uuid string, attempt int) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	for {
		err := r.publish(ctx, uuid, attempt)
		if err == nil {
			return nil
		}
		r.logger.Error("Could not record a handled message, trying again", err, watermill.LogFields{"message_uuid": uuid})
		r.reset()
		select {
		case <-ctx.Done():
			return fmt.Errorf("record %s: %w (last error: %w)", uuid, ctx.Err(), err)
		case <-time.After(250 * time.Millisecond):
		}
	}
}

func (r *recorder) publish(ctx context.Context, uuid string, attempt int) error {
	if r.ch == nil || r.ch.IsClosed() {
		r.reset()
		conn, err := amqp.Dial(r.uri)
		if err != nil {
			return errors.New("dial failed (address withheld)")
		}
		ch, err := conn.Channel()
		if err == nil {
			err = ch.Confirm(false)
		}
		if err != nil {
			_ = conn.Close()
			return err
		}
		r.conn, r.ch = conn, ch
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	dc, err := r.ch.PublishWithDeferredConfirmWithContext(ctx, "", r.queue, false, false, amqp.Publishing{
		DeliveryMode: amqp.Persistent,
		MessageId:    uuid,
		Headers:      amqp.Table{noloss.AttemptHeader: int32(attempt)},
		Body:         []byte(uuid),
	})
	if err != nil {
		return err
	}
	ok, err := dc.WaitContext(ctx)
	switch {
	case err != nil:
		return err
	case !ok:
		return errors.New("record nacked (or its channel closed)")
	}
	return nil
}

func (r *recorder) reset() {
	if r.conn != nil {
		_ = r.conn.Close()
	}
	r.conn, r.ch = nil, nil
}

func (r *recorder) close() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.reset()
}
