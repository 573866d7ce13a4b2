package middleware

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/delay"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/keys"
)

// settle leaves msg in its work queue for the broker to hold and redeliver after
// effective (an in-place backend): no copy. The envelope goes with it where the
// transport can carry it.
func (e *engine) settle(msg *message.Message, f failure, requested, effective time.Duration) error {
	due := time.Now().Add(effective)
	f.envelope.Attempt = f.attempt + 1
	f.envelope.RequestedDelay, f.envelope.EffectiveDelay, f.envelope.Due = requested, effective, due
	var md message.Metadata
	if e.inPlaceCaps.CarriesEnvelope {
		md = message.Metadata{}
		f.envelope.Write(md)
	}
	if err := e.holdInPlace(msg, effective, md); err != nil {
		return e.handoffFailed(f, copyOf(msg), err, "other", true)
	}
	h := heldRetry{due: due, first: f.envelope.FirstFailure, env: f.envelope}
	if f.backEarly {
		h.early = f.early + 1
	}
	if hold := e.inPlaceCaps.Longest; e.inPlaceCaps.PastLongest == backend.HoldAgain && effective > hold {
		// Back after the queue's delay, then held again until requested is over.
		h.due, h.until = time.Now().Add(hold), time.Now().Add(requested)
	}
	e.held.add(msg.UUID, h)
	e.failures.forget(msg.UUID)
	n := e.stats.retries.add()
	e.observe(amqpretry.Event{Kind: amqpretry.EventRetryScheduled, Queue: f.queue, Backend: delay.Backend(e.inPlace.Name()), Attempt: f.attempt, Err: f.err,
		Requested: requested, Effective: effective})
	if e.sampled(n) {
		e.cfg.Logger.Info("Retry held in the work queue", f.fields.Add(watermill.LogFields{
			"requested_delay": requested.String(), "effective_delay": effective.String(), "delay_backend": e.inPlace.Name()}))
	}
	return nil
}

// holdInPlace has the broker hold msg, the delivery that failed, in its work queue for
// effective: the in-place backend arranges how (with envelope where the transport can
// carry it), and the middleware nacks it. That nack is the delivery's one settlement:
// the handler chain then returns nil, and the router's Ack that follows does nothing
// (a Watermill message nacked once is never acked: TestInPlaceSettlesOnce).
func (e *engine) holdInPlace(msg *message.Message, effective time.Duration, envelope message.Metadata) error {
	if err := e.inPlace.(backend.InPlace).Settle(msg, effective, envelope); err != nil {
		return err
	}
	msg.Nack()
	return nil
}

// poison hands cp, the copy of a message that failed for good, to the poison queue. A
// copy too large for the broker loses its envelope's longer fields first, then the
// largest headers that are not the envelope's, named in DroppedHeaders, until it fits.
func (e *engine) poison(f failure, cp *message.Message, reason amqpretry.Reason) error {
	f.envelope.Reason, f.envelope.Attempt, f.envelope.MaxAttempts = reason, f.attempt, e.cfg.Policy.MaxAttempts
	f.envelope.Write(cp.Metadata)
	f.fields["poison_reason"] = string(reason)
	start := time.Now()
	perr := e.poisonTo(cp)
	if errors.Is(perr, backend.ErrTooLarge) {
		trim(&f.envelope)
		f.envelope.Write(cp.Metadata)
		perr = e.poisonTo(cp)
	}
	for errors.Is(perr, backend.ErrTooLarge) && dropLargestHeader(cp.Metadata, &f.envelope) {
		perr = e.poisonTo(cp)
	}
	if perr != nil {
		return e.poisonFailed(f, reason, perr)
	}
	e.failures.forget(cp.UUID)
	e.pending.forget(cp.UUID)
	e.stats.poisoned.add()
	e.observe(amqpretry.Event{Kind: amqpretry.EventPoisoned, Queue: f.queue, Attempt: f.attempt, Reason: reason, Err: f.err, Handoff: time.Since(start)})
	if f.envelope.DroppedHeaders != "" {
		f.fields["dropped_headers"] = f.envelope.DroppedHeaders
	}
	warn(e.cfg.Logger, "Message poisoned", f.err, f.fields)
	return nil
}

func (e *engine) poisonTo(cp *message.Message) error { return e.poisonQ(handoffContext(cp), cp) }

// dropLargestHeader removes the largest metadata entry that is not the envelope's and
// names it in env.DroppedHeaders. It returns false when there is nothing left to drop.
func dropLargestHeader(md message.Metadata, env *Envelope) bool {
	largest, size := "", -1
	for k, v := range md {
		if !keys.InEnvelope(k) && len(k)+len(v) > size {
			largest, size = k, len(k)+len(v)
		}
	}
	if size < 0 {
		return false
	}
	delete(md, largest)
	note := fmt.Sprintf("%s (%d bytes)", largest, size)
	if env.DroppedHeaders != "" {
		note = env.DroppedHeaders + ", " + note
	}
	env.DroppedHeaders = note
	env.Write(md)
	return true
}

