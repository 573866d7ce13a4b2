package middleware

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"reflect"
	"slices"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/marshal"
)

// The failure path (fail), in the order it runs: decide what becomes of the message
// (plan), size the delay with the backend (size), stamp the failure envelope on a
// copy (stamp), park the copy, confirmed, and report the retry (publish, scheduled).
// A retry the broker holds takes the same path to the size, then is held (hold,
// hold.go) instead of copied.

// fail deals with msg after run (msg, or an immediate retry's copy of it) failed with
// err: decided is err's decision when the immediate retries already classified it.
func (e *engine) fail(msg, run *message.Message, d delivery, err error, decided *amqpretry.Decision) error {
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
	r, reason, rerr := e.plan(&f, werr, *decided)
	if reason == "" && rerr == nil {
		reason = e.size(&f, &r)
	}
	switch {
	case rerr != nil:
		return rerr
	case reason != "":
		// The copy (copyOf) is made where a way out publishes one: never for a held retry.
		return e.poison(f, copyOf(run), reason)
	case r.held:
		return e.hold(msg, &f, r)
	}
	start := time.Now()
	cp := stamp(run, &f, r, start)
	return e.publish(cp, f, r, start)
}

// retryPlan is a failed attempt's retry, as the failure path plans (plan) and sizes
// (size) it.
type retryPlan struct {
	dec    amqpretry.Decision
	target *kept // the backend that keeps it
	// held: the broker holds the failed delivery itself (settle), no copy. selfPark:
	// a key's head copy on a holder alone, sent to its work queue and held there
	// until due (holdUntil).
	held, selfPark bool
	// next is the attempt the retry runs, nth its place in the policy's delay
	// schedule (delayOf).
	next, nth            int
	requested, effective time.Duration
	// parkUntil is when a copy re-parked until due (backend.Repark) is due, zero for
	// none; a self-parked copy's is its due time (stamp).
	parkUntil time.Time
}

// plan decides what becomes of f's message: poisoned (the reason, its envelope's
// error set), an error to return, or a retry, its backend chosen.
func (e *engine) plan(f *failure, werr error, dec amqpretry.Decision) (retryPlan, amqpretry.Reason, error) {
	// The one home of the retry's attempt numbers. The schedule starts after the
	// retries before the copying backend's: the immediate ones, or those held in the
	// work queue.
	r := retryPlan{dec: dec, next: f.attempt + 1, nth: f.attempt - min(e.cfg.Policy.Immediate+e.heldRetries, f.attempt-1)}
	switch {
	case werr != nil:
		// Where its retry must go is unknown, now as at every redelivery: poisoned at
		// once, the fix in its envelope and its one log line, never run again.
		f.err = fmt.Errorf("%w; handler error: %w", werr, f.err)
		f.envelope.Error = f.err.Error()
		e.stats.failures.Add(1)
		e.observe(amqpretry.Event{Kind: amqpretry.EventHandoffFailed, Queue: f.queue, Attempt: f.attempt, Err: werr, Cause: "not-wired"})
		return r, amqpretry.ReasonHandoffFailed, nil
	case dec.Permanent:
		if dec.Undecodable {
			// Say why the error is permanent when no mark of the handler's says it.
			f.envelope.Error = "undecodable payload, not retried: " + f.envelope.Error
			f.log()["undecodable"] = true
		}
		return r, amqpretry.ReasonPermanent, nil
	case f.attempt >= e.cfg.Policy.MaxAttempts:
		return r, amqpretry.ReasonMaxAttempts, nil
	case f.queue == "":
		return r, "", errors.Join(f.err, fmt.Errorf("%w: no subscribed topic in the message context (is the middleware on a router handler?)", amqpretry.ErrHandoff))
	}
	r.target, r.held = e.backend, e.holder != nil && e.holdsRetry(f.delivery, dec)
	switch {
	case r.held:
		r.target = e.holder
	case e.backend == nil && e.held.isBroken(f.queue):
		f.envelope.Error = fmt.Sprintf("work queue %q does not hold delayed retries (a nacked message came back at once), and no copying backend is configured; handler error: %v", f.queue, f.err)
		return r, amqpretry.ReasonHandoffFailed, nil
	case e.backend == nil: // a holder alone, asked for a delay of its own
		r.target, r.held = e.holder, true
	}
	// A key's head must carry its key (keys.OrderHead), and a message taken from behind
	// its key is no delivery a holder could settle: a holder that carries nothing,
	// or such a message, takes it as a copy, to the copying backend, or, alone, to the
	// work queue itself, where it is held until due (selfPark).
	if r.held && (f.behind || f.orderKey != "" && !e.holder.caps.CarriesEnvelope) {
		if e.backend != nil {
			r.target, r.held = e.backend, false
		} else {
			r.held, r.selfPark = false, true
		}
	}
	return r, "", nil
}

