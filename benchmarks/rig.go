package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	wdelay "github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/handoff"
	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/marshal"
	"github.com/amqpretry/amqpretry/topology"
)

// rig is one delay backend on its own hand-off connection, wired to a fresh work queue.
type rig struct {
	h     backend.Handoff
	b     backend.Backend
	queue string
}

// benchBackends are the backends the per-backend scenarios measure: every backend
// that parks a copy. The holding ones (delayed-retry, delivery-time) keep the failed
// delivery in its work queue and schedule nothing: delayed-retry is measured by the
// RabbitMQ 4.3 experiments (-broker43).
func benchBackends() []string {
	var out []string
	for _, value := range backend.All(delay.TTLTiers()) {
		b, err := backend.Open(value, backend.Setup{Prefix: "x"})
		if _, held := b.(backend.Holder); err == nil && held {
			continue
		}
		out = append(out, value.Name())
	}
	return out
}

// newRig builds the backend called name as the library does for any backend
// (backend.Open, then backend.Prepare: refuse what the broker cannot run, declare),
// changing nothing but the name. A backend that cannot run on this broker returns a
// non-empty skip reason (delayed-exchange without its plugin: delay.ErrPluginMissing;
// delayed-retry before 4.3: delay.ErrUnsupported). err is for everything else.
func (e *env) newRig(name, scope string, tiers []time.Duration) (r *rig, skip string, err error) {
	h, err := handoff.Dial(backend.HandoffConfig{URI: e.uri, Topology: topology.ModeDeclare})
	if err != nil {
		return nil, "", err
	}
	prefix := e.name(scope, name)
	value, err := delay.Parse(name, delay.Settings{Tiers: tiers, Publisher: queuePublisher{h}})
	var b backend.Backend
	if err == nil {
		b, err = backend.Open(value, backend.Setup{Prefix: prefix, Env: backend.Env{Handoff: h}})
	}
	if err == nil {
		e.reg.topology(b.Topology())
		if err = backend.Prepare(b, h, topology.ModeDeclare); err != nil {
			_ = b.Close()
		}
	}
	if err != nil {
		_ = h.Close()
		e.reg.markUnsure() // it may have declared part of its topology
		if errors.Is(err, delay.ErrPluginMissing) || errors.Is(err, delay.ErrUnsupported) {
			return nil, err.Error(), nil
		}
		return nil, "", err
	}
	r = &rig{h: h, b: b, queue: prefix + ".work"}
	conn, err := h.Connection()
	if err == nil {
		err = e.declare(conn, declare.Merge(queueTopology(r.queue), b.WorkQueue(r.queue)))
	}
	if err != nil {
		r.close()
		return nil, "", err
	}
	return r, "", nil
}

// queuePublisher publishes to the queue named by the topic through the hand-off:
// where the memory backend delivers a retry when its delay is over.
type queuePublisher struct{ h backend.Handoff }

func (p queuePublisher) Publish(queue string, msgs ...*message.Message) error {
	for _, msg := range msgs {
		if err := p.h.ToQueue(msg.Context(), queue, msg); err != nil {
			return err
		}
	}
	return nil
}

func (queuePublisher) Close() error { return nil }

func (r *rig) close() {
	_ = r.b.Close()
	_ = r.h.Close()
}

// schedule hands one message for the rig's queue to the backend with delay d, through
// the library's Scheduler (a message.Publisher reading Watermill's delay metadata). It
// records the due time under the envelope's key, as the retry middleware does
// (backends write none).
func (r *rig) schedule(id string, d time.Duration) error {
	msg := message.NewMessage(id, []byte(id))
	wdelay.Message(msg, wdelay.For(d))
	effective, err := r.b.Effective(d)
	if err != nil {
		return err
	}
	msg.Metadata.Set(keys.Due, time.Now().Add(effective).UTC().Format(time.RFC3339Nano))
	if err := (backend.Scheduler{Backend: r.b}).Publish(r.queue, msg); err != nil {
		return fmt.Errorf("schedule %s for %s: %w", id, d, err)
	}
	return nil
}

// arrival is a message read back from a work queue and when it was read.
type arrival struct {
	msg *message.Message
	at  time.Time
}

// consumer reads a queue on a connection of its own, stamping each delivery with the
// time it was read, before it is unmarshalled and acked.
type consumer struct {
	conn     *amqp.Connection
	arrivals chan arrival
	errs     chan error
}

func (e *env) consume(queue string, buffer int) (*consumer, error) {
	conn, err := e.dial()
	if err != nil {
		return nil, err
	}
	ch, err := conn.Channel()
	if err == nil {
		err = ch.Qos(1000, 0, false)
	}
	var deliveries <-chan amqp.Delivery
	if err == nil {
		deliveries, err = ch.Consume(queue, "", false, false, false, false, nil)
	}
	if err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("consume %s: %w", queue, err)
	}
	c := &consumer{conn: conn, arrivals: make(chan arrival, buffer), errs: make(chan error, 1)}
	go func() {
		for d := range deliveries {
			at := time.Now()
			msg, err := marshal.Marshaler{}.Unmarshal(d)
			if err == nil {
				err = d.Ack(false)
			}
			if err != nil {
				c.errs <- fmt.Errorf("delivery from %s: %w", queue, err)
				return
			}
			select {
			case c.arrivals <- arrival{msg: msg, at: at}:
			default: // the buffer has room for every message a scenario expects
			}
		}
	}()
	return c, nil
}

func (c *consumer) close() { _ = c.conn.Close() }

// next returns the next arrival, or an error at the deadline.
func (c *consumer) next(ctx context.Context, deadline <-chan time.Time) (arrival, error) {
	select {
	case a := <-c.arrivals:
		return a, nil
	case err := <-c.errs:
		return arrival{}, err
	case <-ctx.Done():
		return arrival{}, ctx.Err()
	case <-deadline:
		return arrival{}, errTimeout
	}
}

var errTimeout = errors.New("timed out")

func queueTopology(q string) topology.Topology {
	return topology.Topology{Queues: []topology.Queue{{Name: q}}}
}