// handoffFailed handles a hand-off that failed with perr: it poisons the message once
// HandoffAttempts hand-offs of it have failed in a row (if mayPoison), and otherwise
// waits a while, then returns the error that makes the router nack it for redelivery.
func (e *engine) handoffFailed(f failure, cp *message.Message, perr error, cause string, mayPoison bool) error {
	n := e.failures.add(cp.UUID)
	e.stats.failures.add()
	e.observe(amqpretry.Event{Kind: amqpretry.EventHandoffFailed, Queue: f.queue, Attempt: f.attempt, Err: perr, Cause: cause})
	f.fields["handoff_failures"] = n
	e.cfg.Logger.Error("Could not hand off message, nacking it for redelivery", perr, f.fields)
	if mayPoison && n >= e.cfg.HandoffAttempts {
		f.envelope.Error = fmt.Sprintf("%d hand-offs failed in a row, the last: %v; handler error: %v", n, perr, f.err)
		return e.poison(f, cp, amqpretry.ReasonHandoffFailed)
	}
	e.pausePaced(cp.Context(), backend.HandoffPause(n))
	return errors.Join(f.err, fmt.Errorf("%w: queue %q: %w", amqpretry.ErrHandoff, f.queue, perr))
}

// failureCounts counts the failed hand-offs of each message in a row, by UUID. It
// forgets a message once it is handed off or handled, and everything when it would
// hold more than maxTracked messages (hand-offs failing for that many different
// messages at once is a broker outage, where the backoff is what matters).
type failureCounts struct {
	mu   sync.Mutex
	n    map[string]int
	size atomic.Int64 // len(n), read without the lock on the success path
}

const maxTracked = 10_000

func (c *failureCounts) add(uuid string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil || len(c.n) >= maxTracked {
		c.n = map[string]int{}
	}
	c.n[uuid]++
	c.size.Store(int64(len(c.n)))
	return c.n[uuid]
}

func (c *failureCounts) forget(uuid string) {
	if c.size.Load() == 0 {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.n, uuid)
	c.size.Store(int64(len(c.n)))
}

// pause waits d, or until ctx is done.
func pause(ctx context.Context, d time.Duration) {
	if d <= 0 {
		return
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}

// chain lists the Retry middlewares (by wiring.ID) a message passes through.
type chain struct {
	mu  sync.Mutex
	ids []string
}

type chainKey struct{}

// joinChain records id in msg's context. The chain is shared by every middleware of
// the handler, so an outer one sees the inner ones after the handler returns.
func joinChain(msg *message.Message, id string) {
	c, _ := msg.Context().Value(chainKey{}).(*chain)
	if c == nil {
		c = &chain{}
		msg.SetContext(context.WithValue(msg.Context(), chainKey{}, c))
	}
	c.mu.Lock()
	c.ids = append(c.ids, id)
	c.mu.Unlock()
}

// inChain tells whether the Retry id is among the middlewares msg passes through.
func inChain(msg *message.Message, id string) bool {
	c, _ := msg.Context().Value(chainKey{}).(*chain)
	if c == nil {
		return false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Contains(c.ids, id)
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
	if e.wiring.Bound != nil && !e.wiring.Bound(d.queue) {
		return fmt.Errorf("%w: handler %q: queue %q was never bound for retries by a subscriber built from this Retry's SubscriberConfig(), so a retry could not come back to it", amqpretry.ErrNotWired, d.handler, d.queue)
	}
	return nil
}

// warner is a logger with a WARN level. watermill.LoggerAdapter has none: where the
// logger given has a Warn method it is used, else the line goes out at ERROR, so that
// alerting on errors sees it.
type warner interface {
	Warn(msg string, fields watermill.LogFields)
}

// notice logs msg at WARN, or at INFO where the logger has no WARN level: something
// was adjusted, and nothing is wrong.
func notice(l watermill.LoggerAdapter, msg string, fields watermill.LogFields) {
	if w, ok := l.(warner); ok {
		w.Warn(msg, fields)
		return
	}
	l.Info(msg, fields)
}

// warn logs msg at WARN, or at ERROR with err where the logger has no WARN level.
func warn(l watermill.LoggerAdapter, msg string, err error, fields watermill.LogFields) {
	if w, ok := l.(warner); ok {
		if err != nil {
			fields = fields.Add(watermill.LogFields{"err": err.Error()})
		}
		w.Warn(msg, fields)
		return
	}
	if err == nil {
		l.Info(msg, fields) // never err=<nil>
		return
	}
	l.Error(msg, err, fields)
}

// holdAgain holds msg in its work queue once more when it is a retry held for a delay
// longer than the queue's and not yet due: it never reaches the handler early. It
// tells whether it did. A retry back long before the queue's delay is not held (the
// queue does not hold retries: observeDelivery reports it).
func (e *engine) holdAgain(msg *message.Message, d delivery) bool {
	if !d.held || d.heldUntil.IsZero() || !d.at.Before(d.heldUntil) || e.inPlace == nil || e.held.isBroken(d.queue) {
		return false
	}
	hold := e.inPlaceCaps.Longest
	if d.at.Before(d.heldDue.Add(-hold / 2)) {
		return false
	}
	if err := e.holdInPlace(msg, hold, nil); err != nil {
		return false
	}
	e.held.add(msg.UUID, heldRetry{due: d.at.Add(hold), until: d.heldUntil, first: d.envelope.FirstFailure, rehelds: d.rehelds + 1, env: d.envelope})
	return true
}
