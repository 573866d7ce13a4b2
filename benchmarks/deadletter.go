package main

import (
	"context"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// The broker's own dead-letter rate (-scale): what bounds the lateness of many retries
// that come due together, measured without the library. One plain quorum queue with a
// tier queue's dead-letter arguments (at-least-once, reject-publish) takes n messages,
// published by amqp091-go with confirms, each with the per-message expiration that
// makes all of them expire at the same instant T (a queue expires from its head, and
// the head expires last); nothing consumes. The rate is n over the time from the first
// message in the target queue to the last (its depth, polled every 50 ms). Just after
// T, one basic.get from the source (it finds nothing: every message has expired) makes
// sure the broker looks at the queue (RabbitMQ 4.0.5 does not before something reaches
// it).
//
// RabbitMQ forwards at-least-once dead letters with one worker per source queue, which
// keeps dead_letter_worker_consumer_prefetch messages in flight (default 32);
// -dlx-prefetch sets it for the run (rabbitmqctl eval, local broker) and puts the old
// value back after.

// deadLetterPayload is about the size of a retry: our envelope's headers (some 600
// bytes) and a small body.
var deadLetterPayload = amqp.Publishing{
	DeliveryMode: amqp.Persistent,
	Headers:      amqp.Table{"bench-envelope": strings.Repeat("e", 600)},
	Body:         []byte(`{"order":"12345","amount":"42.00"}`),
}

// deadLetterRate measures the rate described above with n messages.
func (e *env) deadLetterRate(ctx context.Context, n int) (float64, error) {
	conn, err := e.dial()
	if err != nil {
		return 0, err
	}
	defer conn.Close() //nolint:errcheck
	ch, err := conn.Channel()
	if err != nil {
		return 0, err
	}
	src, dst := e.name("dlx-rate", "source"), e.name("dlx-rate", "target")
	e.reg.queue(src, dst)
	quorum := amqp.Table{amqp.QueueTypeArg: amqp.QueueTypeQuorum}
	if _, err := ch.QueueDeclare(dst, true, false, false, false, quorum); err != nil {
		return 0, fmt.Errorf("declare %s: %w", dst, err)
	}
	if _, err := ch.QueueDeclare(src, true, false, false, false, amqp.Table{
		amqp.QueueTypeArg:           amqp.QueueTypeQuorum,
		"x-dead-letter-exchange":    "",
		"x-dead-letter-routing-key": dst,
		"x-dead-letter-strategy":    "at-least-once",
		amqp.QueueOverflowArg:       amqp.QueueOverflowRejectPublish,
	}); err != nil {
		return 0, fmt.Errorf("declare %s: %w", src, err)
	}
	// T leaves room for the fill at 2,000/s, the slowest this broker goes.
	ahead := time.Duration(n/2000+10) * time.Second
	T := time.Now().Add(ahead)
	err = publishConfirmed(ctx, conn, src, n, func(i int) (amqp.Publishing, error) {
		p := deadLetterPayload
		ms := time.Until(T).Milliseconds()
		if ms < 1 {
			return p, fmt.Errorf("fill of %s: %d of %d published in %s", src, i, n, ahead)
		}
		p.Expiration = strconv.FormatInt(ms, 10)
		return p, nil
	})
	if err != nil {
		return 0, err
	}
	// RabbitMQ 4.0.5 leaves messages whose per-message TTL ran out in a quorum queue
	// without consumers until something reaches the queue (3.10.8 dead-letters them on
	// time): one basic.get just after T, which finds nothing to deliver, makes it drop
	// and dead-letter them.
	time.Sleep(time.Until(T) + 100*time.Millisecond)
	if _, _, err := ch.Get(src, true); err != nil {
		return 0, fmt.Errorf("get from %s: %w", src, err)
	}
	var first time.Time
	deadline := T.Add(5 * time.Minute)
	for {
		q, err := ch.QueueDeclarePassive(dst, true, false, false, false, quorum)
		if err != nil {
			return 0, err
		}
		now := time.Now()
		if q.Messages > 0 && first.IsZero() {
			first = now
		}
		if q.Messages >= n {
			rate := float64(n) / now.Sub(first).Seconds()
			fmt.Printf("   broker's own dead-letter rate: %d messages expiring at once in one quorum queue reached their target in %.1f s: %.0f/s (dead_letter_worker_consumer_prefetch %s)\n",
				n, now.Sub(first).Seconds(), rate, e.dlxPrefetch)
			// Deleting a quorum queue while the broker truncates its log segments
			// crashed 3.10.8's segment writer (restarting every quorum queue's log):
			// let it finish first.
			time.Sleep(scaleSettle)
			return rate, nil
		}
		if now.After(deadline) || ctx.Err() != nil {
			return 0, fmt.Errorf("%d of %d dead letters in %s by %s", q.Messages, n, dst, deadline.Format(time.TimeOnly))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// dlxPrefetchEnv reads (value "") or sets the broker's
// dead_letter_worker_consumer_prefetch through ctl and returns the value it had.
func dlxPrefetchEnv(ctl []string, value string) (string, error) {
	expr := "application:get_env(rabbit, dead_letter_worker_consumer_prefetch, 32)."
	if value != "" {
		if _, err := strconv.Atoi(value); err != nil {
			return "", fmt.Errorf("-dlx-prefetch %q: not a number", value)
		}
		expr = "begin Old = application:get_env(rabbit, dead_letter_worker_consumer_prefetch, 32), " +
			"ok = application:set_env(rabbit, dead_letter_worker_consumer_prefetch, " + value + "), Old end."
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	args := append(append([]string{}, ctl[1:]...), "-q", "eval", expr)
	out, err := exec.CommandContext(ctx, ctl[0], args...).Output()
	if err != nil {
		return "", fmt.Errorf("%s eval: %w", strings.Join(ctl, " "), err)
	}
	return strings.TrimSpace(string(out)), nil
}
