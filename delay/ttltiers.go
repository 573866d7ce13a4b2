package delay

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/topology"
)

// TierHeader is the header the ttl-tiers backend routes on: the tier's name (see
// TierName). The delay exchange is a headers exchange that binds each tier queue on it.
const TierHeader = "amqpretry-tier"

// ttlTiers parks a message in one of a ladder of quorum queues, each with a queue-level
// TTL and no consumers. FIFO order is expiry order within a queue, so there is no
// head-of-line blocking. An expired message is dead-lettered (at least once) to the
// delivery exchange with the routing key it was published with, the name of the queue
// that failed, which is bound there under its own name: it goes back to that queue only.
//
// Names, with the default prefix:
//
//	amqpretry.delay          headers exchange, where copies are published
//	amqpretry.delay.<tier>   one quorum queue per tier (amqpretry.delay.5s, ...)
//	amqpretry.deliver        direct exchange, the tiers' dead-letter exchange
//	amqpretry.parking        fanout exchange and queue: the delivery exchange's alternate
//	                         exchange, where a retry whose queue is gone is kept
//
// A requested delay snaps to the shortest tier at least as long; a delay longer than the
// longest tier gets the longest tier (the one case where a retry comes back early).
type ttlTiers struct {
	h      *Handoff
	logger watermill.LoggerAdapter
	names  names
	tiers  []time.Duration // ascending
}

// Topology: the delay exchange, one queue per tier, the delivery exchange and parking.
func (b *ttlTiers) Topology() topology.Topology {
	t := b.names.delivery(b.names.deliverExchange(), amqp.ExchangeDirect)
	t.Exchanges = append(t.Exchanges, topology.Exchange{Name: b.names.delayExchange(), Kind: amqp.ExchangeHeaders})
	for _, tier := range b.tiers {
		q := b.names.tierQueue(tier)
		t.Queues = append(t.Queues, topology.Queue{Name: q, Args: delayQueueArgs(tier, b.names.deliverExchange())})
		t.Bindings = append(t.Bindings, topology.Binding{
			Exchange: b.names.delayExchange(), Destination: q,
			Args: amqp.Table{"x-match": "all", TierHeader: TierName(tier)},
		})
	}
	return t
}

func (b *ttlTiers) Name() string { return BackendTTLTiers }

// Effective snaps requested to the shortest tier at least as long, or the longest tier.
func (b *ttlTiers) Effective(requested time.Duration) (time.Duration, error) {
	i, _ := slices.BinarySearch(b.tiers, requested)
	return b.tiers[min(i, len(b.tiers)-1)], nil
}

// WorkQueue binds queue to the delivery exchange under its own name.
func (b *ttlTiers) WorkQueue(queue string) topology.Topology {
	t := b.names.delivery(b.names.deliverExchange(), amqp.ExchangeDirect)
	t.Bindings = append(t.Bindings, topology.Binding{Exchange: b.names.deliverExchange(), Destination: queue, Key: queue})
	return t
}

func (b *ttlTiers) Publish(queue string, msgs ...*message.Message) error {
	return schedule(b, queue, msgs, func(msg *message.Message, requested, tier time.Duration) error {
		if requested > tier {
			b.logger.Error("Delay longer than the longest tier, using the longest: the retry comes back early", ErrDelayTooLong, watermill.LogFields{
				"message_uuid": msg.UUID, "requested_delay": requested.String(), "effective_delay": tier.String(),
			})
		}
		headers := amqp.Table{TierHeader: TierName(tier)}
		owned := func() topology.Topology { return b.Topology().Merge(b.WorkQueue(queue)) }
		if err := b.h.publishOwned(msg.Context(), b.names.delayExchange(), queue, msg, headers, true, owned); err != nil {
			return fmt.Errorf("queue %s: %w", b.names.tierQueue(tier), err)
		}
		return nil
	})
}

func (b *ttlTiers) Close() error { return nil }

// TierName spells a tier the short way: 1s, 5s, 2m, 1h30m, 250ms.
func TierName(t time.Duration) string {
	s := t.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}
