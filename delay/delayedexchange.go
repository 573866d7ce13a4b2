package delay

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/topology"
)

// delayedExchange hands each message to the rabbitmq_delayed_message_exchange plugin:
// one exchange of type x-delayed-message holds the message for its x-delay header
// (milliseconds), then routes it as a direct exchange by its routing key, the name of
// the queue that failed, which is bound there under its own name.
//
// Names, with the default prefix:
//
//	amqpretry.delayed   x-delayed-message exchange (x-delayed-type direct), where
//	                    copies are published and work queues are bound
//
// Precision: a delay rounds UP to whole milliseconds, at least 1 ms (the plugin
// delivers an x-delay of 0 or less at once); the plugin's node then runs one timer for
// the earliest due message. Maximum: 2^32-1 ms (about 49.7 days): the plugin silently delivers a longer
// x-delay at once, so Effective and Publish refuse it with ErrDelayTooLong. Durability:
// the plugin keeps waiting messages in a Mnesia table on disk on ONE node, unreplicated:
// they survive a restart of that node, not its loss, nor disabling the plugin. Cost: one
// record in that table per waiting message; the plugin is not meant for hundreds of
// thousands of them. Pick it only where the plugin is available (it is not on Amazon
// MQ, has no build for RabbitMQ 4.3, and is archived), for millisecond delays of any
// length up to 49 days on one exchange, when single-node storage is acceptable.
//
// The plugin routes nowhere at publish time, so it returns every mandatory publish as
// unroutable: this backend publishes non-mandatory, and the confirm means the plugin
// has stored the message. Routability is proven another way: before its first publish
// to a queue, the backend binds the queue to the exchange (idempotent, and an error if
// the queue does not exist) and remembers that it did. The plugin routes once, at the
// due time: messages due to a queue deleted meanwhile are lost. No alternate exchange
// can catch them, since it would receive every delayed publish at once.
type delayedExchange struct {
	h     *Handoff
	names names

	mu    sync.Mutex
	bound map[string]bool // queues bound to the exchange by this backend
}

// ErrPluginMissing is returned (wrapped) by New for the delayed-exchange backend on a
// broker without the rabbitmq_delayed_message_exchange plugin.
var ErrPluginMissing = errors.New(pluginName + " plugin not enabled")

// delayHeader is the plugin's delay header, in milliseconds.
const delayHeader = "x-delay"

// maxPluginDelay is the longest delay the plugin honours (an Erlang timer's maximum).
const maxPluginDelay = (1<<32 - 1) * time.Millisecond

func (b *delayedExchange) errPluginMissing() error {
	return fmt.Errorf("%s: cannot declare exchange %q of type %s: %w on the broker; enable it on every node with `rabbitmq-plugins enable %s`, or use the %s backend, which needs no plugin",
		BackendDelayedExchange, b.names.delayedExchange(), topology.ExchangeDelayedMessage, ErrPluginMissing, pluginName, BackendBinaryLevels)
}

func (b *delayedExchange) Name() string { return BackendDelayedExchange }

// Topology: the delayed exchange, routing as a direct exchange.
func (b *delayedExchange) Topology() topology.Topology {
	return topology.Topology{Exchanges: []topology.Exchange{{
		Name: b.names.delayedExchange(), Kind: topology.ExchangeDelayedMessage,
		Args: amqp.Table{topology.DelayedTypeArg: amqp.ExchangeDirect},
	}}}
}

// WorkQueue binds queue to the delayed exchange under its own name.
func (b *delayedExchange) WorkQueue(queue string) topology.Topology {
	t := b.Topology()
	t.Bindings = []topology.Binding{b.binding(queue)}
	return t
}

func (b *delayedExchange) binding(queue string) topology.Binding {
	return topology.Binding{Exchange: b.names.delayedExchange(), Destination: queue, Key: queue}
}

// Effective rounds requested up to whole milliseconds, at least 1 ms, and refuses it
// past 2^32-1 ms.
func (b *delayedExchange) Effective(requested time.Duration) (time.Duration, error) {
	if requested > maxPluginDelay {
		return 0, fmt.Errorf("%s: %w: %s is longer than the plugin's maximum %s (2^32-1 ms)", BackendDelayedExchange, ErrDelayTooLong, requested, maxPluginDelay)
	}
	ms := requested / time.Millisecond
	if requested%time.Millisecond > 0 {
		ms++
	}
	return max(ms, 1) * time.Millisecond, nil
}

// bind binds queue to the exchange before the first publish to it.
func (b *delayedExchange) bind(queue string) error {
	b.mu.Lock()
	done := b.bound[queue]
	b.mu.Unlock()
	if done {
		return nil
	}
	if err := b.h.Declare(topology.Topology{Bindings: []topology.Binding{b.binding(queue)}}); err != nil {
		return fmt.Errorf("%s: queue %q cannot receive from exchange %q (does it exist?): %w", BackendDelayedExchange, queue, b.names.delayedExchange(), err)
	}
	b.mu.Lock()
	b.bound[queue] = true
	b.mu.Unlock()
	return nil
}

func (b *delayedExchange) Publish(queue string, msgs ...*message.Message) error {
	return schedule(b, queue, msgs, func(msg *message.Message, _, effective time.Duration) error {
		// The plugin cannot report an unroutable delayed message: the binding, declared
		// (and so checked) before the first publish to a queue, proves the route.
		if err := b.bind(queue); err != nil {
			return err
		}
		headers := amqp.Table{delayHeader: effective.Milliseconds()}
		owned := func() topology.Topology { return b.WorkQueue(queue) }
		if err := b.h.publishOwned(msg.Context(), b.names.delayedExchange(), queue, msg, headers, false, owned); err != nil {
			return fmt.Errorf("exchange %s: %w", b.names.delayedExchange(), err)
		}
		return nil
	})
}

func (b *delayedExchange) Close() error { return nil }
