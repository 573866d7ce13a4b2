// Package retry is the retry middleware: on a handler error it decides what becomes of
// the message, sizes the delay with the backend, stamps the failure envelope on a copy
// and hands the copy off (or, for an in-place backend, settles the delivery for the
// broker to hold), in that order and in one pass. The transport packages (wamqp2,
// wamqp3, amqp1) wire it to their subscriber.
package middleware

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v4"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/keys"
)

// wiring is what the engine needs to know of the subscriber side.
type wiring struct {
	// ID identifies the Retry; its subscriber's marshaler stamps it on every delivery
	// (keys.Subscriber). "" means every message is this Retry's (in-process).
	ID string
	// Queue maps the topic a handler subscribes to onto the queue its messages come
	// from, where a retry must come back. Default: the topic.
	Queue func(topic string) string
	// Bound tells whether a queue's way back was declared by this Retry's subscriber.
	// Nil: not checked.
	Bound func(queue string) bool
	// Attempt reads the attempt of a delivery. Default: keys.Attempt of its metadata.
	Attempt func(msg *message.Message) int
}

// engine is the middleware. Build it with newEngine (Start does).
type engine struct {
	cfg     amqpretry.Config // with defaults
	backend backend.Backend  // copies: nil for delayed-retry alone
	inPlace backend.Backend  // retries held in place (backend.InPlace): the first ones, or every one; nil for none
	// caps and inPlaceCaps are what backend and inPlace can do, read once at start.
	caps, inPlaceCaps backend.Caps
	poisonQ           func(ctx context.Context, msg *message.Message) error
	wiring            wiring

	failures failureCounts
	held     heldRetries
	stats    struct{ retries, poisoned, failures counter }

	life    lifecycle
	pending pendingPoisons // messages whose poison publish failed
	// poisonHint adds the fix to a failed poison publish's error (gone: the poison
	// queue does not exist). Nil: none.
	poisonHint func(err error, gone bool) error
}

