package delay

import (
	"context"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/names"
	"github.com/amqpretry/amqpretry/topology"
)

// ttlTiers parks a message in one of a ladder of quorum queues, each with a queue-level
// TTL and no consumers. FIFO order is expiry order within a queue, so there is no
// head-of-line blocking. An expired message is dead-lettered (at least once) to the
// delivery exchange with the routing key it was published with, the name of the queue
// that failed, which is bound there under its own name: it goes back to that queue only.
//
//	<prefix>.delay          headers exchange, where copies are published
//	<prefix>.delay.<tier>   one quorum queue per tier, bound on keys.Tier
//	<prefix>.deliver        direct exchange, the tiers' dead-letter exchange
//	<prefix>.parking        the delivery exchange's alternate exchange and its queue
//
// A requested delay snaps to the shortest tier at least as long; a delay longer than
// the longest tier gets the longest tier, then is re-parked when it comes back, until
// it is due (a RetryAfter and the policy's delays alike): never early.
type ttlTiers struct {
	env      backend.Env
	names    names.Names
	tiers    []time.Duration // ascending
	tierKeys []string        // keys.Tier of each tier, named once
	exchange string          // the delay exchange
}

// TTLTiers (the default backend, "ttl-tiers") parks a retry in one of a ladder of
// quorum queues with queue-level TTLs, one queue per tier; a delay snaps up to the
// next tier, and one longer than the longest tier waits the longest, then is parked
// again when it comes back, until it is due: never early. Each tier is a whole number
// of milliseconds from 1ms to ten years. With no tiers, the default ladder: 34 tiers
// about 25% apart, 1s 1.25s 1.6s 2s 2.5s 3.15s 4s 5s 6.3s 8s, the same times 10 and 100
// (10s to 8m20s), then 10m 15m 20m 30m 45m 1h.
func TTLTiers(tiers ...time.Duration) Backend { return ttlTiersValue{tiers: tiers} }

// ttlTiersValue is TTLTiers as configured.
type ttlTiersValue struct {
	lib
	tiers []time.Duration // nil: the default ladder
}

// Name is "ttl-tiers".
func (ttlTiersValue) Name() string { return "ttl-tiers" }

func (b ttlTiersValue) String() string { return b.Name() }

// Open validates the tiers (none takes the default ladder) and opens the backend.
func (b ttlTiersValue) Open(s backend.Setup) (backend.Backend, error) {
	tiers := b.tiers
	if len(tiers) == 0 {
		tiers = backend.DefaultTiers()
	}
	return openTTLTiers(tiers, s.Env, names.Names{Prefix: s.Prefix})
}

func openTTLTiers(given []time.Duration, env backend.Env, n names.Names) (*ttlTiers, error) {
	if err := validateTiers(given); err != nil {
		return nil, err
	}
	tiers := slices.Clone(given)
	slices.Sort(tiers)
	tierKeys := make([]string, len(tiers))
	for i, t := range tiers {
		tierKeys[i] = names.Tier(t)
	}
	return &ttlTiers{env: env, names: n, tiers: tiers, tierKeys: tierKeys, exchange: n.DelayExchange()}, nil
}

func (b *ttlTiers) Name() string { return ttlTiersValue{}.Name() }

// Flags give a ladder other than the default one.
func (b *ttlTiers) Flags() []string {
	if slices.Equal(b.tiers, backend.DefaultTiers()) {
		return nil
	}
	return []string{"--tiers", strings.Join(b.tierKeys, ",")}
}

// StoragePattern matches the queue of any tier under the prefix.
func (b *ttlTiers) StoragePattern() string {
	return `^` + regexp.QuoteMeta(b.names.TierQueues()[:len(b.names.TierQueues())-1]) + `[0-9hms.]+$`
}

// Unenumerable: any tier may have been configured once.
func (b *ttlTiers) Unenumerable() string { return b.names.TierQueues() }

// QueueOf: a parked copy's routing key is its work queue.
func (b *ttlTiers) QueueOf(key string) string { return key }

func (b *ttlTiers) Caps() backend.Caps {
	longest := b.tiers[len(b.tiers)-1]
	return backend.Caps{Keeps: backend.KeepsCopy, Longest: longest, PastLongest: backend.Repark,
		CarriesEnvelope: true, Fix: "add a longer tier to Tiers",
		Text: fmt.Sprintf("%d tiers from %s to %s, a delay snaps up to the next, a longer one waits %s", len(b.tiers), b.tiers[0], longest, longest)}
}

func (b *ttlTiers) Topology() topology.Topology {
	t := delivery(b.names, b.names.Deliver(), amqp.ExchangeDirect)
	t.Exchanges = append(t.Exchanges, topology.Exchange{Name: b.names.DelayExchange(), Kind: amqp.ExchangeHeaders})
	for _, tier := range b.tiers {
		q := b.names.TierQueue(tier)
		t.Queues = append(t.Queues, topology.Queue{Name: q, Args: delayQueueArgs(tier, b.names.Deliver()), Role: "delay"})
		t.Bindings = append(t.Bindings, topology.Binding{
			Exchange: b.names.DelayExchange(), Destination: q,
			Args: amqp.Table{"x-match": "all", keys.Tier: names.Tier(tier)},
		})
	}
	return t
}

func (b *ttlTiers) DelayQueues() []backend.DelayQueue {
	out := make([]backend.DelayQueue, len(b.tiers))
	for i, tier := range b.tiers {
		out[i] = backend.DelayQueue{Name: b.names.TierQueue(tier), TTL: tier}
	}
	return out
}

// Effective snaps requested to the shortest tier at least as long, or the longest tier.
func (b *ttlTiers) Effective(requested time.Duration) (time.Duration, error) {
	i, _ := slices.BinarySearch(b.tiers, requested)
	return b.tiers[min(i, len(b.tiers)-1)], nil
}

// WorkQueue binds queue to the delivery exchange under its own name.
func (b *ttlTiers) WorkQueue(queue string) topology.Topology {
	t := delivery(b.names, b.names.Deliver(), amqp.ExchangeDirect)
	t.Bindings = append(t.Bindings, topology.Binding{Exchange: b.names.Deliver(), Destination: queue, Key: queue})
	return t
}

// Park publishes msg to the delay exchange, routed by tier, with the queue as routing
// key. effective must be a tier (Effective's answer).
func (b *ttlTiers) Park(ctx context.Context, queue string, msg *message.Message, effective time.Duration) error {
	if b.env.Handoff == nil {
		return errDetached
	}
	var tier string
	if i, ok := slices.BinarySearch(b.tiers, effective); ok {
		tier = b.tierKeys[i]
	} else {
		tier = names.Tier(effective) // no such tier: the broker returns it unroutable
	}
	headers := amqp.Table{keys.Tier: tier}
	owned := func() topology.Topology { return backend.Plan(b, queue) }
	if err := b.env.Handoff.Publish(ctx, b.exchange, queue, msg, headers, true, owned); err != nil {
		return fmt.Errorf("queue %s: %w", b.names.TierQueue(effective), err)
	}
	return nil
}

func (b *ttlTiers) Close() error { return nil }

func (b ttlTiersValue) with(s Settings) Backend {
	if s.Tiers != nil {
		b.tiers = s.Tiers
	}
	return b
}
