package delay

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/internal/backend"
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

// DelayedRetry ("delayed-retry") has RabbitMQ 4.3+ hold the failed delivery in the
// work queue itself (its delayed retry of quorum queues): no copy, no publish, one
// constant delay per work queue, without jitter. delay is that delay (the work queue's
// x-delayed-retry-min and -max), a whole number of milliseconds; 0 is the default, 1s.
// A longer delay of the error's own (a RetryAfter) is never cut short: the retry is
// held again, as many times as it takes, so it comes back at the first multiple of
// delay past the one asked for. Policy.Delays and Policy.Jitter left zero mean that
// delay; a value set that it would ignore (Delays other than delay, a positive Jitter,
// Immediate) is refused, even one that is the default on a copying backend
// (Exponential(time.Second, 2, 10*time.Minute), Jitter 0.2). The work queue must be a quorum queue: an existing queue
// of another type is refused by the transport's AddHandler, or else at the first
// subscribe. To hold only the first retries, in front of a copying backend, see
// HeldRetries.
func DelayedRetry(delay time.Duration) Backend { return delayedRetryValue{delay: delay} }

// delayedRetryValue is DelayedRetry as configured.
type delayedRetryValue struct {
	lib
	delay time.Duration // 0: the default
}

// Name is "delayed-retry".
func (delayedRetryValue) Name() string { return "delayed-retry" }

func (b delayedRetryValue) String() string { return b.Name() }

// Open validates the delay and opens the backend.
func (b delayedRetryValue) Open(backend.Setup) (backend.Backend, error) {
	d := b.delay
	if d == 0 {
		d = backend.DefaultRetryDelay
	}
	if err := backend.CheckRetryDelay("delay.DelayedRetry(delay)", d); err != nil {
		return nil, err
	}
	return delayedRetry{delay: d}, nil
}

func (b delayedRetry) Name() string { return delayedRetryValue{}.Name() }

// OneDelay is the queue's delay, whatever is asked.
func (b delayedRetry) OneDelay() time.Duration { return b.delay }

// WorkQueueArgs: every work queue holds its returned deliveries for the delay.
func (b delayedRetry) WorkQueueArgs() map[string]any { return backend.WorkQueueArgs(b.delay) }

// CheckVersion refuses RabbitMQ older than 4.3, which would redeliver at once.
func (b delayedRetry) CheckVersion(v string) error { return needs43(b.Name(), v) }

// Flags give a delay other than the default.
func (b delayedRetry) Flags() []string {
	if b.delay == backend.DefaultRetryDelay {
		return nil
	}
	return []string{"--retry-delay", b.delay.String()}
}

// Caps: a nack carries nothing, so the retry comes back without its envelope; a
// longer delay is held again.
func (b delayedRetry) Caps() backend.Caps {
	return backend.Caps{Keeps: backend.KeepsDelivery, Longest: b.delay, PastLongest: backend.HoldAgain,
		Text: fmt.Sprintf("one constant delay, %s (its delay), whatever is asked", b.delay)}
}

// Effective is the queue's delay, whatever was asked: the broker knows no other.
func (b delayedRetry) Effective(time.Duration) (time.Duration, error) { return b.delay, nil }

func (b delayedRetry) Topology() topology.Topology        { return topology.Topology{} }
func (b delayedRetry) WorkQueue(string) topology.Topology { return topology.Topology{} }
func (b delayedRetry) DelayQueues() []backend.DelayQueue  { return nil }

func (b delayedRetry) Park(context.Context, string, *message.Message, time.Duration) error {
	return fmt.Errorf("%s: holds the failed delivery, it parks no copy", b.Name())
}

// Settle has nothing to arrange: the middleware's nack requeues msg and the broker
// holds it.
func (b delayedRetry) Settle(*message.Message, time.Duration, message.Metadata) error {
	return nil
}

func (b delayedRetry) Close() error { return nil }

func (b delayedRetryValue) with(s Settings) Backend {
	if s.Delay != 0 {
		b.delay = s.Delay
	}
	return b
}
