package delay

import (
	"fmt"

	"github.com/amqpretry/amqpretry/topology"
	"github.com/amqpretry/amqpretry/xdeath"
	amqp "github.com/rabbitmq/amqp091-go"
)

// deliveryLimitArg is a quorum queue's delivery limit; RabbitMQ 4.0+ applies
// defaultDeliveryLimit to a quorum queue without one (-1 disables it).
const (
	deliveryLimitArg     = "x-delivery-limit"
	defaultDeliveryLimit = 20
)

// WorkQueueWarning checks a work queue the retry middleware consumes from, given the
// broker's version (Capabilities.Version), the queue's declared arguments and the retry
// policy's MaxAttempts. It returns a warning, or "" when there is nothing to say.
//
// Why: when a hand-off fails (the broker is unreachable, a confirm times out), the
// middleware nacks the original with requeue and the broker redelivers it, so every
// failed hand-off costs a delivery. A quorum queue counts them (x-delivery-count) and
// past its delivery limit dead-letters the message, or drops it if the queue has no
// dead-letter exchange: outside the retry policy, without reaching the poison queue.
// RabbitMQ 4.0+ gives every quorum queue a limit of 20 unless it declares one, and a
// redelivery loop can spend 20 deliveries within a second when hand-offs fail fast (a
// deleted delay exchange, for instance). While hand-offs fail, the broker's redeliveries stand in for the policy's
// attempts, so a limit below MaxAttempts gives up before the policy would.
//
// It warns about a quorum queue (x-queue-type "quorum") that declares no
// x-delivery-limit on RabbitMQ 4.0+ (or an unknown version), or a limit that is not an
// integer, or one from 0 to MaxAttempts-1. The remedy is an explicit x-delivery-limit:
// -1 (4.0+) keeps a message however long hand-offs fail, a large limit bounds a
// redelivery loop. Policies and a vhost's default queue type are not visible here and
// are not checked.
func WorkQueueWarning(brokerVersion string, args amqp.Table, maxAttempts int) string {
	if args[topology.QueueTypeArg] != topology.QueueTypeQuorum {
		return ""
	}
	raw, set := args[deliveryLimitArg]
	if !set {
		if v, ok := parseVersion(brokerVersion); ok && v.compare(4, 0, 0) < 0 {
			return ""
		}
		return fmt.Sprintf("quorum queue without %s: RabbitMQ 4.0+ applies a limit of %d deliveries, so a message whose hand-off fails %d times in a row is dead-lettered or dropped instead of retried; declare %s explicitly (-1 for no limit)",
			deliveryLimitArg, defaultDeliveryLimit, defaultDeliveryLimit, deliveryLimitArg)
	}
	limit, ok := xdeath.Integer(raw)
	switch {
	case !ok:
		return fmt.Sprintf("quorum queue with %s %v of type %T: RabbitMQ expects an integer", deliveryLimitArg, raw, raw)
	case limit >= 0 && limit < int64(maxAttempts):
		return fmt.Sprintf("quorum queue with %s %d, below the policy's %d attempts: when hand-offs fail the broker dead-letters or drops a message after %d deliveries instead of retrying it; raise it to at least %d, or -1 for no limit",
			deliveryLimitArg, limit, maxAttempts, limit, maxAttempts)
	}
	return ""
}
