// Package declare has what the library's packages share about declarations: the
// arguments RabbitMQ gives meaning to, named once; the review queues (poison,
// parking); the queue-type probe; the check of one declaration (check.go, ops.Verify's);
// the broker's clash text (clash.go); and the fix each topology error suggests (Fix). A
// topology is applied with topology.Topology.Apply.
package declare

import (
	"fmt"

	"github.com/amqpretry/amqpretry/topology"
)

// Argument names and values RabbitMQ gives meaning to.
const (
	QueueTypeArg          = "x-queue-type"
	MessageTTLArg         = "x-message-ttl"
	DeadLetterExchangeArg = "x-dead-letter-exchange"
	DeadLetterKeyArg      = "x-dead-letter-routing-key"
	DeadLetterStrategyArg = "x-dead-letter-strategy"
	OverflowArg           = "x-overflow"
	AlternateExchangeArg  = "alternate-exchange"
	DelayedTypeArg        = "x-delayed-type"
	DeliveryLimitArg      = "x-delivery-limit"
	// SingleActiveConsumerArg gives a queue one active consumer at a time, the next
	// taking over when it goes: what keeps order keys in order (Config.OrderKey).
	SingleActiveConsumerArg = "x-single-active-consumer"
	// RabbitMQ 4.3's delayed retry of quorum queues: type (disabled, all, failed or
	// returned) and the linear delay's minimum and maximum, in milliseconds.
	DelayedRetryTypeArg = "x-delayed-retry-type"
	DelayedRetryMinArg  = "x-delayed-retry-min"
	DelayedRetryMaxArg  = "x-delayed-retry-max"

	QueueTypeQuorum        = "quorum"
	DeadLetterAtLeastOnce  = "at-least-once"
	OverflowRejectPublish  = "reject-publish"
	ExchangeDelayedMessage = "x-delayed-message"
	DelayedRetryReturned   = "returned"
)

// reviewDeliveryLimit is the delivery limit of the queues that keep messages for
// people (poison, parking): reading them (basic.get, then a requeue) counts as a
// delivery on RabbitMQ 4.0 to 4.2, whose default limit of 20 would drop a poisoned
// message after its 20th listing. -1 would mean no limit on 4.x, but drops a message
// at its first requeue on 3.x; a million does neither.
const reviewDeliveryLimit = 1_000_000

// ReviewQueue is a queue whose messages wait for someone to review them and act, the
// poison and parking queues (role): a quorum queue, replicated like the delay queues,
// with a delivery limit no reading reaches.
func ReviewQueue(name, role string) topology.Queue {
	return topology.Queue{Name: name, Role: role, Args: reviewArgs()}
}

func reviewArgs() map[string]interface{} {
	return map[string]interface{}{
		QueueTypeArg:     QueueTypeQuorum,
		DeliveryLimitArg: int64(reviewDeliveryLimit),
	}
}

// The arguments of a queue of messages behind an order key (BehindQueue): RabbitMQ
// ignores them; they say whose messages the queue has.
const (
	BehindQueueArg = "x-amqpretry-queue"
	BehindKeyArg   = "x-amqpretry-key"
)

// BehindQueue is the queue name where the messages of key wait behind its head, for
// work queue queue (names.Names.Behind): a durable classic queue, declared when the
// key is blocked and deleted when it is released, whose arguments name queue and key.
func BehindQueue(name, queue, key string) topology.Queue {
	return topology.Queue{Name: name, Role: "behind", Args: map[string]interface{}{
		BehindQueueArg: queue,
		BehindKeyArg:   key,
	}}
}

// IsReviewQueue tells whether args, an existing queue's (QueueArgs), are a review
// queue's: a queue the library declared as a poison or parking queue.
func IsReviewQueue(args map[string]interface{}) bool { return SameArgs(args, reviewArgs()) }

// Merge returns the declarations of ts, in order.
func Merge(ts ...topology.Topology) topology.Topology {
	var out topology.Topology
	for _, t := range ts {
		out.Exchanges = append(out.Exchanges, t.Exchanges...)
		out.Queues = append(out.Queues, t.Queues...)
		out.Bindings = append(out.Bindings, t.Bindings...)
	}
	return out
}

// Unique drops repeated declarations, keeping the first.
func Unique(t topology.Topology) topology.Topology {
	var out topology.Topology
	seen := map[string]bool{}
	first := func(key string) bool {
		if seen[key] {
			return false
		}
		seen[key] = true
		return true
	}
	for _, e := range t.Exchanges {
		if first(fmt.Sprintf("e|%s|%s|%v", e.Name, e.Kind, e.Args)) {
			out.Exchanges = append(out.Exchanges, e)
		}
	}
	for _, q := range t.Queues {
		if first(fmt.Sprintf("q|%s|%v", q.Name, q.Args)) {
			out.Queues = append(out.Queues, q)
		}
	}
	for _, b := range t.Bindings {
		if first(fmt.Sprintf("b|%s|%s|%s|%v|%v", b.Exchange, b.Destination, b.Key, b.ToExchange, b.Args)) {
			out.Bindings = append(out.Bindings, b)
		}
	}
	return out
}
