package middleware

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/backend"
)

// A failed hand-off: counted per message, paced, and poisoned after
// backend.HandoffAttempts.

// handoffFailed handles a hand-off that failed with perr: it poisons the message once
// backend.HandoffAttempts hand-offs of it have failed in a row (if mayPoison), and otherwise
// waits a while, then returns the error that makes the router nack it for redelivery.
func (e *engine) handoffFailed(f failure, cp *message.Message, perr error, cause string, mayPoison bool) error {
	n := e.failures.add(cp.UUID)
	e.stats.failures.Add(1)
	e.observe(amqpretry.Event{Kind: amqpretry.EventHandoffFailed, Queue: f.queue, Attempt: f.attempt, Err: perr, Cause: cause})
	f.log()["handoff_failures"] = n
	e.cfg.Logger.Error("Could not hand off message, nacking it for redelivery", perr, f.log())
	if mayPoison && n >= e.handoffAttempts() {
		f.envelope.Error = fmt.Sprintf("%d hand-offs failed in a row, the last: %v; handler error: %v", n, perr, f.err)
		return e.poison(f, cp, amqpretry.ReasonHandoffFailed)
	}
	if mayPoison && acked(f.msg) {
		// A middleware acked it already (Watermill's InstantAck, around.go): a nack
		// would not give it back, and it would be lost.
		f.envelope.Error = fmt.Sprintf("hand-off failed, and the message was acked already, so it could not be given back to the broker: %v; handler error: %v", perr, f.err)
		return e.poison(f, cp, amqpretry.ReasonHandoffFailed)
	}
	e.givenBack.add(cp.UUID)
	e.pausePaced(f.msg.Context(), backend.HandoffPause(n))
	return errors.Join(f.err, fmt.Errorf("%w: queue %q: %w", amqpretry.ErrHandoff, f.queue, perr))
}

// handoffAttempts is how many hand-offs of one message may fail in a row before it is
// poisoned: backend.HandoffAttempts, or what the test hook set when e was built.
func (e *engine) handoffAttempts() int {
	if e.handoffLimit > 0 {
		return e.handoffLimit
	}
	return backend.HandoffAttempts
}

// failureCounts counts the failed hand-offs of each message in a row, by UUID. It
// forgets a message once it is handed off or handled, and everything when it would
// track more than maxTracked messages (hand-offs failing for that many different
// messages at once is a broker outage, where the backoff is what matters).
type failureCounts struct {
	mu   sync.Mutex
	n    map[string]int
	size atomic.Int64 // len(n), read without the lock on the success path
}

const maxTracked = 10_000

func (c *failureCounts) add(uuid string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil || len(c.n) >= maxTracked {
		c.n = map[string]int{}
	}
	c.n[uuid]++
	c.size.Store(int64(len(c.n)))
	return c.n[uuid]
}

// forget forgets uuid's failed hand-offs. Its callers on the way of every message ask
// size first, without the lock.
func (c *failureCounts) forget(uuid string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.n, uuid)
	c.size.Store(int64(len(c.n)))
}

// count returns uuid's count.
func (c *failureCounts) count(uuid string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[uuid]
}

// pause waits d, or until ctx is done.
func pause(ctx context.Context, d time.Duration) { pauseUntil(ctx, d, nil) }

// pausePaced waits d, or until ctx is done or the engine is closed.
func (e *engine) pausePaced(ctx context.Context, d time.Duration) {
	pauseUntil(ctx, d, e.life.closing())
}

// pauseUntil waits d, or until ctx is done or closing is closed (never, when nil).
func pauseUntil(ctx context.Context, d time.Duration, closing <-chan struct{}) {
	if d <= 0 {
		return
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	case <-closing:
	}
}