// Middleware implements message.HandlerMiddleware.
func (e *engine) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		if e.wiring.ID != "" {
			joinChain(msg, e.wiring.ID)
		}
		d := e.read(msg)
		if d.owned {
			if e.holdAgain(msg, d) {
				return nil, nil
			}
			if until, ok := holdUntilOf(msg); ok && e.backend != nil && d.at.Before(until) {
				// Parked for a delay longer than the backend holds: not due yet.
				if !e.life.begin() {
					return nil, e.refuseClosed(msg, d, nil)
				}
				defer e.life.end()
				return nil, e.parkAgain(msg, d, until)
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
	remembered := false // the envelope is the one kept when it was held
	h, ok := e.held.take(msg.UUID)
	if ok && d.owned {
		// A retry held in the work queue comes back without its envelope.
		d.held, d.heldDue, d.heldUntil, d.rehelds, d.early = true, h.due, h.until, h.rehelds, h.early
		d.backEarly = e.inPlace != nil && e.inPlaceCaps.Delays == backend.ConstantDelay && d.at.Sub(h.due) < -e.inPlaceCaps.Longest/2
		if !h.env.FirstFailure.IsZero() {
			// What a copy would have carried: the handler reads it as on a copy.
			d.envelope, remembered = h.env, true
			h.env.Write(msg.Metadata)
		}
		if d.envelope.FirstFailure.IsZero() {
			d.envelope.FirstFailure = h.first
		}
	}
	if e.wiring.Attempt != nil {
		d.attempt = e.wiring.Attempt(msg)
	} else {
		d.attempt = max(d.envelope.Attempt, 1)
	}
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
	f := failure{delivery: d, err: err, fields: watermill.LogFields{
		"message_uuid": msg.UUID, "handler": d.handler, "topic": d.topic, "queue": d.queue,
		"attempt": d.attempt, "max_attempts": e.cfg.Policy.MaxAttempts, "err": err.Error(),
	}}
	f.envelope = e.envelope(d, err)

	// The copy (copyOf) is made where a way out publishes one: never for a retry held
	// in place.
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
	target, inPlace := e.backend, e.holdsInPlace(d, *decided)
	switch {
	case inPlace:
		target = e.inPlace
	case e.backend == nil && e.held.isBroken(d.queue):
		f.envelope.Error = fmt.Sprintf("work queue %q does not hold delayed retries (a nacked message came back at once), and no copying backend is configured; handler error: %v", d.queue, err)
		return e.poison(f, copyOf(run), amqpretry.ReasonHandoffFailed)
	case e.backend == nil: // delayed-retry alone, asked for a delay of its own
		target, inPlace = e.inPlace, true
	}

	// Size.
	requested := decided.Delay
	if requested <= 0 {
		requested = delayOf(e.cfg.Policy, d.attempt-min(e.stages(), d.attempt-1))
	}
	effective, serr := target.Effective(requested)
	if serr != nil {
		// Handing it off would be refused: poison it, saying why.
		f.envelope.Error = serr.Error() + "; handler error: " + err.Error()
		return e.poison(f, copyOf(run), amqpretry.ReasonDelayTooLong)
	}
	var holdUntil time.Time
	caps := e.caps
	if inPlace {
		caps = e.inPlaceCaps
	}
	switch {
	case requested > effective && caps.PastLongest == backend.ParkAgain && decided.Delay > 0:
		// A delay of the error's own (a server's Retry-After) is never cut short: the
		// copy is parked again when it comes back, until it is due.
		holdUntil = time.Now().Add(requested)
		notice(e.cfg.Logger, "Delay asked for is longer than the longest tier: the retry is parked again until it is due",
			f.fields.Add(watermill.LogFields{"requested_delay": requested.String(), "effective_delay": effective.String()}))
	case requested > effective && caps.PastLongest == backend.ParkAgain:
		e.cfg.Logger.Error("Delay longer than the longest tier, using the longest: the retry comes back early", delay.ErrDelayTooLong,
			f.fields.Add(watermill.LogFields{"requested_delay": requested.String(), "effective_delay": effective.String()}))
	}
	if inPlace {
		if caps.PastLongest == backend.HoldAgain && decided.Delay > effective {
			// The queue holds a retry for one delay: held again until it is due, never
			// back before the delay asked for (a server's Retry-After).
			holds := (requested + effective - 1) / effective
			notice(e.cfg.Logger, "Delay asked for is longer than the work queue's delayed-retry delay: the retry is held again until it is due", f.fields.Add(watermill.LogFields{
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
	delete(cp.Metadata, keys.HoldUntil)
	if !holdUntil.IsZero() {
		cp.Metadata[keys.HoldUntil] = holdUntil.UTC().Format(time.RFC3339Nano)
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
		e.observe(amqpretry.Event{Kind: amqpretry.EventRetryScheduled, Queue: d.queue, Backend: delay.Backend(e.backend.Name()), Attempt: d.attempt, Err: err,
			Requested: requested, Effective: effective, Handoff: time.Since(start)})
		if e.sampled(n) {
			e.cfg.Logger.Info("Retry scheduled", f.fields.Add(watermill.LogFields{"requested_delay": requested.String(), "effective_delay": effective.String()}))
		}
		return nil
	case errors.Is(perr, backend.ErrTooLarge):
		// Handing it off again would be refused again: poison it, saying why.
		f.fields["handoff_err"] = perr.Error()
		f.envelope.Error = "retry copy larger than the broker's frame_max even with a trimmed envelope; handler error: " + err.Error()
		return e.poison(f, cp, amqpretry.ReasonTooLarge)
	}
	return e.handoffFailed(f, cp, perr, backend.Cause(perr), true)
}

// handoffContext is the context of a hand-off of cp: the delivery's, but not canceled
// with it. The router cancels it when it closes, while the handlers still run and the
// subscriber may still deliver; a hand-off canceled then would count as failed, again
// at each redelivery to the closing process, and poison the message after
// HandoffAttempts of them (seen stopping a consumer in the no-loss test that changes
// backends). Bounded by ConfirmTimeout, the hand-off is confirmed, and the original
// acked, or fails, and the original is nacked.
func handoffContext(cp *message.Message) context.Context {
	return context.WithoutCancel(cp.Context())
}

// stages is how many retries come before the copying backend's schedule: the
// immediate ones, or those held in the work queue.
func (e *engine) stages() int { return e.cfg.Policy.Immediate + e.cfg.HeldRetries }

// holdsInPlace tells whether the retry after d's failed attempt is held in the work
// queue. A backend that holds any delay in place (delivery-time) holds every retry;
// one with a constant delay, the queue's (delayed-retry), holds every retry when it is
// alone, else the first HeldRetries, and neither when the queue was found not to hold
// them or the error asks for a delay of its own (the copying backend can keep it).
func (e *engine) holdsInPlace(d delivery, dec amqpretry.Decision) bool {
	switch {
	case e.inPlace == nil:
		return false
	case e.inPlaceCaps.Delays != backend.ConstantDelay:
		return true
	case e.held.isBroken(d.queue):
		return false
	}
	return dec.Delay <= 0 && (e.backend == nil || d.attempt <= e.cfg.HeldRetries)
}

// envelope is the envelope of the copy of a message that failed, built once: what the
// message carries from its earlier failures and redrives (first failure, original
// route, redrives, dropped headers) and this failure. What the way out decides (the
// attempt, the delays and due time, or the poison reason) is set there, once.
func (e *engine) envelope(d delivery, err error) Envelope {
	was := d.envelope
	env := Envelope{
		FirstFailure: was.FirstFailure, OriginalExchange: was.OriginalExchange, OriginalRoutingKey: was.OriginalRoutingKey,
		DroppedHeaders: was.DroppedHeaders, RedrivenAt: was.RedrivenAt, Redriven: was.Redriven, RedrivenFrom: was.RedrivenFrom,
		LastFailure: d.at, Error: err.Error(), ErrorTypes: errorTypes(err),
		Handler: d.handler, Topic: d.topic, Queue: d.queue,
	}
	if env.FirstFailure.IsZero() {
		env.FirstFailure = d.at
		env.OriginalExchange, env.OriginalRoutingKey = d.exchange, d.key
	}
	return env
}

// failure is one failed attempt being dealt with.
type failure struct {
	delivery
	err      error
	envelope Envelope
	fields   watermill.LogFields
}

// envelopeRoom is how many keys the envelope adds to a copy at most.
const envelopeRoom = 20

// copyOf copies msg, with its context, into metadata sized for the envelope, without
// the keys its marshaler wrote on receipt (they are never published).
func copyOf(msg *message.Message) *message.Message {
	cp := message.NewMessageWithContext(msg.Context(), msg.UUID, msg.Payload)
	cp.Metadata = make(message.Metadata, len(msg.Metadata)+envelopeRoom)
	maps.Copy(cp.Metadata, msg.Metadata)
	return cp
}

// errorTypes lists the Go types in err's chain, depth first, outermost first.
func errorTypes(err error) []string {
	var types []string
	var walk func(error)
	walk = func(e error) {
		if e == nil || len(types) >= keys.MaxErrorTypes {
			return
		}
		types = append(types, fmt.Sprintf("%T", e))
		switch u := e.(type) {
		case interface{ Unwrap() error }:
			walk(u.Unwrap())
		case interface{ Unwrap() []error }:
			for _, inner := range u.Unwrap() {
				walk(inner)
			}
		}
	}
	walk(err)
	return types
}

// trimmedErrorBytes bounds the error text of an envelope trimmed to fit frame_max.
const trimmedErrorBytes = 256

// trim shortens the envelope of a copy too large for the broker: the error text to
// trimmedErrorBytes, the error types left out.
func trim(env *Envelope) {
	env.Error = keys.Truncate(env.Error, trimmedErrorBytes)
	env.ErrorTypes = nil
}

// delayOf returns the delay of the n-th delayed retry of p (from 1: the first is
// InitialInterval for the exponential schedule), jitter included. p has its defaults.
func delayOf(p amqpretry.Policy, n int) time.Duration {
	n = max(n, 1)
	if len(p.Delays) > 0 {
		return p.Delays[min(n, len(p.Delays))-1]
	}
	b := &backoff.ExponentialBackOff{
		InitialInterval:     p.InitialInterval,
		RandomizationFactor: p.Jitter,
		Multiplier:          p.Multiplier,
		MaxInterval:         p.MaxInterval,
		Stop:                backoff.Stop,
		Clock:               backoff.SystemClock,
	}
	b.Reset()
	var d time.Duration
	for range n {
		d = b.NextBackOff()
	}
	return min(d, p.MaxInterval)
}
