package middleware

// The engine: the middleware's handler closure. It reads a delivery once, on receipt
// (receipt.go), runs the handler, with Policy.Immediate's retries in this process, and
// hands a failure to the failure path (copy.go: decide, size, stamp, park; or hold,
// hold.go), while the engine is open (lifecycle.go). A message seen before (a retry
// back before it is due, one whose poisoning is pending) is dealt with before the
// handler runs (hold.go, repark.go, poison.go).

import (
	"context"
	"errors"
	"strconv"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/marshal"
)

// engine is the middleware. start builds it.
type engine struct {
	cfg     amqpretry.Config // with defaults
	backend *kept            // parks copies: nil when a holder takes every retry
	holder  *kept            // holds retries (backend.Holder): the first HeldRetries, or every one; nil for none
	poisonQ func(ctx context.Context, msg *message.Message) error
	wiring  wiring

	failures failureCounts
	held     heldRetries
	stats    struct{ retries, poisoned, failures atomic.Int64 }

	life    lifecycle
	pending pendingPoisons // messages whose poison publish failed
	// poisonHint adds the fix to a failed poison publish's error (gone: the poison
	// queue does not exist). Nil: none.
	poisonHint func(err error, gone bool) error
}

// kept is a backend as the engine uses it: with what it can do, and its name for
// events and logs, both read once at start.
type kept struct {
	backend.Backend
	caps backend.Caps
	name delay.Backend
}

// keep reads b's caps and name once; nil for none.
func keep(b backend.Backend) *kept {
	if b == nil {
		return nil
	}
	return &kept{Backend: b, caps: b.Caps(), name: delay.Backend(b.Name())}
}

// Middleware implements message.HandlerMiddleware.
func (e *engine) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		d := e.read(msg)
		if d.owned {
			if d.held && e.holdAgain(msg, d) {
				return nil, nil
			}
			if e.backend != nil && d.at.Before(d.parkedUntil) {
				// Parked for a delay longer than the backend keeps: not due yet.
				if !e.life.begin() {
					return nil, e.refuseClosed(msg, d, nil)
				}
				defer e.life.end()
				return nil, e.repark(msg, d, d.parkedUntil)
			}
			if e.pending.size.Load() > 0 {
				if pp, ok := e.pending.get(msg); ok {
					// It failed for good already: only its poison publish is retried.
					if !e.life.begin() {
						return nil, e.refuseClosed(msg, d, nil)
					}
					defer e.life.end()
					return nil, e.repoison(msg, d, pp)
				}
			}
			if e.cfg.Observe != nil || d.backEarly {
				e.observeDelivery(d)
			}
		}
		produced, err := h(msg)
		run, attempt := msg, d.attempt
		var decided *amqpretry.Decision // err's, when retryNow classified it
		for err != nil && attempt <= e.cfg.Policy.Immediate {
			var again bool
			if again, decided = e.retryNow(d, run, attempt, err); !again {
				break
			}
			pause(msg.Context(), e.cfg.Policy.ImmediateInterval)
			next := run.Copy()
			next.SetContext(marshal.CopyContext(run)) // typed headers as read
			attempt++
			next.Metadata[keys.Attempt] = strconv.Itoa(attempt)
			run = next
			produced, err = h(run)
			decided = nil // a new error, not classified yet
		}
		if err == nil {
			e.failures.forget(msg.UUID)
			if d.owned {
				e.observe(amqpretry.Event{Kind: amqpretry.EventSucceeded, Queue: d.queue, Attempt: attempt})
			}
			return produced, nil
		}
		d.attempt = attempt
		if errors.Is(err, amqpretry.ErrHandoff) {
			return nil, err // a Retry nearer the handler has dealt with it
		}
		if !e.life.begin() {
			return nil, e.refuseClosed(msg, d, err)
		}
		defer e.life.end()
		return nil, e.fail(msg, run, d, err, decided)
	}
}

// retryNow tells whether run, which failed with err on attempt (within
// Policy.Immediate), gets an immediate in-process retry: on its first delivery, within
// MaxAttempts, if it is this Retry's and its error asks for no delay and is not
// permanent. It returns the decision when it classified err, so that Classify runs
// once per failure.
func (e *engine) retryNow(d delivery, run *message.Message, attempt int, err error) (bool, *amqpretry.Decision) {
	if attempt >= e.cfg.Policy.MaxAttempts || !d.owned || errors.Is(err, amqpretry.ErrHandoff) {
		return false, nil
	}
	dec := e.decide(run, err, attempt)
	return !dec.Permanent && dec.Delay <= 0, &dec
}

// Retryable tells whether running the handler again in this process could help after
// err, as this Retry would decide: not for a failed hand-off, nor when the error's
// decision poisons it or asks for a delay. Classify is asked with no message.
func (e *engine) Retryable(err error) bool {
	if err == nil || errors.Is(err, amqpretry.ErrHandoff) {
		return false
	}
	dec := e.decide(nil, err, 0)
	return !dec.Permanent && dec.Delay <= 0
}
