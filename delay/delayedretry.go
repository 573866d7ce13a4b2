package delay

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/names"
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

func openDelayedRetry(s backend.Spec, _ backend.Env, _ names.Names) (backend.Backend, error) {
	if err := backend.CheckRetryDelay(s.RetryDelay); err != nil {
		return nil, err
	}
	return delayedRetry{delay: s.RetryDelay}, nil
}

func (b delayedRetry) Name() string { return string(DelayedRetry) }

// Caps: a nack carries nothing, so the retry comes back without its envelope; a
// longer delay is held again.
func (b delayedRetry) Caps() backend.Caps {
	return backend.Caps{Keeps: backend.KeepsDelivery, Delays: backend.ConstantDelay, Longest: b.delay, PastLongest: backend.HoldAgain,
		Text: fmt.Sprintf("one constant delay, %s (DelayedRetryDelay), whatever is asked", b.delay)}
}

// Effective is the queue's delay, whatever was asked: the broker knows no other.
func (b delayedRetry) Effective(time.Duration) (time.Duration, error) { return b.delay, nil }

func (b delayedRetry) Topology() topology.Topology        { return topology.Topology{} }
func (b delayedRetry) WorkQueue(string) topology.Topology { return topology.Topology{} }
func (b delayedRetry) DelayQueues() []backend.DelayQueue  { return nil }

func (b delayedRetry) Park(context.Context, string, *message.Message, time.Duration) error {
	return fmt.Errorf("%s: holds the failed delivery, it parks no copy", DelayedRetry)
}

// Settle has nothing to arrange: the middleware's nack requeues msg and the broker
// holds it.
func (b delayedRetry) Settle(*message.Message, time.Duration, message.Metadata) error {
	return nil
}

func (b delayedRetry) Close() error { return nil }
