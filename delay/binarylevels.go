package delay

import (
	"fmt"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/topology"
)

// binaryLevels parks a message in a cascade of Levels quorum queues, the design of
// NServiceBus.RabbitMQ and Celery 5.5. Level L holds messages for 2^L seconds (a
// queue-level TTL, no consumers) and then dead-letters them, at least once, to level
// L-1; level 0 dead-letters to the delivery exchange. The routing key spells the delay
// in whole seconds in binary, most significant bit (level Levels-1) first, one word per
// bit, then the destination queue: with 4 levels, 5s for queue orders is
// "0.1.0.1.orders". Each level's topic exchange sends bit 1 to its queue and bit 0 on
// to the next level's exchange, so a message waits only in the levels whose bit is set
// and its waits add up to the delay. Every queue has one TTL, so FIFO order is expiry
// order: no head-of-line blocking.
//
// Names, with the default prefix and 28 levels:
//
//	amqpretry.level.<L>       topic exchange AND quorum queue of level L, L = 0..27;
//	                          copies are published to amqpretry.level.27
//	amqpretry.levels.deliver  topic exchange, level 0's dead-letter exchange; a work
//	                          queue binds there with 28 '*' words then its own name
//	                          ("*.*.(…).*.orders"), so it gets its own retries only
//	amqpretry.parking         fanout exchange and queue: the delivery exchange's
//	                          alternate exchange, where a retry whose queue is gone is
//	                          kept instead of blocking level 0
//
// Precision: a delay rounds UP to whole seconds (Effective returns the rounded delay),
// then each level it waits in adds the broker's expiry and dead-lettering latency,
// milliseconds each on an idle broker. Maximum: 2^Levels - 1 seconds (28 levels: about
// 8.5 years); Effective and Publish refuse a longer delay with ErrDelayTooLong.
// Durability: replicated quorum queues and at-least-once dead lettering, so waiting
// messages survive a broker restart and the loss of a minority of nodes. Cost: a
// waiting message is one message in one quorum queue; it is rewritten once per set bit
// of its delay (at most Levels times); the broker keeps Levels quorum queues whatever
// the load. Pick it for exact delays of any length (exponential backoff without tiers)
// without a plugin.
//
// A destination queue's name must not contain '*' or '#' (a topic binding cannot match
// them literally) and the routing key must fit AMQP's 255 bytes, so names are at most
// 255 - 2×Levels bytes. Publish refuses other names; WorkQueue declares no binding for
// them, so such a queue can never receive another queue's retries.
//
// The level exchanges' bindings depend on Levels: to change Levels, use a new Prefix
// (or delete the old amqpretry.level.* exchanges), or old and new bindings would both
// route.
type binaryLevels struct {
	h      *Handoff
	names  names
	levels int
}

// DefaultLevels is the default number of levels of the binary-levels backend: delays up
// to 2^28 - 1 seconds, about 8.5 years.
const DefaultLevels = 28

// maxLevels: level 29 would hold messages 2^29 s (17 years), longer than maxTTL.
const maxLevels = 29

// maxRoutingKey is the longest routing key AMQP carries. amqp091-go does not refuse a
// longer one: it wraps its length byte and sends another key.
const maxRoutingKey = 255

func (b *binaryLevels) Name() string { return BackendBinaryLevels }

// Topology: for each level a topic exchange and a quorum queue, the delivery exchange
// and parking.
func (b *binaryLevels) Topology() topology.Topology {
	t := b.names.delivery(b.names.levelsDeliverExchange(), amqp.ExchangeTopic)
	for l := range b.levels {
		name, next := b.names.level(l), b.names.levelsDeliverExchange()
		if l > 0 {
			next = b.names.level(l - 1)
		}
		skip := strings.Repeat("*.", b.levels-1-l)
		t.Exchanges = append(t.Exchanges, topology.Exchange{Name: name, Kind: amqp.ExchangeTopic})
		t.Queues = append(t.Queues, topology.Queue{Name: name, Args: delayQueueArgs(time.Second<<l, next)})
		t.Bindings = append(t.Bindings,
			topology.Binding{Exchange: name, Destination: name, Key: skip + "1.#"},
			topology.Binding{Exchange: name, Destination: next, Key: skip + "0.#", ToExchange: true},
		)
	}
	return t
}

// WorkQueue binds queue to the delivery exchange with Levels '*' words then its name,
// so it receives its own retries only. A name Publish would refuse gets no binding.
func (b *binaryLevels) WorkQueue(queue string) topology.Topology {
	t := b.names.delivery(b.names.levelsDeliverExchange(), amqp.ExchangeTopic)
	if b.checkQueue(queue) == nil {
		t.Bindings = append(t.Bindings, topology.Binding{
			Exchange: b.names.levelsDeliverExchange(), Destination: queue, Key: strings.Repeat("*.", b.levels) + queue,
		})
	}
	return t
}

// maxDelay is the longest delay: 2^levels - 1 seconds.
func (b *binaryLevels) maxDelay() time.Duration { return (time.Second << b.levels) - time.Second }

// Effective rounds requested up to whole seconds, and refuses it past the maximum.
func (b *binaryLevels) Effective(requested time.Duration) (time.Duration, error) {
	if requested > b.maxDelay() {
		return 0, fmt.Errorf("%s: %w: %s is longer than the maximum %s (2^%d - 1 s)", BackendBinaryLevels, ErrDelayTooLong, requested, b.maxDelay(), b.levels)
	}
	secs := max(requested, 0) / time.Second
	if requested%time.Second > 0 {
		secs++
	}
	return secs * time.Second, nil
}

// routingKey spells effective (whole seconds) in binary, most significant level first,
// then queue.
func (b *binaryLevels) routingKey(effective time.Duration, queue string) string {
	secs := int64(effective / time.Second)
	var k strings.Builder
	for l := b.levels - 1; l >= 0; l-- {
		if secs>>l&1 == 1 {
			k.WriteString("1.")
		} else {
			k.WriteString("0.")
		}
	}
	k.WriteString(queue)
	return k.String()
}

// checkQueue tells why queue cannot be a destination, or returns nil.
func (b *binaryLevels) checkQueue(queue string) error {
	switch {
	case queue == "":
		return fmt.Errorf("%s: empty destination queue", BackendBinaryLevels)
	case strings.ContainsAny(queue, "*#"):
		return fmt.Errorf("%s: queue %q: a name with '*' or '#' cannot be bound literally on topic exchange %q", BackendBinaryLevels, queue, b.names.levelsDeliverExchange())
	case 2*b.levels+len(queue) > maxRoutingKey:
		return fmt.Errorf("%s: queue %q: name longer than %d bytes, the routing key would exceed %d bytes", BackendBinaryLevels, queue, maxRoutingKey-2*b.levels, maxRoutingKey)
	}
	return nil
}

func (b *binaryLevels) Publish(queue string, msgs ...*message.Message) error {
	if err := b.checkQueue(queue); err != nil {
		return err
	}
	top := b.names.level(b.levels - 1)
	return schedule(b, queue, msgs, func(msg *message.Message, _, effective time.Duration) error {
		owned := func() topology.Topology { return b.Topology().Merge(b.WorkQueue(queue)) }
		if err := b.h.publishOwned(msg.Context(), top, b.routingKey(effective, queue), msg, nil, true, owned); err != nil {
			return fmt.Errorf("exchange %s: %w", top, err)
		}
		return nil
	})
}

func (b *binaryLevels) Close() error { return nil }
