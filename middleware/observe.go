package middleware

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
)

// counter is an int64 counted concurrently.
type counter struct{ atomic.Int64 }

func (c *counter) add() int64 { return c.Add(1) }

// Stats returns what the engine did since it was built.
func (e *engine) Stats() Stats {
	return Stats{Retries: e.stats.retries.Load(), Poisoned: e.stats.poisoned.Load(), HandoffFailures: e.stats.failures.Load(),
		PoisonPending: e.pending.len()}
}

// observe sends ev to Config.Observe, if set.
func (e *engine) observe(ev amqpretry.Event) {
	if e.cfg.Observe != nil {
		e.cfg.Observe(ev)
	}
}

// observeDelivery reports a delivery, with its lateness when it is a retry whose due
// time is known: recorded on the copy, or, for a retry held in the work queue, kept
// here when it was settled. A held retry that came back long before its due time
// shows that the work queue does not hold retries: it is logged, and the queue's
// later retries go to the copying backend (see heldRetries).
func (e *engine) observeDelivery(d delivery) {
	ev := amqpretry.Event{Kind: amqpretry.EventDelivered, Queue: d.queue, Attempt: d.attempt}
	due := d.heldDue
	if !d.held && d.attempt > 1 {
		due = d.envelope.Due
	}
	if !due.IsZero() {
		ev.Late, ev.Lateness = true, d.at.Sub(due)
	}
	if d.attempt > 1 {
		switch {
		case e.inPlace != nil && (d.held || e.backend == nil || d.envelope.EffectiveDelay == 0):
			ev.Backend = delay.Backend(e.inPlace.Name()) // held in the work queue
		case e.backend != nil:
			ev.Backend = delay.Backend(e.backend.Name())
		}
	}
	// Back long before it was due: its nack may have been lost with its connection (the
	// broker then gives the delivery back at once), so the queue is judged by a second
	// early return of the same message in a row, which a queue that holds retries does
	// not give.
	if d.backEarly && d.early > 0 && e.held.markBroken(d.queue) {
		e.cfg.Logger.Error("Work queue does not hold delayed retries: a nacked message came back at once; its retries now go to the copying backend, or are poisoned without one",
			fmt.Errorf("queue %q: back %s after the nack, expected %s: a quorum queue needs x-delayed-retry-type=returned and x-delayed-retry-min/-max (declare it with them, or apply a delayed-retry policy to it, RabbitMQ 4.3+); a classic queue cannot hold delayed retries (`amqpretry topology verify` tells its type): move to a new quorum queue, or use a copying Backend", d.queue, (e.cfg.DelayedRetryDelay+ev.Lateness).Round(time.Millisecond), e.cfg.DelayedRetryDelay),
			watermill.LogFields{"queue": d.queue, "message_uuid": d.msg.UUID})
	}
	e.observe(ev)
}

// sampled tells whether the n-th scheduled retry is logged: every one for
// RetryLogEvery 0 or 1, none below 0, one in RetryLogEvery otherwise.
func (e *engine) sampled(n int64) bool {
	every := int64(e.cfg.RetryLogEvery)
	switch {
	case every < 0:
		return false
	case every <= 1:
		return true
	}
	return n%every == 1
}

// heldRetries remembers the retries this process left in their work queue, by UUID,
// with their due time: to measure their lateness when they come back (the broker
// redelivers them unchanged, so nothing on the message says when), and to notice a
// work queue that does not hold them (a retry back long before its due time: the
// queue lacks its delayed-retry settings, and every nack would come back at once).
// It forgets everything when it would hold more than maxTracked.
type heldRetries struct {
	mu     sync.Mutex
	due    map[string]heldRetry
	broken map[string]bool // work queues found not to hold retries
	size   atomic.Int64
}

// heldRetry is what the engine knows of a retry it held: when it is due, and when the
// message first failed (the broker redelivers it unchanged, without its envelope).
// until is when a retry held more than once is due (zero: due at due), rehelds how
// many times it was held again.
// env is the envelope the retry would carry on a copy: the broker redelivers the
// message unchanged, so the engine writes it into the metadata when it comes back.
// early counts the times in a row the message came back long before it was due.
type heldRetry struct {
	due, first, until time.Time
	rehelds, early    int
	env               Envelope
}

func (h *heldRetries) add(uuid string, r heldRetry) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.due == nil || len(h.due) >= maxTracked {
		h.due = map[string]heldRetry{}
	}
	h.due[uuid] = r
	h.size.Store(int64(len(h.due)))
}

// take returns and forgets what it knows of uuid, if this process held it.
func (h *heldRetries) take(uuid string) (heldRetry, bool) {
	if h.size.Load() == 0 {
		return heldRetry{}, false
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	due, ok := h.due[uuid]
	delete(h.due, uuid)
	h.size.Store(int64(len(h.due)))
	return due, ok
}

// markBroken records that queue does not hold retries; it tells whether that is news.
func (h *heldRetries) markBroken(queue string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.broken[queue] {
		return false
	}
	if h.broken == nil {
		h.broken = map[string]bool{}
	}
	h.broken[queue] = true
	return true
}

func (h *heldRetries) isBroken(queue string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.broken[queue]
}
