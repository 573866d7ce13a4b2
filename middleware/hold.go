package middleware

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/keys"
)

// The hold: a retry the broker keeps as the failed delivery itself, in its work queue
// (settle, holdDelivery), held again until it is due (holdAgain), and what this
// process remembers of it until it comes back (heldRetries).

// settle leaves msg in its work queue for the broker to hold and redeliver as the
// retry r, after r.effective: no copy. The envelope goes with it where the transport
// can carry it, and is remembered here for when it comes back without it. It returns
// the holder's error; the failure path reports the held retry (scheduled).
func (e *engine) settle(msg *message.Message, f failure, r retryPlan) error {
	requested, effective := r.requested, r.effective
	due := time.Now().Add(effective)
	f.envelope.Attempt = r.next
	f.envelope.RequestedDelay, f.envelope.EffectiveDelay, f.envelope.Due = requested, effective, due
	var md message.Metadata
	if e.holder.caps.CarriesEnvelope {
		md = message.Metadata{}
		f.envelope.Write(md)
		if f.orderKey != "" {
			md[keys.OrderHead] = f.orderKey
		}
	}
	if err := e.holdDelivery(msg, effective, md); err != nil {
		return err
	}
	h := heldRetry{due: due, first: f.envelope.FirstFailure, env: f.envelope}
	if f.backEarly {
		h.early = f.early + 1
	}
	if hold := e.holder.caps.Longest; e.holder.caps.PastLongest == backend.HoldAgain && effective > hold {
		// Back after the queue's delay, then held again until requested is over.
		h.due, h.until = time.Now().Add(hold), time.Now().Add(requested)
	}
	e.held.add(f.queue, msg.UUID, h)
	return nil
}

// holdDelivery has the broker hold msg, the delivery that failed, in its work queue for
// effective: the holder arranges how (with envelope where the transport can
// carry it), and the middleware nacks it. That nack is the delivery's one settlement:
// the handler chain then returns nil, and the router's Ack that follows does nothing
// (a Watermill message nacked once is never acked: TestHeldSettlesOnce).
func (e *engine) holdDelivery(msg *message.Message, effective time.Duration, envelope message.Metadata) error {
	if err := e.holder.Backend.(backend.Holder).Settle(msg, effective, envelope); err != nil {
		return err
	}
	msg.Nack()
	return nil
}

// holdUntil holds msg, a copy back before it is due (d.parkedUntil) on a holder
// alone, in its work queue until then: a key's head copy (selfPark), held for the
// queue's delay, and again until due (holdAgain). A failed hold is nacked, paced.
func (e *engine) holdUntil(msg *message.Message, d delivery) error {
	hold := time.Until(d.parkedUntil)
	var md message.Metadata
	if e.holder.caps.CarriesEnvelope {
		md = message.Metadata{}
		d.envelope.Write(md)
		if key, ok := msg.Metadata[keys.OrderHead]; ok {
			md[keys.OrderHead] = key
		}
	}
	err := e.holdDelivery(msg, hold, md)
	if err == nil {
		h := heldRetry{due: time.Now().Add(hold), first: d.envelope.FirstFailure, env: d.envelope}
		if longest := e.holder.caps.Longest; e.holder.caps.PastLongest == backend.HoldAgain && hold > longest {
			h.due, h.until = time.Now().Add(longest), d.parkedUntil
		}
		e.held.add(d.queue, msg.UUID, h)
		return nil
	}
	n := e.failures.add(msg.UUID)
	e.stats.failures.Add(1)
	e.observe(amqpretry.Event{Kind: amqpretry.EventHandoffFailed, Queue: d.queue, Attempt: d.attempt, Err: err, Cause: backend.Cause(err)})
	e.cfg.Logger.Error("Could not hold a retry until it is due, nacking it for redelivery", err, watermill.LogFields{
		"message_uuid": msg.UUID, "queue": d.queue, "attempt": d.attempt, "handoff_failures": n, "due": d.parkedUntil.Format(time.RFC3339Nano)})
	e.pausePaced(msg.Context(), backend.HandoffPause(n))
	return fmt.Errorf("%w: queue %q: hold until %s: %w", amqpretry.ErrHandoff, d.queue, d.parkedUntil.Format(time.RFC3339Nano), err)
}

// holdAgain holds msg in its work queue once more when it is a retry held for a delay
// longer than the queue's and not yet due: it never reaches the handler early. It
// tells whether it did. A retry back long before the queue's delay is not held (the
// queue does not hold retries: observeDelivery reports it).
func (e *engine) holdAgain(msg *message.Message, d delivery) bool {
	if !d.held || d.heldUntil.IsZero() || !d.at.Before(d.heldUntil) || e.holder == nil || e.held.isBroken(d.queue) {
		return false
	}
	hold := e.holder.caps.Longest
	if d.at.Before(d.heldDue.Add(-hold / 2)) {
		return false
	}
	if err := e.holdDelivery(msg, hold, nil); err != nil {
		return false
	}
	e.held.add(d.queue, msg.UUID, heldRetry{due: d.at.Add(hold), until: d.heldUntil, first: d.envelope.FirstFailure, rehelds: d.rehelds + 1, env: d.envelope})
	return true
}

// heldRetries remembers the retries this process left in their work queue, by queue
// and UUID (one message fanned out to several queues of one Retry is held in each),
// with their due time: to measure their lateness when they come back (the broker
// redelivers them unchanged, so nothing on the message says when), and to notice a
// work queue that does not hold them (a retry back long before its due time: the
// queue lacks its delayed-retry settings, and every nack would come back at once).
// It forgets everything when it would track more than maxTracked.
type heldRetries struct {
	mu     sync.Mutex
	due    map[heldKey]heldRetry
	broken map[string]bool // work queues found not to hold retries
	size   atomic.Int64
	// anyBroken tells, without the lock, that broken has a queue: a retry on the way
	// of every message asks it first (isBroken).
	anyBroken atomic.Bool
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

func (h *heldRetries) add(queue, uuid string, r heldRetry) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.due == nil || len(h.due) >= maxTracked {
		h.due = map[heldKey]heldRetry{}
	}
	h.due[heldKey{queue, uuid}] = r
	h.size.Store(int64(len(h.due)))
}

// heldKey is a held retry's work queue and message UUID.
type heldKey struct{ queue, uuid string }

// take returns and forgets what it knows of uuid in queue, if this process held it.
// The engine asks only when size is not zero: a first delivery takes no lock.
func (h *heldRetries) take(queue, uuid string) (heldRetry, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	k := heldKey{queue, uuid}
	due, ok := h.due[k]
	delete(h.due, k)
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
	h.anyBroken.Store(true)
	return true
}

// isBroken tells whether queue was found not to hold retries (markBroken).
func (h *heldRetries) isBroken(queue string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.broken[queue]
}
