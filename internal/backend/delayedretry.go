package backend

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/topology"
)

// delayedRetry leaves a failed delivery in its work queue: the middleware settles it
// with a requeue (watermill-amqp's basic.nack), which RabbitMQ 4.3 counts as
// "returned", and a quorum queue declared with x-delayed-retry-type "returned" holds
// it aside for x-delayed-retry-min before it redelivers it. It declares no queue or
// exchange and copies nothing. What it cannot do: a delay per message (every retry of
// a work queue waits the same, the queue's), or a growing one (with "returned" the
// broker never grows it), and it cannot record anything on the message, which comes
// back unchanged; the attempt is counted from the broker's own x-acquired-count.
type delayedRetry struct{ delay time.Duration }

func (b delayedRetry) Name() delay.Backend { return delay.DelayedRetry }

// Effective is the queue's delay, whatever was asked: the broker knows no other.
func (b delayedRetry) Effective(time.Duration) (time.Duration, error) { return b.delay, nil }

func (b delayedRetry) Topology() topology.Topology        { return topology.Topology{} }
func (b delayedRetry) WorkQueue(string) topology.Topology { return topology.Topology{} }
func (b delayedRetry) DelayQueues() []DelayQueue          { return nil }

func (b delayedRetry) Park(context.Context, string, *message.Message, time.Duration) error {
	return fmt.Errorf("%s: retries in place, it parks no copy", delay.DelayedRetry)
}

// Settle nacks msg: the subscriber requeues it and the broker holds it.
func (b delayedRetry) Settle(msg *message.Message, _ time.Duration, _ message.Metadata) error {
	msg.Nack()
	return nil
}

func (b delayedRetry) Close() error { return nil }

// WorkQueueArgs are the arguments a work queue needs for RabbitMQ 4.3 to hold its
// returned deliveries for d: a quorum queue with delayed retry of returns.
func WorkQueueArgs(d time.Duration) amqp.Table {
	return amqp.Table{
		declare.QueueTypeArg:        declare.QueueTypeQuorum,
		declare.DelayedRetryTypeArg: declare.DelayedRetryReturned,
		declare.DelayedRetryMinArg:  d.Milliseconds(),
		declare.DelayedRetryMaxArg:  d.Milliseconds(),
	}
}

// HoldsRetries tells whether the work queues of a config with this backend and this
// many held retries hold retries themselves (RabbitMQ 4.3's delayed retry): then
// they must be quorum queues with WorkQueueArgs.
func HoldsRetries(backend delay.Backend, heldRetries int) bool {
	return backend == delay.DelayedRetry || heldRetries > 0
}

// CheckRetryDelay refuses a DelayedRetryDelay the broker cannot take: it is given in
// whole milliseconds, at least one.
func CheckRetryDelay(d time.Duration) error {
	if d < time.Millisecond || d%time.Millisecond != 0 {
		return fmt.Errorf("DelayedRetryDelay: %s must be a whole number of milliseconds, at least 1ms", d)
	}
	return nil
}
