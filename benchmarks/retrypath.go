package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/wire"
	"github.com/amqpretry/amqpretry/topology"
	"github.com/amqpretry/amqpretry/wamqp3"
)

// Retry path: every message fails, so every delivery is a hand-off (publish the copy to
// the delay backend, wait for the confirm, then ack). Both sides consume N messages
// prefilled in a durable classic queue with C consumers at prefetch 1 and publish on ONE
// confirm channel of a second connection, waiting for each deferred confirmation before
// the ack:
//
//   - ours: one router, C handlers on the same queue (watermill-amqp processes one
//     message at a time per subscription), our middleware with ttl-tiers (one 10 min
//     tier, so no retry comes back during the run) sharing one delay.Handoff;
//   - raw: C goroutines with a plain amqp091-go loop: consume, publish a copy through
//     the default exchange to a queue declared with exactly a tier queue's arguments
//     (quorum, 10 min TTL, at-least-once dead-lettering, reject-publish), wait for the
//     confirm, ack. This is the JSON's reference: the same broker work without the
//     library. The same loop into a plain durable classic queue is printed beside it,
//     to show what the tier queue's arguments cost the broker;
//   - router + ceiling: the router of "ours" with the ceiling middleware of ceiling.go
//     in place of ours (printed beside: router against raw is what Watermill and
//     watermill-amqp cost, ours against it what our middleware costs);
//   - router + ceiling carrying our envelope: the same, but every copy also carries the
//     headers table of a copy ours published in the same round (read back from its tier
//     queue) and goes out mandatory with a MessageId, as ours does. Against router +
//     ceiling, that is what our envelope costs the broker and the wire; ours against it
//     is what our client code costs.
//
// The rate is N over the time from the first delivery to the N-th confirmed hand-off.
// The two sides run alternately, retryPathRounds times each, on fresh queues; the
// ratio is that of their medians, which keeps a burst of other load on the shared broker
// from deciding it.

type retryPathDetail struct {
	n, concurrency int
	oursRates      []float64 // retries scheduled per second, each round
	rawRates       []float64 // confirmed publish + consume + ack per second, each round
	classicRates   []float64 // the same into a classic queue, each round
	oursRate       float64   // median
	rawRate        float64   // median
	classicRate    float64   // median
	ceilingRates   []float64 // the router with the ceiling middleware (ceiling.go), each round
	ceilingRate    float64   // median
	envelopeRates  []float64 // the same carrying our envelope, each round
	envelopeRate   float64   // median
	envelopeBytes  int       // our copy's headers table on the wire
	envelopeN      int       // and its number of headers
}

const (
	retryPathDelay  = 10 * time.Minute
	retryPathRounds = 3
)

