package middleware

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v4"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/marshal"
)

// The failure path, in the order it runs: decide what becomes of the message, size
// the delay with the backend, stamp the failure envelope on a copy, park the copy,
// confirmed, and report the retry (scheduled). A retry the broker holds takes the
// same path to the size, then is held (hold.go) instead of copied.

// fail deals with msg after run (msg, or an immediate retry's copy of it) failed with
// err: decided is err's decision when the immediate retries already classified it.
func (e *engine) fail(msg, run *message.Message, d delivery, err error, decided *amqpretry.Decision) error {
	// Decide.
	var werr error
	if e.wiring.ID != "" && (d.owner != e.wiring.ID || !d.bound) { // else this Retry's, on a bound queue
		werr = e.checkWiring(d)
	}
	if errors.Is(werr, errOtherRetry) {
		return err // that Retry, also on this handler, decides
	}
	if decided == nil {
		dec := e.decide(run, err, d.attempt)
		decided = &dec
	}
	f := failure{delivery: d, err: err, maxAttempts: e.cfg.Policy.MaxAttempts, envelope: e.envelope(d, err)}
	// The copy (copyOf) is made where a way out publishes one: never for a held retry.
	switch {
	case werr != nil:
		// Where its retry must go is unknown, now as at every redelivery: poisoned at
		// once, the fix in its envelope and its one log line, never run again.
		f.err = fmt.Errorf("%w; handler error: %w", werr, err)
		f.envelope.Error = f.err.Error()
		e.stats.failures.Add(1)
		e.observe(amqpretry.Event{Kind: amqpretry.EventHandoffFailed, Queue: f.queue, Attempt: f.attempt, Err: werr, Cause: "not-wired"})
		return e.poison(f, copyOf(run), amqpretry.ReasonHandoffFailed)
	case decided.Permanent:
		if decided.Undecodable {
			// Say why the error is permanent when no mark of the handler's says it.
			f.envelope.Error = "undecodable payload, not retried: " + f.envelope.Error
			f.log()["undecodable"] = true
		}
		return e.poison(f, copyOf(run), amqpretry.ReasonPermanent)
	case d.attempt >= e.cfg.Policy.MaxAttempts:
		return e.poison(f, copyOf(run), amqpretry.ReasonMaxAttempts)
	case d.queue == "":
		return errors.Join(err, fmt.Errorf("%w: no subscribed topic in the message context (is the middleware on a router handler?)", amqpretry.ErrHandoff))
	}
	target, held := e.backend, e.holder != nil && e.holdsRetry(d, *decided)
	switch {
	case held:
		target = e.holder
	case e.backend == nil && e.held.isBroken(d.queue):
		f.envelope.Error = fmt.Sprintf("work queue %q does not hold delayed retries (a nacked message came back at once), and no copying backend is configured; handler error: %v", d.queue, err)
		return e.poison(f, copyOf(run), amqpretry.ReasonHandoffFailed)
	case e.backend == nil: // a holder alone, asked for a delay of its own
		target, held = e.holder, true
	}
	// A key's head must carry its key (keys.OrderHead), and a message taken from behind
	// its key is no delivery a holder could settle: a holder that carries nothing,
	// or such a message, takes it as a copy, to the copying backend, or, alone, to the
	// work queue itself, where it is held until due (selfPark).
	selfPark := false
	if held && (d.behind || d.orderKey != "" && !e.holder.caps.CarriesEnvelope) {
		if e.backend != nil {
			target, held = e.backend, false
		} else {
			held, selfPark = false, true
		}
	}

	// Size.
	caps := target.caps
	requested := decided.Delay
	switch {
	case requested > 0:
	case target.constant:
		requested = caps.Longest // its one delay is the one asked for: no schedule to follow
	default:
		// The schedule starts after the retries before the copying backend's: the
		// immediate ones, or those held in the work queue.
		requested = delayOf(e.cfg.Policy, d.attempt-min(e.cfg.Policy.Immediate+e.cfg.HeldRetries, d.attempt-1))
	}
	effective, serr := target.Effective(requested)
	if serr != nil {
		// Handing it off would be refused: poison it, saying why.
		f.envelope.Error = serr.Error() + "; handler error: " + err.Error()
		return e.poison(f, copyOf(run), amqpretry.ReasonDelayTooLong)
	}
	var parkUntil time.Time
	switch {
	case caps.PastLongest == backend.Repark && (decided.Delay > 0 && requested > effective || requested > caps.Longest):
		// A delay of the error's own (a server's Retry-After) is never cut short, nor
		// is the policy's past the longest tier (within the ladder it takes the
		// nearest tier): the copy is re-parked when it comes back, until it is due.
		// The policy's was logged once at start.
		parkUntil = time.Now().Add(requested)
		if decided.Delay > 0 {
			notice(e.cfg.Logger, "Delay asked for is longer than the longest tier: the retry is parked again until it is due",
				f.log().Add(watermill.LogFields{"requested_delay": requested.String(), "effective_delay": effective.String()}))
		}
	case held && caps.PastLongest == backend.HoldAgain && decided.Delay > effective:
		// The queue holds a retry for one delay: held again until it is due, never
		// back before the delay asked for (a server's Retry-After).
		holds := (requested + effective - 1) / effective
		notice(e.cfg.Logger, "Delay asked for is longer than the work queue's delayed-retry delay: the retry is held again until it is due", f.log().Add(watermill.LogFields{
			"requested_delay": requested.String(), "effective_delay": (holds * effective).String(), "holds": int64(holds)}))
		effective = holds * effective
	}
	if held {
		if herr := e.settle(msg, f, requested, effective); herr != nil {
			return e.handoffFailed(f, copyOf(msg), herr, "other", true)
		}
		if berr := e.orderBlock(&f); berr != nil {
			// The retry is held already: the key is blocked at its next failure.
			e.cfg.Logger.Error("Could not block a key: its later messages may overtake this retry", berr, f.log())
		}
		e.scheduled(&f, e.holder, requested, effective, 0)
		return nil
	}

	// Stamp.
	cp := copyOf(run)
	start := time.Now()
	f.envelope.Attempt = d.attempt + 1
	f.envelope.RequestedDelay, f.envelope.EffectiveDelay, f.envelope.Due = requested, effective, start.Add(effective)
	f.envelope.Write(cp.Metadata)
	delete(cp.Metadata, keys.ParkUntil)
	if selfPark {
		if requested > effective {
			// Held again until due: never back before the delay asked for.
			effective = requested
			f.envelope.EffectiveDelay, f.envelope.Due = effective, start.Add(effective)
			f.envelope.Write(cp.Metadata)
		}
		parkUntil = f.envelope.Due
	}
	if !parkUntil.IsZero() {
		cp.Metadata[keys.ParkUntil] = parkUntil.UTC().Format(timeLayout)
	}
	if d.orderKey != "" {
		cp.Metadata[keys.OrderHead] = d.orderKey
	}

	// Park.
	park := e.park
	if selfPark {
		park, target = e.selfPark, e.holder
	}
	perr := park(cp.Context(), d.queue, cp, effective)
	if errors.Is(perr, backend.ErrTooLarge) {
		trim(&f.envelope)
		f.envelope.Write(cp.Metadata)
		perr = park(cp.Context(), d.queue, cp, effective)
	}
	if perr == nil {
		perr = e.orderBlock(&f)
	}
	switch {
	case perr == nil:
		e.scheduled(&f, target, requested, effective, time.Since(start))
		return nil
	case errors.Is(perr, backend.ErrTooLarge):
		// Handing it off again would be refused again: poison it, saying why.
		f.log()["handoff_err"] = perr.Error()
		f.envelope.Error = "retry copy larger than the broker's frame_max even with a trimmed envelope; handler error: " + err.Error()
		return e.poison(f, cp, amqpretry.ReasonTooLarge)
	}
	return e.handoffFailed(f, cp, perr, backend.Cause(perr), true)
}

