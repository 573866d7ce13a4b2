package middleware

import (
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// EventKind says what an Event reports.
type EventKind int

const (
	// EventDelivered: a message reached the handler. Attempt is its attempt; for a
	// retry, Late is set and Lateness is how long after its due time it arrived.
	EventDelivered EventKind = iota + 1
	// EventSucceeded: the handler returned nil on attempt Attempt.
	EventSucceeded
	// EventRetryScheduled: a retry was handed off and confirmed. Attempt is the attempt
	// that failed; Requested and Effective are the delays; Handoff the time from
	// publish to confirm.
	EventRetryScheduled
	// EventPoisoned: the message went to the poison topic, for Reason, after Attempt.
	// Handoff is the time from publish to confirm.
	EventPoisoned
	// EventHandoffFailed: a hand-off (of a retry, or to the poison topic) failed with
	// Err; the message is nacked for redelivery, or poisoned if
	// HandoffAttempts were reached (an EventPoisoned follows).
	EventHandoffFailed
)

// Event is what RetryConfig.Observe is told. Fields may be added.
type Event struct {
	Kind EventKind
	// Queue is the queue the message came from: one the application subscribes to.
	Queue string
	// Attempt is the attempt the event is about, from 1.
	Attempt int
	// Reason is the poison reason (EventPoisoned).
	Reason string
	// Err is the hand-off's error (EventHandoffFailed) or the handler's (otherwise).
	Err error
	// Requested and Effective are the delay asked for and the delay the backend applies
	// (EventRetryScheduled).
	Requested, Effective time.Duration
	// Handoff is the time a confirmed hand-off took, publish to confirm
	// (EventRetryScheduled, EventPoisoned).
	Handoff time.Duration
	// Late tells that the delivery is a retry with a recorded due time, and Lateness is
	// arrival minus due: negative for a retry that came back early (EventDelivered).
	Late     bool
	Lateness time.Duration
}

// Stats counts what a Retry did since it was built.
type Stats struct {
	Retries        int64 // retries handed off
	Poisoned       int64 // messages poisoned
	HandoffFailure int64 // hand-offs that failed (each nacked or followed by a poisoning)
}

// stats is Stats, updated concurrently.
type stats struct{ retries, poisoned, failures atomic.Int64 }

func (s *stats) snapshot() Stats {
	return Stats{Retries: s.retries.Load(), Poisoned: s.poisoned.Load(), HandoffFailure: s.failures.Load()}
}

// Stats returns what this Retry did since it was built.
func (r *Retry) Stats() Stats { return r.stats.snapshot() }

// observe sends e to RetryConfig.Observe, if set.
func (r *Retry) observe(e Event) {
	if r.cfg.Observe != nil {
		r.cfg.Observe(e)
	}
}

// observeDelivery reports a delivery, with its lateness when it is a retry.
func (r *Retry) observeDelivery(msg *message.Message, queue string) {
	e := Event{Kind: EventDelivered, Queue: queue, Attempt: Attempt(msg)}
	if due := msg.Metadata.Get(DueKey); due != "" && e.Attempt > 1 {
		if t, err := time.Parse(time.RFC3339Nano, due); err == nil {
			e.Late, e.Lateness = true, time.Since(t)
		}
	}
	r.observe(e)
}

// sampled tells whether the n-th scheduled retry is logged: every one for
// RetryLogEvery 0 or 1, none below 0, one in RetryLogEvery otherwise.
func (r *Retry) sampled(n int64) bool {
	every := int64(r.cfg.RetryLogEvery)
	switch {
	case every < 0:
		return false
	case every <= 1:
		return true
	}
	return n%every == 1
}