func runRetryPath(ctx context.Context, e *env, rep *report) error {
	d := &retryPathDetail{n: e.sz.retryPathN, concurrency: e.sz.concurrency}
	for round := range retryPathRounds {
		raw, err := e.rawRetryPath(ctx, round, d.n, d.concurrency, true)
		if err != nil {
			return fmt.Errorf("raw loop: %w", err)
		}
		classic, err := e.rawRetryPath(ctx, round, d.n, d.concurrency, false)
		if err != nil {
			return fmt.Errorf("raw loop, classic queue: %w", err)
		}
		ours, envelope, err := e.oursRetryPath(ctx, round, d.n, d.concurrency, false, nil)
		if err != nil {
			return fmt.Errorf("middleware: %w", err)
		}
		ceil, _, err := e.oursRetryPath(ctx, round, d.n, d.concurrency, true, nil)
		if err != nil {
			return fmt.Errorf("ceiling middleware: %w", err)
		}
		env, _, err := e.oursRetryPath(ctx, round, d.n, d.concurrency, true, envelope)
		if err != nil {
			return fmt.Errorf("ceiling middleware carrying our envelope: %w", err)
		}
		if d.envelopeBytes, err = wire.Size(envelope); err != nil {
			return err
		}
		d.envelopeN = len(envelope)
		d.rawRates, d.oursRates = append(d.rawRates, raw), append(d.oursRates, ours)
		d.classicRates, d.ceilingRates = append(d.classicRates, classic), append(d.ceilingRates, ceil)
		d.envelopeRates = append(d.envelopeRates, env)
		fmt.Printf("   round %d: raw amqp091-go %6.0f/s into a tier-like queue, %6.0f/s into a classic queue; router + ceiling middleware %6.0f/s, carrying our envelope %6.0f/s; broker retry %6.0f retries scheduled/s (%d messages, %d consumers)\n",
			round+1, raw, classic, ceil, env, ours, d.n, d.concurrency)
	}
	d.rawRate, d.oursRate, d.classicRate, d.ceilingRate = median(d.rawRates), median(d.oursRates), median(d.classicRates), median(d.ceilingRates)
	d.envelopeRate = median(d.envelopeRates)
	rep.rp = d
	rep.results.RetryPathRatio = ptr(round(d.oursRate/d.rawRate, 3))
	return nil
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// oursRetryPath runs the router with our middleware or, with ceil, with the ceiling
// middleware of ceiling.go in its place (same router, subscriber and topology),
// carrying envelope on its copies when that is not nil. Ours also returns the headers
// of one of its copies as the tier queue keeps them, without those the ceiling sets
// itself (the tier and the message UUID) and those the broker adds when it delivers
// (x-*).
func (e *env) oursRetryPath(ctx context.Context, round, n, handlers int, ceil bool, envelope amqp.Table) (float64, amqp.Table, error) {
	conn, err := e.dial()
	if err != nil {
		return 0, nil, err
	}
	defer conn.Close() //nolint:errcheck
	kind := "ours"
	switch {
	case ceil && envelope != nil:
		kind = "ceilenv"
	case ceil:
		kind = "ceil"
	}
	topic := e.name("rp", fmt.Sprintf("%s-%d", kind, round))
	prefix := e.name(fmt.Sprintf("rp-%s-delay-%d", kind, round))
	if err := e.declare(conn, queueTopology(topic)); err != nil {
		return 0, nil, err
	}
	if err := prefill(ctx, conn, topic, benchMessages("rp", n)); err != nil {
		return 0, nil, err
	}

	poison := e.name("rp-poison")
	e.reg.queue(poison)
	rcfg := amqpretry.Config{
		Backend:     delay.TTLTiers(retryPathDelay),
		Prefix:      prefix,
		Policy:      amqpretry.Policy{MaxAttempts: 2, Delays: []time.Duration{retryPathDelay}, Jitter: -1},
		PoisonQueue: poison,
	}
	if plan, err := rcfg.Plan(topic); err == nil {
		e.reg.topology(plan)
	}
	r, err := wamqp3.New(wamqp.NewDurableQueueConfig(e.uri), rcfg)
	if err != nil {
		return 0, nil, err
	}
	defer r.Close() //nolint:errcheck

	var (
		mu        sync.Mutex
		first     time.Time
		last      time.Time
		scheduled int
		finished  = make(chan struct{})
	)
	// count sits outside our middleware: a nil error from it is a confirmed hand-off.
	count := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			mu.Lock()
			if first.IsZero() {
				first = time.Now()
			}
			mu.Unlock()
			out, err := h(msg)
			if err == nil {
				mu.Lock()
				if scheduled++; scheduled == n {
					last = time.Now()
					close(finished)
				}
				mu.Unlock()
			}
			return out, err
		}
	}
	logger := watermill.NopLogger{}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, logger)
	if err != nil {
		return 0, nil, err
	}
	if ceil {
		c, err := e.newCeiling(prefix, []time.Duration{retryPathDelay})
		if err != nil {
			return 0, nil, err
		}
		defer c.close()
		c.envelope = envelope
		router.AddMiddleware(count, c.middleware)
	} else {
		router.AddMiddleware(count, r.Middleware)
	}
	sub, err := wamqp.NewSubscriber(r.SubscriberConfig(), logger)
	if err != nil {
		return 0, nil, err
	}
	defer sub.Close() //nolint:errcheck
	fail := func(*message.Message) error { return errPlanned }
	for i := range handlers {
		router.AddConsumerHandler(fmt.Sprintf("bench-%d", i), topic, sub, fail)
	}
	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(ctx) }()
	select {
	case <-finished:
	case err := <-runErr:
		return 0, nil, fmt.Errorf("router stopped: %w", err)
	case <-ctx.Done():
	case <-time.After(5 * time.Minute):
	}
	if err := router.Close(); err != nil {
		return 0, nil, err
	}
	if err := ctx.Err(); err != nil {
		return 0, nil, err
	}
	mu.Lock()
	defer mu.Unlock()
	if scheduled < n {
		return 0, nil, fmt.Errorf("%d of %d retries scheduled", scheduled, n)
	}
	// Sanity: the copies wait in the tier queue.
	tier := prefix + ".delay." + tierName(retryPathDelay)
	if depth, err := queueDepth(conn, tier); err != nil || depth < n {
		return 0, nil, fmt.Errorf("tier queue %s has %d messages, want %d (%v)", tier, depth, n, err)
	}
	rate := float64(n) / last.Sub(first).Seconds()
	if ceil {
		return rate, nil, nil
	}
	sample, err := peekHeaders(conn, tier)
	if err != nil {
		return 0, nil, fmt.Errorf("read a copy back from %s: %w", tier, err)
	}
	delete(sample, keys.Tier)
	delete(sample, wamqp.DefaultMessageUUIDHeaderKey)
	for k := range sample { // the broker's own, added on the way out (3.10: x-delivery-count)
		if strings.HasPrefix(k, "x-") {
			delete(sample, k)
		}
	}
	return rate, sample, nil
}