// park parks cp with the copying backend, for queue.
func (e *engine) park(ctx context.Context, queue string, cp *message.Message, effective time.Duration) error {
	return e.backend.Park(ctx, queue, cp, effective)
}

// selfPark sends cp, the head copy of an order key, to queue, its work queue, on a
// holder that carries nothing on the failed delivery (delayed-retry): it is held there
// when it arrives, until it is due (holdUntil).
func (e *engine) selfPark(ctx context.Context, queue string, cp *message.Message, _ time.Duration) error {
	return e.toQueue(ctx, queue, cp)
}

// errOtherRetry: the message is another Retry's, and that Retry is on the handler too.
var errOtherRetry = errors.New("message of another retry middleware on this handler")

// checkWiring tells whether this Retry may hand off d: nil, errOtherRetry, or an
// error wrapping ErrNotWired that names the fix.
func (e *engine) checkWiring(d delivery) error {
	if e.wiring.ID == "" {
		return nil
	}
	switch {
	case d.owner == e.wiring.ID:
	case d.owner == "":
		return fmt.Errorf("%w: message %s on handler %q was not delivered by a subscriber built from this Retry's SubscriberConfig(), so where its retry must go is unknown; build the subscriber from Retry.SubscriberConfig(), or add the handler with Retry.AddHandler", amqpretry.ErrNotWired, d.msg.UUID, d.handler)
	case inChain(d.msg, d.owner):
		return errOtherRetry
	default:
		return fmt.Errorf("%w: message %s on handler %q was delivered by the subscriber of another Retry, whose middleware is not on this handler; add that Retry's Middleware to the handler, or add the handler with its AddHandler", amqpretry.ErrNotWired, d.msg.UUID, d.handler)
	}
	if !d.bound {
		return fmt.Errorf("%w: handler %q: queue %q was never bound for retries by a subscriber built from this Retry's SubscriberConfig(), so a retry could not come back to it", amqpretry.ErrNotWired, d.handler, d.queue)
	}
	return nil
}

