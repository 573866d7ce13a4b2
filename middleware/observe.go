package middleware

import (
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/amqpretry/amqpretry"
)

// Observation: Stats, and the Events told to Config.Observe.

// Stats returns what the engine did since it was built.
func (e *engine) Stats() Stats {
	st := Stats{Retries: e.stats.retries.Load(), Poisoned: e.stats.poisoned.Load(), HandoffFailures: e.stats.failures.Load(),
		PoisonPending: e.pending.len()}
	if e.dedup != nil {
		st.Duplicates = e.dedup.duplicates.Load()
	}
	if e.outages != nil {
		st.Outages, st.Probes, st.InOutage = e.outages.started.Load(), e.outages.probes.Load(), e.outages.inOutage()
	}
	if e.order != nil {
		st.BlockedKeys, st.Behind, st.LongestBlocked = e.order.stats()
	}
	return st
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
		case e.holder != nil && (d.held || e.backend == nil || d.envelope.EffectiveDelay == 0):
			ev.Backend = e.holder.name // held in the work queue
		case e.backend != nil:
			ev.Backend = e.backend.name
		}
	}
	// Back long before it was due: its nack may have been lost with its connection (the
	// broker then gives the delivery back at once), so the queue is judged by a second
	// early return of the same message in a row, which a queue that holds retries does
	// not give.
	if d.backEarly && d.early > 0 && e.held.markBroken(d.queue) {
		e.cfg.Logger.Error("Work queue does not hold delayed retries: a nacked message came back at once; its retries now go to the copying backend, or are poisoned without one",
			fmt.Errorf("queue %q: back %s after the nack, expected %s: a quorum queue needs x-delayed-retry-type=returned and x-delayed-retry-min/-max (declare it with them, or apply a delayed-retry policy to it, RabbitMQ 4.3+); a classic queue cannot hold delayed retries (`amqpretry topology verify` tells its type): move to a new quorum queue, or use a copying Backend", d.queue, (e.holder.caps.Longest+ev.Lateness).Round(time.Millisecond), e.holder.caps.Longest),
			watermill.LogFields{"queue": d.queue, "message_uuid": d.msg.UUID})
	}
	e.observe(ev)
}