// size sets r's delays: the one asked for (the error's own, a constant backend's one,
// or the policy's), and the one its backend keeps, held again or parked again until
// due when that is shorter. A delay the backend refuses poisons the message, saying why.
func (e *engine) size(f *failure, r *retryPlan) amqpretry.Reason {
	caps := r.target.caps
	r.requested = r.dec.Delay
	switch {
	case r.requested > 0:
	case r.target.constant:
		r.requested = caps.Longest // its one delay is the one asked for: no schedule to follow
	default:
		r.requested = delayOf(e.cfg.Policy, r.nth)
	}
	effective, err := r.target.Effective(r.requested)
	if err != nil {
		f.envelope.Error = err.Error() + "; handler error: " + f.err.Error()
		return amqpretry.ReasonDelayTooLong
	}
	r.effective = effective
	switch {
	case caps.PastLongest == backend.Repark && (r.dec.Delay > 0 && r.requested > effective || r.requested > caps.Longest):
		// A delay of the error's own (a server's Retry-After) is never cut short, nor
		// is the policy's past the longest tier (within the ladder it takes the
		// nearest tier): the copy is re-parked when it comes back, until it is due.
		// The policy's was logged once at start.
		r.parkUntil = time.Now().Add(r.requested)
		if r.dec.Delay > 0 {
			notice(e.cfg.Logger, "Delay asked for is longer than the longest tier: the retry is parked again until it is due",
				f.log().Add(watermill.LogFields{"requested_delay": r.requested.String(), "effective_delay": effective.String()}))
		}
	case r.held && caps.PastLongest == backend.HoldAgain && r.dec.Delay > effective:
		// The queue holds a retry for one delay: held again until it is due, never
		// back before the delay asked for (a server's Retry-After).
		holds := (r.requested + effective - 1) / effective
		r.effective = holds * effective
		notice(e.cfg.Logger, "Delay asked for is longer than the work queue's delayed-retry delay: the retry is held again until it is due", f.log().Add(watermill.LogFields{
			"requested_delay": r.requested.String(), "effective_delay": r.effective.String(), "holds": int64(holds)}))
	}
	if r.selfPark && r.requested > r.effective {
		r.effective = r.requested // held again until due: never back before the delay asked for
	}
	return ""
}

// hold has the broker hold msg, the failed delivery, as the retry r (settle), blocks
// its key, and reports the retry.
func (e *engine) hold(msg *message.Message, f *failure, r retryPlan) error {
	if err := e.settle(msg, *f, r); err != nil {
		return e.handoffFailed(*f, copyOf(msg), err, "other", true)
	}
	if err := e.orderBlock(f); err != nil {
		// The retry is held already: the key is blocked at its next failure.
		e.cfg.Logger.Error("Could not block a key: its later messages may overtake this retry", err, f.log())
	}
	e.scheduled(f, r, 0)
	return nil
}

// stamp returns the copy of run that is the retry r, its envelope f's with r's
// attempt, delays and due time (start on), when it is due if it comes back before
// (keys.ParkUntil), and a key's head's key (keys.OrderHead).
func stamp(run *message.Message, f *failure, r retryPlan, start time.Time) *message.Message {
	cp := copyOf(run)
	f.envelope.Attempt = r.next
	f.envelope.RequestedDelay, f.envelope.EffectiveDelay, f.envelope.Due = r.requested, r.effective, start.Add(r.effective)
	f.envelope.Write(cp.Metadata)
	delete(cp.Metadata, keys.ParkUntil)
	parkUntil := r.parkUntil
	if r.selfPark {
		parkUntil = f.envelope.Due
	}
	if !parkUntil.IsZero() {
		cp.Metadata[keys.ParkUntil] = parkUntil.UTC().Format(timeLayout)
	}
	if f.orderKey != "" {
		cp.Metadata[keys.OrderHead] = f.orderKey
	}
	return cp
}