// holdsRetry tells whether the retry after d's failed attempt is held in the work
// queue. A holder of any delay (delivery-time) holds every retry; one with a constant
// delay, the queue's (delayed-retry), holds every retry when it is alone, else the
// first HeldRetries, and neither when the queue was found not to hold them or the
// error asks for a delay of its own (the copying backend can keep it).
func (e *engine) holdsRetry(d delivery, dec amqpretry.Decision) bool {
	switch {
	case e.holder == nil:
		return false
	case !e.holder.constant:
		return true
	case e.held.anyBroken.Load() && e.held.isBroken(d.queue):
		return false
	}
	return dec.Delay <= 0 && (e.backend == nil || d.attempt <= e.cfg.HeldRetries)
}

// scheduled reports a retry that by keeps now, a confirmed copy (handoff is the time
// its park took) or a held delivery: it forgets the message's failed hand-offs, counts
// the retry, tells Observe and logs it, one in Config.RetryLogEvery.
func (e *engine) scheduled(f *failure, by *kept, requested, effective, handoff time.Duration) {
	if f.out != nil {
		f.out.scheduled = true
	}
	if e.failures.size.Load() > 0 {
		e.failures.forget(f.msg.UUID)
	}
	if e.givenBack.size.Load() > 0 {
		e.givenBack.forget(f.msg.UUID)
	}
	e.sent.add(f.msg.UUID, f.attempt+1)
	n := e.stats.retries.Add(1)
	if e.cfg.Observe != nil { // observe, on the way of every retry
		e.cfg.Observe(amqpretry.Event{Kind: amqpretry.EventRetryScheduled, Queue: f.queue, Backend: by.name, Attempt: f.attempt, Err: f.err,
			Requested: requested, Effective: effective, Handoff: handoff})
	}
	if every := int64(e.cfg.RetryLogEvery); every < 0 || (every > 1 && n%every != 1) {
		return
	}
	fields := f.log().Add(watermill.LogFields{"requested_delay": requested.String(), "effective_delay": effective.String()})
	if by.caps.Keeps == backend.KeepsDelivery {
		fields["delay_backend"] = by.name
		e.cfg.Logger.Info("Retry held in the work queue", fields)
		return
	}
	e.cfg.Logger.Info("Retry scheduled", fields)
}

// observe sends ev to Config.Observe, if set.
func (e *engine) observe(ev amqpretry.Event) {
	if e.cfg.Observe != nil {
		e.cfg.Observe(ev)
	}
}

// failure is one failed attempt being dealt with.
type failure struct {
	delivery
	err         error
	maxAttempts int
	envelope    Envelope
	fields      watermill.LogFields // log: built when first logged
}

