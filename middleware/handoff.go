package middleware

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// ErrHandoff wraps a failed hand-off; the middleware returns it joined with the
// handler's error so that the router nacks the original with requeue.
var ErrHandoff = errors.New("retry hand-off failed, message nacked for redelivery")

// ErrNotWired is wrapped by the hand-off error of a message this Retry cannot route: its
// subscriber was not built from this Retry's subscriber config, or its retries could
// not come back to its queue. The error names the fix. Such a message is nacked like
// any failed hand-off and, after HandoffAttempts of them, poisoned.
var ErrNotWired = errors.New("retry middleware not wired to this message's subscriber")

// failureCounts counts the failed hand-offs of each message in a row, by UUID. It
// forgets a message once it is handed off or handled, and everything when it would
// hold more than maxTracked messages (hand-offs failing for that many different
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

func (c *failureCounts) forget(uuid string) {
	if c.size.Load() == 0 {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.n, uuid)
	c.size.Store(int64(len(c.n)))
}

// handoffBackoff is the wait after the n-th failed hand-off of a message in a row.
func handoffBackoff(n int) time.Duration {
	const first, most = 100 * time.Millisecond, 5 * time.Second
	if n > 6 {
		return most
	}
	return min(first<<max(n-1, 0), most)
}

// pause waits d, or until ctx is done.
func pause(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}

// chain lists the Retry middlewares (by Subscriber) a message passes through.
type chain struct {
	mu  sync.Mutex
	ids []string
}

type chainKey struct{}

// joinChain records id in msg's context. The chain is shared by every middleware of
// the handler, so an outer one sees the inner ones after the handler returns.
func joinChain(msg *message.Message, id string) {
	c, _ := msg.Context().Value(chainKey{}).(*chain)
	if c == nil {
		c = &chain{}
		msg.SetContext(context.WithValue(msg.Context(), chainKey{}, c))
	}
	c.mu.Lock()
	c.ids = append(c.ids, id)
	c.mu.Unlock()
}

// inChain tells whether the Retry id is among the middlewares msg passes through.
func inChain(msg *message.Message, id string) bool {
	c, _ := msg.Context().Value(chainKey{}).(*chain)
	if c == nil {
		return false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Contains(c.ids, id)
}

// handoffFailed handles a hand-off that failed with perr: it poisons the message once
// HandoffAttempts hand-offs of it have failed in a row (if mayPoison), and otherwise
// waits a while, then returns the error that makes the router nack it for redelivery.
func (r *Retry) handoffFailed(err, perr error, cp *message.Message, f failure, fields watermill.LogFields, mayPoison bool) error {
	n := r.failures.add(cp.UUID)
	r.stats.failures.Add(1)
	r.observe(Event{Kind: EventHandoffFailed, Queue: f.queue, Attempt: f.attempt, Err: perr})
	fields["handoff_failures"] = n
	r.cfg.Logger.Error("Could not hand off message, nacking it for redelivery", perr, fields)
	if mayPoison && n >= r.cfg.HandoffAttempts {
		note := fmt.Sprintf("%d hand-offs failed in a row, the last: %v; handler error: %v", n, perr, err)
		cp.Metadata.Set(ErrorKey, truncate(note, MaxErrorBytes))
		return r.poison(err, cp, f, PoisonHandoffFailed, fields)
	}
	pause(cp.Context(), handoffBackoff(n))
	return errors.Join(err, fmt.Errorf("%w: queue %q: %w", ErrHandoff, f.queue, perr))
}

// warner is a logger with a WARN level. watermill.LoggerAdapter has none: where the
// logger given has a Warn method it is used, else the line goes out at ERROR, so that
// alerting on errors sees it.
type warner interface {
	Warn(msg string, fields watermill.LogFields)
}

// warn logs msg at WARN, or at ERROR with err where the logger has no WARN level.
func warn(l watermill.LoggerAdapter, msg string, err error, fields watermill.LogFields) {
	if w, ok := l.(warner); ok {
		if err != nil {
			fields = fields.Add(watermill.LogFields{"err": err.Error()})
		}
		w.Warn(msg, fields)
		return
	}
	l.Error(msg, err, fields)
}
