package delay

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/names"
	"github.com/amqpretry/amqpretry/topology"
)

// binaryLevels parks a message in a cascade of Levels quorum queues, the design of
// NServiceBus.RabbitMQ and Celery 5.5. Level L keeps messages for 2^L seconds (a
// queue-level TTL, no consumers) and then dead-letters them, at least once, to level
// L-1; level 0 dead-letters to the delivery exchange. The routing key spells the delay
// in whole seconds in binary, most significant bit (level Levels-1) first, one word per
// bit, then the destination queue: with 4 levels, 5s for queue orders is
// "0.1.0.1.orders". Each level's topic exchange sends bit 1 to its queue and bit 0 on
// to the next level's exchange, so a message waits only in the levels whose bit is set
// and its waits add up to the delay. Every queue has one TTL, so FIFO order is expiry
// order: no head-of-line blocking.
//
//	<prefix>.level.<L>       topic exchange AND quorum queue of level L; copies are
//	                         published to the top level
//	<prefix>.levels.deliver  topic exchange, level 0's dead-letter exchange; a work
//	                         queue binds there with Levels '*' words then its name
//	<prefix>.parking         the delivery exchange's alternate exchange and its queue
//
// A delay rounds UP to whole seconds; past 2^Levels - 1 s it is refused. A destination
// queue's name must not contain '*' or '#' and must leave room for the routing key in
// AMQP's 255 bytes (255 - 2×Levels); WorkQueue binds no other name, so such a queue
// never receives another queue's retries. The level exchanges' bindings depend on
// Levels: to change Levels, change the prefix too.
type binaryLevels struct {
	env    backend.Env
	names  names.Names
	levels int
}

// BinaryLevels ("binary-levels") parks a retry in a cascade of quorum queues of 2^L
// seconds: any delay up to 2^levels - 1 s, in 1 s steps, without a plugin. levels is 1
// to 29; 0 is the default, 28 (about 8.5 years). Change the Config's Prefix with it:
// New refuses a prefix that has a ladder of other levels
// (docs/switching-backends.md).
func BinaryLevels(levels int) Backend { return binaryLevelsValue{levels: levels} }

// binaryLevelsValue is BinaryLevels as configured.
type binaryLevelsValue struct {
	lib
	levels int // 0: the default
}

// Name is "binary-levels".
func (binaryLevelsValue) Name() string { return "binary-levels" }

func (b binaryLevelsValue) String() string { return b.Name() }

// Open validates the levels and opens the backend.
func (b binaryLevelsValue) Open(s backend.Setup) (backend.Backend, error) {
	levels := b.levels
	if levels == 0 {
		levels = backend.DefaultLevels
	}
	if levels < 1 || levels > backend.MaxLevels {
		return nil, fmt.Errorf("Levels: %d is outside 1 to %d (a level keeping 2^%d s would need a TTL longer than RabbitMQ's ten-year maximum)", levels, backend.MaxLevels, backend.MaxLevels)
	}
	return &binaryLevels{env: s.Env, names: names.Names{Prefix: s.Prefix}, levels: levels}, nil
}

func (b *binaryLevels) Name() string { return binaryLevelsValue{}.Name() }

// Flags give Levels other than the default.
func (b *binaryLevels) Flags() []string {
	if b.levels == backend.DefaultLevels {
		return nil
	}
	return []string{"--levels", strconv.Itoa(b.levels)}
}

// StoragePattern matches the queue of any level under the prefix.
func (b *binaryLevels) StoragePattern() string {
	return `^` + regexp.QuoteMeta(b.names.Level(0)[:len(b.names.Level(0))-1]) + `[0-9]+$`
}

// QueueOf: a parked copy's routing key is one word per level, then its work queue.
func (b *binaryLevels) QueueOf(key string) string {
	if len(key) <= 2*b.levels {
		return ""
	}
	return key[2*b.levels:]
}

// Unenumerable: Widest names every level.
func (b *binaryLevels) Unenumerable() string { return "" }

// Widest is the ladder of the most levels: every name any Levels declares.
func (b *binaryLevels) Widest() backend.Backend {
	return &binaryLevels{env: b.env, names: b.names, levels: backend.MaxLevels}
}