// log returns the fields of f's log lines, built the first time a line is logged.
func (f *failure) log() watermill.LogFields {
	if f.fields == nil {
		f.fields = watermill.LogFields{
			"message_uuid": f.msg.UUID, "handler": f.handler, "topic": f.topic, "queue": f.queue,
			"attempt": f.attempt, "max_attempts": f.maxAttempts, "err": f.err.Error(),
		}
	}
	return f.fields
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
		LastFailure: d.at, Error: err.Error(),
		Handler: d.handler, Topic: d.topic, Queue: d.queue,
	}
	// err's chain, depth first, outermost first, as errors.As walks it: the Go types
	// in it (at most keys.MaxErrorTypes) and the stack of the first panic in it.
	var buf [8]error
	todo := append(buf[:0], err)
	for len(todo) > 0 && (len(env.ErrorTypes) < keys.MaxErrorTypes || env.Stack == "") {
		e := todo[len(todo)-1]
		todo = todo[:len(todo)-1]
		if e == nil {
			continue
		}
		if len(env.ErrorTypes) < keys.MaxErrorTypes {
			env.ErrorTypes = append(env.ErrorTypes, fmt.Sprintf("%T", e))
		}
		if p, ok := e.(*panicked); ok && env.Stack == "" {
			env.Stack = p.stack
		}
		switch u := e.(type) {
		case interface{ Unwrap() error }:
			todo = append(todo, u.Unwrap())
		case interface{ Unwrap() []error }:
			inner := u.Unwrap()
			for i := len(inner) - 1; i >= 0; i-- {
				todo = append(todo, inner[i])
			}
		}
	}
	if env.FirstFailure.IsZero() {
		env.FirstFailure = d.at
		env.OriginalExchange, env.OriginalRoutingKey = d.exchange, d.key
	}
	return env
}

// envelopeRoom is how many keys the envelope of a retry adds to a copy.
const envelopeRoom = 13

// copyOf copies msg into metadata sized for the envelope, to be handed off. It leaves
// out the keys its marshaler wrote on receipt about the delivery itself
// (keys.OfDelivery): a copy is another message. It keeps keys.TypedHeaders and
// keys.RawHeaders, which the hand-off's marshaler reads to publish the headers with
// their types, and does not publish; the copy's context carries the typed values as
// read (marshal.CopyContext).
//
// The copy's context is the delivery's (without the Retry's chain), but not canceled
// with it. The router cancels it when it closes, while the handlers still run and the
// subscriber may still deliver; a hand-off canceled then would count as failed, again
// at each redelivery to the closing process, and poison the message after
// HandoffAttempts of them (seen stopping a consumer in the no-loss test that changes
// backends). Bounded by ConfirmTimeout, the hand-off is confirmed, and the original
// acked, or fails, and the original is nacked.
func copyOf(msg *message.Message) *message.Message {
	ctx := msg.Context()
	if _, typed := msg.Metadata[keys.TypedHeaders]; typed { // else nothing to carry
		ctx = marshal.CopyContext(msg)
	}
	if c, ok := ctx.(*chain); ok {
		// A copy is another delivery: not this one's chain (in process, where a copy
		// keeps its context, its delivery reads a chain of its own).
		ctx = c.Context
	}
	cp := message.NewMessageWithContext(context.WithoutCancel(ctx), msg.UUID, msg.Payload)
	n := len(msg.Metadata) + envelopeRoom
	for _, k := range keys.OfDelivery {
		if _, ok := msg.Metadata[k]; ok {
			n--
		}
	}
	cp.Metadata = make(message.Metadata, n)
	for k, v := range msg.Metadata {
		if !slices.Contains(keys.OfDelivery[:], k) {
			cp.Metadata[k] = v
		}
	}
	return cp
}

// trimmedErrorBytes bounds the error text of an envelope trimmed to fit frame_max.
const trimmedErrorBytes = 256

// trim shortens the envelope of a copy too large for the broker: the error text to
// trimmedErrorBytes, the error types and the stack left out.
func trim(env *Envelope) {
	env.Error = truncate(env.Error, trimmedErrorBytes)
	env.ErrorTypes, env.Stack = nil, ""
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
