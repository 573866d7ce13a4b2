package middleware

import (
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/backend"
)

// Re-parking: a copy parked for a delay longer than the backend keeps comes back
// before it is due and is re-parked for what remains (keys.ParkUntil).

// repark parks msg, a retry back before until, again for what remains: it never
// reaches the handler early. A failed park is nacked for redelivery, paced.
func (e *engine) repark(msg *message.Message, d delivery, until time.Time) error {
	now := time.Now()
	effective, err := e.backend.Effective(until.Sub(now))
	if err == nil {
		cp := copyOf(msg)
		env := d.envelope
		env.EffectiveDelay, env.Due = effective, now.Add(effective)
		env.Write(cp.Metadata)
		if err = e.backend.Park(cp.Context(), d.queue, cp, effective); err == nil {
			return nil
		}
	}
	n := e.failures.add(msg.UUID)
	e.givenBack.add(msg.UUID)
	e.stats.failures.Add(1)
	e.observe(amqpretry.Event{Kind: amqpretry.EventHandoffFailed, Queue: d.queue, Attempt: d.attempt, Err: err, Cause: backend.Cause(err)})
	e.cfg.Logger.Error("Could not park a retry again until it is due, nacking it for redelivery", err, watermill.LogFields{
		"message_uuid": msg.UUID, "queue": d.queue, "attempt": d.attempt, "handoff_failures": n, "due": until.Format(time.RFC3339Nano)})
	e.pausePaced(msg.Context(), backend.HandoffPause(n))
	return fmt.Errorf("%w: queue %q: park again until %s: %w", amqpretry.ErrHandoff, d.queue, until.Format(time.RFC3339Nano), err)
}
