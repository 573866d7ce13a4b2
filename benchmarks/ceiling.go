package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/keys"
)

// Ceiling: the healthy throughput of our middleware against a CEILING, a minimal
// hand-written middleware doing the same at-least-once work in the same router, with the
// same subscriber (amqpretry's SubscriberConfig: the xdeath marshaler and the topology
// builder that binds the queue to the delivery exchange) and the same ttl-tiers
// topology. On a handler error the ceiling publishes the message as it came (its payload,
// its metadata as string headers, without the broker's x-* and our amqpretry-* keys:
// no envelope, no metadata of ours, no marshaler) through amqp091-go on ONE confirm
// channel of its own connection to the delay exchange, with the tier header of the tier
// our middleware would choose (100 ms on the first failure, 200 ms on the second: it
// counts failures per message UUID in a map), waits for the confirm and returns nil.
//
// Beside it, a plain amqp091-go consumer (prefetch 1, no router) does the same work:
// the handler, then on failure the same confirmed publish of the delivery as it came,
// then the ack. Router versus plain is what the router itself costs.
//
// All three run on the throughput scenario's mix (5,000 messages, 2,000 with handler work, every tenth failing
// twice, one handler), with 0 ms and with 1 ms of handler work (a time.Sleep, I/O-like),
// alternately in one run, ceilingRounds times, the order reversed every other round.
// Ratio: the mean healthy rate with our middleware over the ceiling's.

var ceilingWork = []time.Duration{0, time.Millisecond}

// ceilingWorkN is the number of messages of a run with handler work.
const ceilingWorkN = 2000

type ceilingRow struct {
	work                 time.Duration
	n                    int
	ours, ceiling, plain []float64 // healthy msg/s per round
}

func (c ceilingRow) ratio() float64 { return mean(c.ours) / mean(c.ceiling) }
func (c ceilingRow) key() string    { return fmt.Sprintf("%dms", c.work.Milliseconds()) }

type ceilingDetail struct {
	n    int
	rows []*ceilingRow
}

func mean(xs []float64) float64 {
	var s float64
	for _, x := range xs {
		s += x
	}
	return s / float64(len(xs))
}

func runCeiling(ctx context.Context, e *env, rep *report) error {
	d := &ceilingDetail{n: e.sz.throughputN}
	for _, w := range ceilingWork {
		n := d.n
		if w > 0 {
			n = min(n, ceilingWorkN) // the rate is that of the work; fewer messages show it
		}
		d.rows = append(d.rows, &ceilingRow{work: w, n: n})
	}
	for round := range e.sz.ceilingRounds {
		for _, row := range d.rows {
			order := []variant{brokerRetry, ceilingRetry, plainRetry}
			if round%2 == 1 {
				order = []variant{plainRetry, ceilingRetry, brokerRetry}
			}
			for _, v := range order {
				var st *runStats
				var err error
				if v == plainRetry {
					st, err = e.plainRun(ctx, row.n, row.work)
				} else {
					st, err = e.routerRun(ctx, v, row.n, 1, row.work)
				}
				if err != nil {
					return fmt.Errorf("%s, %s work: %w", v, row.work, err)
				}
				switch v {
				case brokerRetry:
					row.ours = append(row.ours, st.healthyRate())
				case ceilingRetry:
					row.ceiling = append(row.ceiling, st.healthyRate())
				case plainRetry:
					row.plain = append(row.plain, st.healthyRate())
				}
			}
			fmt.Printf("   round %d, %s handler work: healthy msg/s: ours %6.0f, ceiling %6.0f, plain amqp091-go %6.0f\n",
				round+1, row.work, last(row.ours), last(row.ceiling), last(row.plain))
		}
	}
	rep.ceil = d
	rep.results.HealthyCeilingRatio = map[string]float64{}
	for _, row := range d.rows {
		rep.results.HealthyCeilingRatio[row.key()] = round(row.ratio(), 3)
	}
	return nil
}

func last(xs []float64) float64 { return xs[len(xs)-1] }

// ceiling is the CEILING middleware.
type ceiling struct {
	conn     *amqp.Connection
	ch       *amqp.Channel
	exchange string
	tiers    []time.Duration // the tier of the n-th failure; the last for any later one

	// envelope, when set, makes this the ceiling carrying our envelope: every copy
	// also gets these headers (a copy our hand-off published, as the broker stored it)
	// and goes out as ours does, mandatory with a fresh MessageId. Same wire and broker
	// work as ours; what is left between the two is our client code.
	envelope amqp.Table

	mu       sync.Mutex
	failures map[string]int
}

// newCeiling opens the ceiling's connection and confirm channel; it publishes to the
// ttl-tiers delay exchange of prefix.
func (e *env) newCeiling(prefix string, tiers []time.Duration) (*ceiling, error) {
	conn, err := e.dial()
	if err != nil {
		return nil, err
	}
	ch, err := conn.Channel()
	if err == nil {
		err = ch.Confirm(false)
	}
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	return &ceiling{conn: conn, ch: ch, exchange: prefix + ".delay", tiers: tiers, failures: map[string]int{}}, nil
}