// peekHeaders returns the headers of the first message of queue, which it leaves there.
func peekHeaders(conn *amqp.Connection, queue string) (amqp.Table, error) {
	ch, err := conn.Channel()
	if err != nil {
		return nil, err
	}
	defer ch.Close() //nolint:errcheck // closing the channel requeues the unacked message
	d, ok, err := ch.Get(queue, false)
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, fmt.Errorf("queue %s is empty", queue)
	}
	return d.Headers, nil
}

// rawRetryPath runs the plain loop into a queue with a tier queue's arguments, or
// (tierLike false) into a plain durable classic queue.
func (e *env) rawRetryPath(ctx context.Context, round, n, consumers int, tierLike bool) (float64, error) {
	conn, err := e.dial()
	if err != nil {
		return 0, err
	}
	defer conn.Close() //nolint:errcheck
	pubConn, err := e.dial()
	if err != nil {
		return 0, err
	}
	defer pubConn.Close() //nolint:errcheck

	kind := "classic"
	if tierLike {
		kind = "tier"
	}
	src, dst := e.name("rp", fmt.Sprintf("raw-%s-src-%d", kind, round)), e.name("rp", fmt.Sprintf("raw-%s-dst-%d", kind, round))
	t := topology.Topology{Queues: []topology.Queue{{Name: src}, {Name: dst}}}
	if tierLike {
		dlx := e.name("rp", fmt.Sprintf("raw-dlx-%d", round))
		t.Exchanges = []topology.Exchange{{Name: dlx, Kind: amqp.ExchangeDirect}}
		t.Queues[1].Args = amqp.Table{ // as delay's ttl-tiers declares a tier queue
			declare.QueueTypeArg:          declare.QueueTypeQuorum,
			declare.MessageTTLArg:         retryPathDelay.Milliseconds(),
			declare.DeadLetterExchangeArg: dlx,
			declare.DeadLetterStrategyArg: declare.DeadLetterAtLeastOnce,
			declare.OverflowArg:           declare.OverflowRejectPublish,
		}
	}
	if err := e.declare(conn, t); err != nil {
		return 0, err
	}
	if err := prefill(ctx, conn, src, benchMessages("raw", n)); err != nil {
		return 0, err
	}

	pub, err := pubConn.Channel()
	if err != nil {
		return 0, err
	}
	if err := pub.Confirm(false); err != nil {
		return 0, err
	}
	returns := pub.NotifyReturn(make(chan amqp.Return, 64))
	go func() {
		for range returns { // drained so that the reader never blocks; none expected
		}
	}()

	var (
		mu       sync.Mutex
		first    time.Time
		last     time.Time
		done     int
		finished = make(chan struct{})
	)
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	errc := make(chan error, consumers)
	for i := range consumers {
		ch, err := conn.Channel()
		if err != nil {
			return 0, err
		}
		if err := ch.Qos(1, 0, false); err != nil {
			return 0, err
		}
		deliveries, err := ch.Consume(src, fmt.Sprintf("raw-%d", i), false, false, false, false, nil)
		if err != nil {
			return 0, err
		}
		go func() {
			for {
				var dlv amqp.Delivery
				select {
				case <-runCtx.Done():
					return
				case d, open := <-deliveries:
					if !open {
						return
					}
					dlv = d
				}
				mu.Lock()
				if first.IsZero() {
					first = time.Now()
				}
				mu.Unlock()
				dc, err := pub.PublishWithDeferredConfirmWithContext(runCtx, "", dst, true, false, amqp.Publishing{
					Headers: dlv.Headers, Body: dlv.Body, DeliveryMode: amqp.Persistent, MessageId: dlv.MessageId,
				})
				if err == nil {
					var ok bool
					if ok, err = dc.WaitContext(runCtx); err == nil && !ok {
						err = errors.New("publish nacked")
					}
				}
				if err == nil {
					err = dlv.Ack(false)
				}
				if err != nil {
					errc <- err
					return
				}
				mu.Lock()
				if done++; done == n {
					last = time.Now()
					close(finished)
				}
				mu.Unlock()
			}
		}()
	}
	select {
	case <-finished:
	case err := <-errc:
		return 0, err
	case <-ctx.Done():
		return 0, ctx.Err()
	case <-time.After(5 * time.Minute):
		mu.Lock()
		defer mu.Unlock()
		return 0, fmt.Errorf("raw loop: %d of %d within 5 minutes", done, n)
	}
	mu.Lock()
	defer mu.Unlock()
	return float64(n) / last.Sub(first).Seconds(), nil
}

// benchMessages returns n small messages with distinct UUIDs.
func benchMessages(tag string, n int) []*message.Message {
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(fmt.Sprintf("%s-%06d", tag, i), []byte(`{"order":"12345","amount":"42.00"}`))
	}
	return msgs
}
