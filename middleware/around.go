package middleware

// What the Retry sees of the middlewares around it (issue 49's matrix,
// docs/watermill-middlewares.md). Watermill's router does not list a handler's
// middlewares; the Retry sees what they do to a delivery, and says once what cannot
// work:
//
//   - a message acked before the Retry ran, or while the handler ran (Watermill's
//     InstantAck, outside or inside): a failed hand-off can no longer give it back, so
//     it is poisoned at once (handoffFailed), and a message in flight when the process
//     stops is lost;
//   - a failure of the handler added through AddHandler that a middleware inside turned
//     into a success, with Watermill's PoisonQueue metadata on the message: PoisonQueue
//     inside takes every failure, so nothing is retried;
//   - the handler run again after an error marked Permanent or RetryAfter, in one
//     delivery (Watermill's Retry inside, where Policy.Immediate would not).
//
// And a delivery run through the Retry again after it handed it off or poisoned it
// (Watermill's Duplicator outside) does nothing the second time (chainSettled).

import (
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
)

// around is what the engine saw of the middlewares around it.
type around struct {
	// early: a message was acked before the engine ran: a retry acked before it
	// reached the engine may be on its way still (sweep tells only at Close).
	early                                      atomic.Bool
	saidBefore, saidInside, saidPoison, saidRe atomic.Bool
}

// acked tells whether msg was acked.
func acked(msg *message.Message) bool {
	select {
	case <-msg.Acked():
		return true
	default:
		return false
	}
}

// reasonPoisoned is the metadata key Watermill's PoisonQueue sets on a message it
// takes (its ReasonForPoisonedKey; not imported: that package would bring its
// dependencies to every program).
const reasonPoisoned = "reason_poisoned"

// errAckedEarly is wrapped by the error logged when a message was acked before the
// Retry could settle it.
var errAckedEarly = errors.New("message acked before the Retry settled it")

// ackedBefore says, once, that d's message was acked before the engine ran.
func (e *engine) ackedBefore(d delivery) {
	e.around.early.Store(true)
	if e.around.saidBefore.CompareAndSwap(false, true) {
		e.sayAcked(d, "outside the Retry (a router middleware, or a handler middleware added before it)")
	}
}

// ackedInside says, once, that d's message was acked while the handler ran.
func (e *engine) ackedInside(d delivery) {
	if e.around.saidInside.CompareAndSwap(false, true) {
		e.sayAcked(d, "inside the Retry (a handler middleware added after it)")
	}
}

func (e *engine) sayAcked(d delivery, where string) {
	e.cfg.Logger.Error("A middleware acked the message before the Retry could settle it: Watermill's InstantAck does. A message whose hand-off fails is poisoned at once, since it can no longer be given back to the broker, and one in flight when the process stops is lost",
		fmt.Errorf("message %s, handler %q: remove InstantAck: the Retry acks a failed message once its retry is confirmed, so nothing is lost: %w", d.msg.UUID, d.handler, errAckedEarly),
		watermill.LogFields{"message_uuid": d.msg.UUID, "handler": d.handler, "queue": d.queue, "middleware": where, "said": "once"})
}

// HandlerFailed is called by the handler a transport's AddHandler adds when it
// returns err (ExpectHandler, HandlerRan: engine.go).
func (c *chain) HandlerFailed(err error) {
	if dec := amqpretry.DecisionOf(err); dec.Permanent || dec.Delay > 0 {
		c.set(chainFailed | chainNoRerun)
		return
	}
	c.flags.And(^chainNoRerun)
	c.set(chainFailed)
}

// swallowed is called when d's handler failed and the middlewares between it and the
// engine returned success: Watermill's IgnoreErrors does that for the errors it is
// given (as it should), its PoisonQueue for every failure, which it publishes to a
// topic of its own: said once.
func (e *engine) swallowed(d delivery) {
	if _, ok := d.msg.Metadata[reasonPoisoned]; !ok || !e.around.saidPoison.CompareAndSwap(false, true) {
		return
	}
	e.cfg.Logger.Error("Watermill's PoisonQueue, inside the Retry, took a failed message to its own topic and returned success: the Retry never sees those failures, so none is retried",
		fmt.Errorf("message %s, handler %q: add PoisonQueue outside the Retry (a router middleware added before AddHandler), where it sees only failed hand-offs, or remove it: the Retry poisons a message to %q after its last attempt", d.msg.UUID, d.handler, e.cfg.PoisonQueue),
		watermill.LogFields{"message_uuid": d.msg.UUID, "handler": d.handler, "queue": d.queue, "middleware": "inside the Retry (a handler middleware added after it)", "said": "once"})
}

// rerun says, once, that d's handler ran again in one delivery after an error marked
// Permanent or RetryAfter, and failed with err.
func (e *engine) rerun(d delivery, err error) {
	if !e.around.saidRe.CompareAndSwap(false, true) {
		return
	}
	warn(e.cfg.Logger, "A middleware inside the Retry ran the handler again after an error marked Permanent or RetryAfter: Watermill's Retry does, without ShouldRetry",
		fmt.Errorf("message %s, handler %q, last error %v: remove Watermill's Retry and set Policy.Immediate, which retries in this process only what this Retry would retry at once", d.msg.UUID, d.handler, err),
		watermill.LogFields{"message_uuid": d.msg.UUID, "handler": d.handler, "queue": d.queue, "middleware": "inside the Retry (a handler middleware added after it)", "said": "once"})
}
