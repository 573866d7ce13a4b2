package amqpretry

import (
	"time"
)

// EventKind says what an Event reports.
type EventKind int

const (
	// EventDelivered: a message reached the handler. For a retry whose due time is
	// known, Late is set and Lateness is how long after its due time it arrived.
	EventDelivered EventKind = iota + 1
	// EventSucceeded: the handler returned nil on attempt Attempt.
	EventSucceeded
	// EventRetryScheduled: a retry was handed to Backend and confirmed (for a backend
	// that keeps the failed delivery in its work queue, the delivery was settled for
	// the broker to hold). Attempt is the attempt that failed; Requested and Effective
	// are the delays; Handoff the time from publish to confirm.
	EventRetryScheduled
	// EventPoisoned: the message went to the poison queue, for Reason, after Attempt.
	// Handoff is the time from publish to confirm.
	EventPoisoned
	// EventHandoffFailed: a hand-off (of a retry, or to the poison queue) failed with
	// Err, for Cause; the message is nacked for redelivery, or poisoned if
	// the hand-off limit (5 failures in a row) was reached (an EventPoisoned follows).
	EventHandoffFailed
	// EventOutageStarted: the handlers of Queue are judged to fail because something
	// they depend on is down (Config.Outage); Err is the failure that began it. Its
	// messages wait, spending no attempt, until a probe succeeds.
	EventOutageStarted
	// EventProbe: a message of Queue ran as an outage's probe; Err is its failure,
	// nil when it succeeded (an EventOutageEnded follows).
	EventProbe
	// EventOutageEnded: a probe of Queue succeeded after Duration in outage; Err is
	// the last failure of the outage.
	EventOutageEnded
	// EventKeyBlocked: the message of Key failed and its retry was scheduled (or,
	// with Config.BlockOnPoison, it was poisoned): Key's later messages in Queue wait
	// behind it, on the broker, in order (Config.OrderKey).
	EventKeyBlocked
	// EventKeyReleased: the messages behind Key ran, in order, and Key is no longer
	// blocked; Duration is how long it was, where this process knows it.
	EventKeyReleased
)

// Event is what Config.Observe is told, on the handler's goroutine. Fields
// may be added. The middleware produces it; it is declared here because Config.Observe
// takes it (the middleware imports this package, not the other way round).
type Event struct {
	Kind EventKind
	// Queue is the queue the message came from: one the application subscribes to.
	Queue string
	// Backend is the name of the delay backend the event is about (for a retry, the
	// one that took it: "delayed-retry" for a retry held in the work queue).
	Backend string
	// Attempt is the attempt the event is about, from 1.
	Attempt int
	// Reason is the poison reason (EventPoisoned, and EventHandoffFailed for a failed
	// poison publish).
	Reason Reason
	// Err is the hand-off's error (EventHandoffFailed) or the handler's (otherwise).
	Err error
	// Cause names why a hand-off failed (EventHandoffFailed): returned, nacked,
	// timeout, connection, too-large, not-wired, poison-queue-missing (a poison
	// publish returned unroutable: the poison queue does not exist; Stats.PoisonPending
	// counts the messages waiting for it) or other.
	Cause string
	// Requested and Effective are the delay asked for and the delay the backend
	// applies (EventRetryScheduled).
	Requested, Effective time.Duration
	// Handoff is the time a confirmed hand-off took, publish to confirm
	// (EventRetryScheduled, EventPoisoned).
	Handoff time.Duration
	// Late tells that the delivery is a retry with a known due time, and Lateness is
	// arrival minus due: negative for a retry that came back early (EventDelivered).
	Late     bool
	Lateness time.Duration
	// Duration is how long the outage lasted (EventOutageEnded), or the key was
	// blocked (EventKeyReleased).
	Duration time.Duration
	// Key is the order key (Config.OrderKey) of EventKeyBlocked and EventKeyReleased.
	Key string
}

// Reason says why a message was poisoned. Declared here, beside Event, which
// carries it.
type Reason string

// Values of Reason.
const (
	// ReasonPermanent: the handler's error was marked Permanent (or
	// Classify decided so).
	ReasonPermanent Reason = "permanent"
	// ReasonMaxAttempts: the last attempt the policy allows failed.
	ReasonMaxAttempts Reason = "max-attempts"
	// ReasonDelayTooLong: the backend cannot keep the delay asked for (a RetryAfter
	// longer than its longest delay).
	ReasonDelayTooLong Reason = "delay-too-long"
	// ReasonHandoffFailed: 5 hand-offs of the message failed in a
	// row (Error has the last hand-off error and the handler's), or the message could
	// not be handed off at all, Error saying why (ErrNotWired; a work queue that does
	// not hold delayed retries).
	ReasonHandoffFailed Reason = "handoff-failed"
	// ReasonTooLarge: the retry copy, even with a trimmed envelope, is larger than the
	// broker's frame_max (see DroppedHeaders).
	ReasonTooLarge Reason = "too-large"
	// ReasonDeliveryLimit is no decision of the library's, and in no Event: the broker
	// dead-lettered the message from its quorum work queue to the poison queue once
	// x-delivery-limit deliveries had failed (x-death reason delivery_limit; the
	// arguments in docs/troubleshooting.md). The poison queue's readers (package ops,
	// the amqpretry command) report it. A message no client can read gets there
	// (amqp091-go v1.16.0 and later close the connection at a header nested deeper
	// than 32), as does one whose hand-offs kept failing on RabbitMQ before 4.3.
	ReasonDeliveryLimit Reason = "delivery-limit"
)