func (b *binaryLevels) Caps() backend.Caps {
	return backend.Caps{Keeps: backend.KeepsCopy, Longest: b.maxDelay(), PastLongest: backend.Refuse,
		CarriesEnvelope: true, Fix: "raise Levels (Prefix with it)",
		Text: fmt.Sprintf("1s steps up to %s (Levels %d), a longer delay is refused", b.maxDelay(), b.levels)}
}

func (b *binaryLevels) Topology() topology.Topology {
	t := delivery(b.names, b.names.LevelsDeliver(), amqp.ExchangeTopic)
	for l := range b.levels {
		name, next := b.names.Level(l), b.names.LevelsDeliver()
		if l > 0 {
			next = b.names.Level(l - 1)
		}
		skip := strings.Repeat("*.", b.levels-1-l)
		t.Exchanges = append(t.Exchanges, topology.Exchange{Name: name, Kind: amqp.ExchangeTopic})
		t.Queues = append(t.Queues, topology.Queue{Name: name, Args: delayQueueArgs(time.Second<<l, next), Role: "delay"})
		t.Bindings = append(t.Bindings,
			topology.Binding{Exchange: name, Destination: name, Key: skip + "1.#"},
			topology.Binding{Exchange: name, Destination: next, Key: skip + "0.#", ToExchange: true},
		)
	}
	return t
}

func (b *binaryLevels) DelayQueues() []backend.DelayQueue {
	out := make([]backend.DelayQueue, b.levels)
	for l := range b.levels {
		out[l] = backend.DelayQueue{Name: b.names.Level(l), TTL: time.Second << l}
	}
	return out
}

// WorkQueue binds queue to the delivery exchange with Levels '*' words then its name.
// A name Park would refuse gets no binding.
func (b *binaryLevels) WorkQueue(queue string) topology.Topology {
	t := delivery(b.names, b.names.LevelsDeliver(), amqp.ExchangeTopic)
	if b.checkQueue(queue) == nil {
		t.Bindings = append(t.Bindings, topology.Binding{
			Exchange: b.names.LevelsDeliver(), Destination: queue, Key: strings.Repeat("*.", b.levels) + queue,
		})
	}
	return t
}

// maxDelay is the longest delay: 2^levels - 1 seconds.
func (b *binaryLevels) maxDelay() time.Duration { return (time.Second << b.levels) - time.Second }

// Effective rounds requested up to whole seconds, and refuses it past the maximum.
func (b *binaryLevels) Effective(requested time.Duration) (time.Duration, error) {
	if requested > b.maxDelay() {
		return 0, fmt.Errorf("%s: %w: %s is longer than the maximum %s (2^%d - 1 s)", binaryLevelsValue{}, ErrDelayTooLong, requested, b.maxDelay(), b.levels)
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
		return fmt.Errorf("%s: empty destination queue", binaryLevelsValue{})
	case strings.ContainsAny(queue, "*#"):
		return fmt.Errorf("%s: queue %q: a name with '*' or '#' cannot be bound literally on topic exchange %q", binaryLevelsValue{}, queue, b.names.LevelsDeliver())
	case 2*b.levels+len(queue) > names.MaxBytes:
		return fmt.Errorf("%s: queue %q: name longer than %d bytes, the routing key would exceed %d bytes", binaryLevelsValue{}, queue, names.MaxBytes-2*b.levels, names.MaxBytes)
	}
	return nil
}

// Park publishes msg to the top level with the delay spelled in its routing key.
func (b *binaryLevels) Park(ctx context.Context, queue string, msg *message.Message, effective time.Duration) error {
	if b.env.Handoff == nil {
		return errDetached
	}
	if err := b.checkQueue(queue); err != nil {
		return err
	}
	top := b.names.Level(b.levels - 1)
	owned := func() topology.Topology { return backend.Plan(b, queue) }
	if err := b.env.Handoff.Publish(ctx, top, b.routingKey(effective, queue), msg, nil, true, owned); err != nil {
		return fmt.Errorf("exchange %s: %w", top, err)
	}
	return nil
}

func (b *binaryLevels) Close() error { return nil }

func (b binaryLevelsValue) with(s Settings) Backend {
	if s.Levels != 0 {
		b.levels = s.Levels
	}
	return b
}
