package middleware

// The engine: on a handler error it decides what becomes of the message, sizes the
// delay with the backend, stamps the failure envelope on a copy and hands the copy off
// (or, for a backend that keeps the failed delivery, settles it for the broker to
// hold), in that order and in one pass.

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/keys"
)

// engine is the middleware. start builds it.
type engine struct {
	cfg     amqpretry.Config // with defaults
	backend *kept            // copies: nil for delayed-retry alone
	holder  *kept            // holds retries (backend.Holder): the first HeldRetries, or every one; nil for none
	poisonQ func(ctx context.Context, msg *message.Message) error
	wiring  wiring

	failures failureCounts
	held     heldRetries
	stats    struct{ retries, poisoned, failures counter }

	life    lifecycle
	pending pendingPoisons // messages whose poison publish failed
	// poisonHint adds the fix to a failed poison publish's error (gone: the poison
	// queue does not exist). Nil: none.
	poisonHint func(err error, gone bool) error
}

// kept is a backend as the engine uses it: with what it can do and its name, read once
// at start.
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
		if e.wiring.ID != "" {
			joinChain(msg, e.wiring.ID)
		}
		d := e.read(msg)
		if d.owned {
			if d.held && e.holdAgain(msg, d) {
				return nil, nil
			}
			if e.backend != nil && d.at.Before(d.parkedUntil) {
				// Parked for a delay longer than the backend holds: not due yet.
				if !e.life.begin() {
					return nil, e.refuseClosed(msg, d, nil)
				}
				defer e.life.end()
				return nil, e.repark(msg, d, d.parkedUntil)
			}
			if pp, ok := e.pending.get(msg); ok {
				// It failed for good already: only its poison publish is retried.
				if !e.life.begin() {
					return nil, e.refuseClosed(msg, d, nil)
				}
				defer e.life.end()
				return nil, e.repoison(msg, d, pp)
			}
			e.observeDelivery(d)
		}
		produced, err := h(msg)
		run, attempt := msg, d.attempt
		var decided *amqpretry.Decision // err's, when retryNow classified it
		for err != nil {
			var again bool
			if again, decided = e.retryNow(d, run, attempt, err); !again {
				break
			}
			pause(msg.Context(), e.cfg.Policy.ImmediateInterval)
			next := run.Copy()
			next.SetContext(run.Context())
			attempt++
			next.Metadata[keys.Attempt] = strconv.Itoa(attempt)
			run = next
			produced, err = h(run)
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

// delivery is what the engine reads of a message once, when it arrives.
type delivery struct {
	msg      *message.Message
	owned    bool
	owner    string
	attempt  int
	envelope Envelope
	handler  string
	topic    string
	queue    string
	exchange string // the delivery's own
	key      string
	at       time.Time
	// held tells that this process held the retry this delivery is, in the work
	// queue, due at heldDue.
	held    bool
	heldDue time.Time
	// heldUntil is when a retry held again and again (a delay longer than the
	// queue's) is due; zero for one hold.
	heldUntil time.Time
	rehelds   int // times it was held again
	// backEarly tells that this held retry came back long before it was due (more
	// than half the queue's delay), early how many times in a row it did before.
	backEarly bool
	early     int
	// parkedUntil is when a copy parked for longer than the backend keeps is due
	// (keys.ParkUntil); zero for any other.
	parkedUntil time.Time
}

func (e *engine) read(msg *message.Message) delivery {
	ctx := msg.Context()
	d := delivery{
		msg:      msg,
		owner:    msg.Metadata[keys.Subscriber],
		envelope: ReadEnvelope(msg.Metadata),
		handler:  message.HandlerNameFromCtx(ctx),
		topic:    message.SubscribeTopicFromCtx(ctx),
		exchange: msg.Metadata[keys.DeliveryExchange],
		key:      msg.Metadata[keys.DeliveryRoutingKey],
		at:       time.Now(),
	}
	d.owned = e.wiring.ID == "" || d.owner == e.wiring.ID
	d.queue = e.wiring.Queue(d.topic)
	if v, ok := msg.Metadata[keys.ParkUntil]; ok {
		d.parkedUntil, _ = time.Parse(time.RFC3339Nano, v) // zero when unreadable
	}
	remembered := false // the envelope is the one kept when it was held
	var h heldRetry
	ok := false
	if e.holder != nil { // only a backend that keeps the delivery leaves held retries
		h, ok = e.held.take(msg.UUID)
	}
	if ok && d.owned {
		// A retry held in the work queue comes back without its envelope.
		d.held, d.heldDue, d.heldUntil, d.rehelds, d.early = true, h.due, h.until, h.rehelds, h.early
		d.backEarly = e.holder != nil && e.holder.caps.Delays == backend.ConstantDelay && d.at.Sub(h.due) < -e.holder.caps.Longest/2
		if !h.env.FirstFailure.IsZero() {
			// What a copy would have carried: the handler reads it as on a copy.
			d.envelope, remembered = h.env, true
			h.env.Write(msg.Metadata)
		}
		if d.envelope.FirstFailure.IsZero() {
			d.envelope.FirstFailure = h.first
		}
	}
	d.attempt = max(d.envelope.Attempt, 1)
	if d.rehelds > 0 && !remembered {
		// The broker counted each time it was held again as a return: not attempts.
		d.attempt = max(d.attempt-d.rehelds, 1)
		msg.Metadata[keys.Attempt] = strconv.Itoa(d.attempt)
	}
	if d.held && d.attempt < h.env.Attempt {
		// Never fewer than this process counted when it held it (a queue that does not
		// hold retries has no x-acquired-count to count it from).
		d.attempt = h.env.Attempt
		msg.Metadata[keys.Attempt] = strconv.Itoa(d.attempt)
	}
	return d
}

// retryNow tells whether run, which failed with err on attempt, gets an immediate
// in-process retry: on its first delivery, within Policy.Immediate and MaxAttempts,
// if it is this Retry's and its error asks for no delay and is not permanent. It
// returns the decision when it classified err, so that Classify runs once per failure.
func (e *engine) retryNow(d delivery, run *message.Message, attempt int, err error) (bool, *amqpretry.Decision) {
	p := e.cfg.Policy
	if attempt > p.Immediate || attempt >= p.MaxAttempts || !d.owned || errors.Is(err, amqpretry.ErrHandoff) {
		return false, nil
	}
	dec := e.decide(run, err, attempt)
	return !dec.Permanent && dec.Delay <= 0, &dec
}

// decide classifies err: the error's marks, then Classify if set.
func (e *engine) decide(msg *message.Message, err error, attempt int) amqpretry.Decision {
	p := amqpretry.ClassifyParams{Err: err, Message: msg, Attempt: attempt, Default: amqpretry.DecisionOf(err)}
	if e.cfg.Classify == nil {
		return p.Default
	}
	return e.cfg.Classify(p)
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

// fail decides what becomes of msg after run (msg or an immediate retry's copy of it)
// failed with err, sizes the delay with the backend, stamps the copy and hands it off.
func (e *engine) fail(msg, run *message.Message, d delivery, err error, decided *amqpretry.Decision) error {
	if errors.Is(err, amqpretry.ErrHandoff) {
		return err // a Retry nearer the handler has dealt with it
	}
	werr := e.checkWiring(d)
	if errors.Is(werr, errOtherRetry) {
		return err // that Retry, also on this handler, decides
	}
	if decided == nil {
		dec := e.decide(run, err, d.attempt)
		decided = &dec
	}
	f := failure{delivery: d, err: err, maxAttempts: e.cfg.Policy.MaxAttempts}
	f.envelope = e.envelope(d, err)

	// The copy (copyOf) is made where a way out publishes one: never for a held retry.
	switch {
	case werr != nil:
		return e.handoffFailed(f, copyOf(run), werr, "not-wired", true)
	case decided.Permanent:
		return e.poison(f, copyOf(run), amqpretry.ReasonPermanent)
	case d.attempt >= e.cfg.Policy.MaxAttempts:
		return e.poison(f, copyOf(run), amqpretry.ReasonMaxAttempts)
	case d.queue == "":
		return errors.Join(err, fmt.Errorf("%w: no subscribed topic in the message context (is the middleware on a router handler?)", amqpretry.ErrHandoff))
	}
	target, held := e.backend, e.holdsRetry(d, *decided)
	switch {
	case held:
		target = e.holder
	case e.backend == nil && e.held.isBroken(d.queue):
		f.envelope.Error = fmt.Sprintf("work queue %q does not hold delayed retries (a nacked message came back at once), and no copying backend is configured; handler error: %v", d.queue, err)
		return e.poison(f, copyOf(run), amqpretry.ReasonHandoffFailed)
	case e.backend == nil: // a holder alone, asked for a delay of its own
		target, held = e.holder, true
	}

	// Size.
	caps := target.caps
	requested := decided.Delay
	switch {
	case requested > 0:
	case caps.Delays == backend.ConstantDelay:
		requested = caps.Longest // its one delay is the one asked for: no schedule to follow
	default:
		requested = delayOf(e.cfg.Policy, d.attempt-min(e.stages(), d.attempt-1))
	}
	effective, serr := target.Effective(requested)
	if serr != nil {
		// Handing it off would be refused: poison it, saying why.
		f.envelope.Error = serr.Error() + "; handler error: " + err.Error()
		return e.poison(f, copyOf(run), amqpretry.ReasonDelayTooLong)
	}
	var holdUntil time.Time
	switch {
	case requested > effective && caps.PastLongest == backend.Repark && decided.Delay > 0:
		// A delay of the error's own (a server's Retry-After) is never cut short: the
		// copy is parked again when it comes back, until it is due.
		holdUntil = time.Now().Add(requested)
		notice(e.cfg.Logger, "Delay asked for is longer than the longest tier: the retry is parked again until it is due",
			f.log().Add(watermill.LogFields{"requested_delay": requested.String(), "effective_delay": effective.String()}))
	case requested > effective && caps.PastLongest == backend.Repark:
		e.cfg.Logger.Error("Delay longer than the longest tier, using the longest: the retry comes back early", delay.ErrDelayTooLong,
			f.log().Add(watermill.LogFields{"requested_delay": requested.String(), "effective_delay": effective.String()}))
	}
	if held {
		if caps.PastLongest == backend.HoldAgain && decided.Delay > effective {
			// The queue holds a retry for one delay: held again until it is due, never
			// back before the delay asked for (a server's Retry-After).
			holds := (requested + effective - 1) / effective
			notice(e.cfg.Logger, "Delay asked for is longer than the work queue's delayed-retry delay: the retry is held again until it is due", f.log().Add(watermill.LogFields{
				"requested_delay": requested.String(), "effective_delay": (holds * effective).String(), "holds": int64(holds)}))
			effective = holds * effective
		}
		return e.settle(msg, f, requested, effective)
	}

	// Stamp and hand off.
	cp := copyOf(run)
	start := time.Now()
	f.envelope.Attempt = d.attempt + 1
	f.envelope.RequestedDelay, f.envelope.EffectiveDelay, f.envelope.Due = requested, effective, start.Add(effective)
	f.envelope.Write(cp.Metadata)
	delete(cp.Metadata, keys.ParkUntil)
	if !holdUntil.IsZero() {
		cp.Metadata[keys.ParkUntil] = holdUntil.UTC().Format(time.RFC3339Nano)
	}
	perr := e.backend.Park(handoffContext(cp), d.queue, cp, effective)
	if errors.Is(perr, backend.ErrTooLarge) {
		trim(&f.envelope)
		f.envelope.Write(cp.Metadata)
		perr = e.backend.Park(handoffContext(cp), d.queue, cp, effective)
	}
	switch {
	case perr == nil:
		e.failures.forget(msg.UUID)
		n := e.stats.retries.add()
		e.observe(amqpretry.Event{Kind: amqpretry.EventRetryScheduled, Queue: d.queue, Backend: e.backend.name, Attempt: d.attempt, Err: err,
			Requested: requested, Effective: effective, Handoff: time.Since(start)})
		if e.sampled(n) {
			e.cfg.Logger.Info("Retry scheduled", f.log().Add(watermill.LogFields{"requested_delay": requested.String(), "effective_delay": effective.String()}))
		}
		return nil
	case errors.Is(perr, backend.ErrTooLarge):
		// Handing it off again would be refused again: poison it, saying why.
		f.log()["handoff_err"] = perr.Error()
		f.envelope.Error = "retry copy larger than the broker's frame_max even with a trimmed envelope; handler error: " + err.Error()
		return e.poison(f, cp, amqpretry.ReasonTooLarge)
	}
	return e.handoffFailed(f, cp, perr, backend.Cause(perr), true)
}

// stages is how many retries come before the copying backend's schedule: the
// immediate ones, or those held in the work queue.
func (e *engine) stages() int { return e.cfg.Policy.Immediate + e.cfg.HeldRetries }

// holdsRetry tells whether the retry after d's failed attempt is held in the work
// queue. A holder of any delay (delivery-time) holds every retry;
// one with a constant delay, the queue's (delayed-retry), holds every retry when it is
// alone, else the first HeldRetries, and neither when the queue was found not to hold
// them or the error asks for a delay of its own (the copying backend can keep it).
func (e *engine) holdsRetry(d delivery, dec amqpretry.Decision) bool {
	switch {
	case e.holder == nil:
		return false
	case e.holder.caps.Delays != backend.ConstantDelay:
		return true
	case e.held.isBroken(d.queue):
		return false
	}
	return dec.Delay <= 0 && (e.backend == nil || d.attempt <= e.cfg.HeldRetries)
}