func (c *ceiling) close() { _ = c.conn.Close() }

// tier returns the tier of msg's next failure.
func (c *ceiling) tier(uuid string) time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := c.failures[uuid]
	c.failures[uuid] = n + 1
	return c.tiers[min(n, len(c.tiers)-1)]
}

// publish publishes the copy to the tier's queue through the delay exchange (routing
// key: the work queue, which the tier dead-letters back to) and waits for the confirm.
func (c *ceiling) publish(ctx context.Context, queue string, tier time.Duration, headers amqp.Table, body []byte) error {
	p := amqp.Publishing{Headers: headers, Body: body, DeliveryMode: amqp.Persistent}
	mandatory := c.envelope != nil
	if mandatory {
		for k, v := range c.envelope {
			if _, own := headers[k]; !own {
				headers[k] = v
			}
		}
		p.MessageId = watermill.NewULID()
	}
	headers[keys.Tier] = tierName(tier)
	dc, err := c.ch.PublishWithDeferredConfirmWithContext(ctx, c.exchange, queue, mandatory, false, p)
	if err != nil {
		return err
	}
	ok, err := dc.WaitContext(ctx)
	if err == nil && !ok {
		err = errors.New("publish nacked")
	}
	return err
}

func (c *ceiling) middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		if err == nil {
			return out, nil
		}
		queue := message.SubscribeTopicFromCtx(msg.Context()) // NewDurableQueueConfig: queue = topic
		if perr := c.publish(msg.Context(), queue, c.tier(msg.UUID), ceilingHeaders(msg), msg.Payload); perr != nil {
			return nil, errors.Join(err, perr)
		}
		return nil, nil
	}
}

// ceilingHeaders are the headers of the ceiling's copy: the message's UUID and its
// metadata without the broker's x-* and our amqpretry-* keys.
func ceilingHeaders(msg *message.Message) amqp.Table {
	headers := amqp.Table{wamqp.DefaultMessageUUIDHeaderKey: msg.UUID}
	for k, v := range msg.Metadata {
		if !strings.HasPrefix(k, "x-") && !strings.HasPrefix(k, "amqpretry-") {
			headers[k] = v
		}
	}
	return headers
}

// plainRun is the throughput scenario's failing mix through a plain amqp091-go
// consumer and the ceiling's publisher, without a router: consume at prefetch 1, run
// the handler, on failure publish the delivery as it came (without x-* headers) and
// wait for the confirm, then ack.
func (e *env) plainRun(ctx context.Context, n int, work time.Duration) (*runStats, error) {
	conn, err := e.dial()
	if err != nil {
		return nil, err
	}
	defer conn.Close() //nolint:errcheck
	runSeq++
	topic := e.name("tp", fmt.Sprintf("%s-h1-%d", plainRetry, runSeq))
	if err := e.declare(conn, queueTopology(topic)); err != nil {
		return nil, err
	}
	if err := prefill(ctx, conn, topic, throughputMessages(plainRetry, n)); err != nil {
		return nil, fmt.Errorf("prefill %s: %w", topic, err)
	}
	prefix := e.name("tp-delay")
	b, err := backend.Open(delay.TTLTiers(throughputTiers...), backend.Setup{Prefix: prefix})
	if err != nil {
		return nil, err
	}
	if err := e.declare(conn, backend.Plan(b, topic)); err != nil {
		return nil, err
	}
	c, err := e.newCeiling(prefix, throughputTiers)
	if err != nil {
		return nil, err
	}
	defer c.close()

	ch, err := conn.Channel()
	if err == nil {
		err = ch.Qos(1, 0, false)
	}
	var deliveries <-chan amqp.Delivery
	if err == nil {
		deliveries, err = ch.Consume(topic, "", false, false, false, false, nil)
	}
	if err != nil {
		return nil, err
	}
	st := newRunStats(n, work)
	errc := make(chan error, 1)
	go func() {
		for d := range deliveries {
			uuid, _ := d.Headers[wamqp.DefaultMessageUUIDHeaderKey].(string)
			msg := message.NewMessage(uuid, d.Body)
			if f, ok := d.Headers[failKey].(string); ok {
				msg.Metadata.Set(failKey, f)
			}
			err := st.handle(msg)
			if err != nil {
				headers := make(amqp.Table, len(d.Headers))
				for k, v := range d.Headers {
					if !strings.HasPrefix(k, "x-") {
						headers[k] = v
					}
				}
				err = c.publish(ctx, topic, c.tier(uuid), headers, d.Body)
			}
			if err == nil {
				err = d.Ack(false)
			}
			if err != nil {
				errc <- err
				return
			}
		}
	}()
	timeout := time.Minute + time.Duration(n)*100*time.Millisecond
	select {
	case <-st.finished:
	case err := <-errc:
		return nil, err
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-time.After(timeout):
		return nil, fmt.Errorf("%s: not every message handled within %s", plainRetry, timeout)
	}
	_ = ch.Close()
	st.mu.Lock()
	defer st.mu.Unlock()
	return st, nil
}