// publish parks cp, the copy that is the retry r (a trimmed envelope if it is too
// large for the broker), blocks its key, and reports the retry: confirmed since
// start. A copy too large even then is poisoned; another failed park is a failed
// hand-off.
func (e *engine) publish(cp *message.Message, f failure, r retryPlan, start time.Time) error {
	err := e.park(cp, f.queue, r)
	if errors.Is(err, backend.ErrTooLarge) {
		trim(&f.envelope)
		f.envelope.Write(cp.Metadata)
		err = e.park(cp, f.queue, r)
	}
	if err == nil {
		err = e.orderBlock(&f)
	}
	switch {
	case err == nil:
		e.scheduled(&f, r, time.Since(start))
		return nil
	case errors.Is(err, backend.ErrTooLarge):
		// Handing it off again would be refused again: poison it, saying why.
		f.log()["handoff_err"] = err.Error()
		f.envelope.Error = "retry copy larger than the broker's frame_max even with a trimmed envelope; handler error: " + f.err.Error()
		return e.poison(f, cp, amqpretry.ReasonTooLarge)
	}
	return e.handoffFailed(f, cp, err, backend.Cause(err), true)
}

// park parks cp, the copy that is the retry r, for queue: with the copying backend,
// or a key's head copy on a holder alone to queue, its work queue, where it is held
// until it is due (selfPark, holdUntil).
func (e *engine) park(cp *message.Message, queue string, r retryPlan) error {
	if r.selfPark {
		return e.toQueue(cp.Context(), queue, cp)
	}
	return e.backend.Park(cp.Context(), queue, cp, r.effective)
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
// first delay.HeldRetries, and neither when the queue was found not to hold them or the
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
	return dec.Delay <= 0 && (e.backend == nil || d.attempt <= e.heldRetries)
}

// scheduled reports r, a retry its backend keeps now, a confirmed copy (handoff is
// the time its park took) or a held delivery: it forgets the message's failed
// hand-offs, counts the retry, tells Observe and logs it at DEBUG.
func (e *engine) scheduled(f *failure, r retryPlan, handoff time.Duration) {
	if f.out != nil {
		f.out.scheduled = true
	}
	if e.failures.size.Load() > 0 {
		e.failures.forget(f.msg.UUID)
	}
	if e.givenBack.size.Load() > 0 {
		e.givenBack.forget(f.msg.UUID)
	}
	e.sent.add(f.msg.UUID, r.next)
	e.stats.retries.Add(1)
	if e.cfg.Observe != nil { // observe, on the way of every retry
		e.cfg.Observe(amqpretry.Event{Kind: amqpretry.EventRetryScheduled, Queue: f.queue, Backend: r.target.name, Attempt: f.attempt, Err: f.err,
			Requested: r.requested, Effective: r.effective, Handoff: handoff})
	}
	if !e.debug {
		return
	}
	fields := f.log().Add(watermill.LogFields{"requested_delay": r.requested.String(), "effective_delay": r.effective.String()})
	if r.target.caps.Keeps == backend.KeepsDelivery {
		fields["delay_backend"] = r.target.name
		e.cfg.Logger.Debug("Retry held in the work queue", fields)
		return
	}
	e.cfg.Logger.Debug("Retry scheduled", fields)
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
		LastFailure: time.Now(), Error: err.Error(), // when the handler's failure came back
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
			env.ErrorTypes = append(env.ErrorTypes, reflect.TypeOf(e).String()) // %T, not allocated
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
		env.FirstFailure = env.LastFailure
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
// backend.HandoffAttempts of them (seen stopping a consumer in the no-loss test that
// changes backends). Bounded by the confirm timeout (10s), the hand-off is confirmed, and the original
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

// delayOf returns the delay of the n-th delayed retry of p (from 1: Delays[0]), the
// last entry repeating, jitter included: drawn from [d - j·d, d + j·d], never past the
// longest entry. p has its defaults.
func delayOf(p amqpretry.Policy, n int) time.Duration {
	if len(p.Delays) == 0 {
		return 0
	}
	d := p.Delays[min(max(n, 1), len(p.Delays))-1]
	j := max(p.Jitter, 0) // a negative Jitter means none
	if j == 0 || d <= 0 {
		return d
	}
	return min(time.Duration(math.Floor(float64(d)*(1-j+2*j*rand.Float64()))), slices.Max(p.Delays))
}
