package middleware

import (
	"errors"
	"fmt"
	"maps"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/keys"
)

// Poisoning: a message that failed for good goes to the poison queue; one whose poison
// publish fails is remembered (pending poisons) and set aside, and only its poison
// publish is retried.

// poison hands cp, the copy of a message that failed for good, to the poison queue. A
// copy too large for the broker loses its envelope's longer fields first, then the
// largest headers that are not the envelope's, named in DroppedHeaders, until it fits.
func (e *engine) poison(f failure, cp *message.Message, reason amqpretry.Reason) error {
	if f.orderKey != "" && e.order.poisonBlocks {
		// Its key stays blocked until an operator releases it: blocked first, so that
		// no later message of the key runs before it is.
		if err := e.orderBlock(&f); err != nil {
			return e.handoffFailed(f, cp, err, backend.Cause(err), false)
		}
	}
	f.envelope.Reason, f.envelope.Attempt, f.envelope.MaxAttempts = reason, f.attempt, e.cfg.Policy.MaxAttempts
	f.envelope.Write(cp.Metadata)
	if f.orderKey != "" {
		cp.Metadata[keys.OrderHead] = f.orderKey // redriven, it runs as its key's head
	}
	f.log()["poison_reason"] = string(reason)
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
	if e.givenBack.size.Load() > 0 {
		e.givenBack.forget(cp.UUID)
	}
	if e.dedup != nil && f.owned && f.queue != "" && f.msg != nil {
		e.record(f.delivery, dedupKey(f.delivery))
	}
	e.stats.poisoned.Add(1)
	if f.out != nil {
		f.out.poisoned = true
	}
	e.observe(amqpretry.Event{Kind: amqpretry.EventPoisoned, Queue: f.queue, Attempt: f.attempt, Reason: reason, Err: f.err, Handoff: time.Since(start)})
	if f.envelope.DroppedHeaders != "" {
		f.log()["dropped_headers"] = f.envelope.DroppedHeaders
	}
	warn(e.cfg.Logger, "Message poisoned", f.err, f.log())
	return nil
}

func (e *engine) poisonTo(cp *message.Message) error { return e.poisonQ(cp.Context(), cp) }

// dropLargestHeader removes the largest metadata entry that is not the envelope's and
// names it in env.DroppedHeaders. It returns false when there is nothing left to drop.
func dropLargestHeader(md message.Metadata, env *Envelope) bool {
	largest, size := "", -1
	for k, v := range md {
		if !inEnvelope(k) && len(k)+len(v) > size {
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

// pendingPoison is a message that failed for good and whose poison publish failed:
// what its poisoning needs, kept so that only the publish is retried when the message
// comes back, never the handler.
type pendingPoison struct {
	f        failure // delivery.msg cleared
	reason   amqpretry.Reason
	payload  []byte
	failures int       // failed poison publishes in a row
	aside    time.Time // set aside until then: back before it, it is not set aside again
}

// pendingPoisons remembers, by message UUID, the messages whose poison publish failed.
// The memory is this process's: after a restart the message runs through the handler
// once more. It forgets everything when it would track more than maxTracked messages.
type pendingPoisons struct {
	mu   sync.Mutex
	m    map[string]*pendingPoison
	size atomic.Int64
}

// add records that the poisoning of f (for reason) failed once more; it returns the
// failures in a row.
func (p *pendingPoisons) add(f failure, reason amqpretry.Reason) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	uuid := f.msg.UUID
	pp, ok := p.m[uuid]
	if !ok {
		if p.m == nil || len(p.m) >= maxTracked {
			p.m = map[string]*pendingPoison{}
		}
		kept := f
		kept.fields = maps.Clone(f.log())
		payload := f.msg.Payload
		kept.delivery.msg = nil
		pp = &pendingPoison{f: kept, reason: reason, payload: payload}
		p.m[uuid] = pp
	}
	pp.failures++
	p.size.Store(int64(len(p.m)))
	return pp.failures
}

// setAside records that uuid was set aside until t; it tells false, recording
// nothing, when uuid came back before the time it was last set aside until (a work
// queue that does not hold a nacked message): it must then be paced here instead.
func (p *pendingPoisons) setAside(uuid string, t time.Time) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	pp, ok := p.m[uuid]
	if !ok {
		return false
	}
	if now := time.Now(); now.Before(pp.aside) {
		pp.aside = time.Time{}
		return false
	}
	pp.aside = t
	return true
}

// get returns the pending poisoning of msg: one recorded for its UUID, with its
// payload. The engine asks only when size is not zero: a first delivery takes no lock.
func (p *pendingPoisons) get(msg *message.Message) (pendingPoison, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	pp, ok := p.m[msg.UUID]
	if !ok || string(pp.payload) != string(msg.Payload) {
		return pendingPoison{}, false
	}
	return *pp, true
}

func (p *pendingPoisons) forget(uuid string) {
	if p.size.Load() == 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.m, uuid)
	p.size.Store(int64(len(p.m)))
}

func (p *pendingPoisons) len() int64 { return p.size.Load() }

// repoison retries only the poison publish of msg, which failed for good on an earlier
// delivery: the handler does not run it again.
func (e *engine) repoison(msg *message.Message, d delivery, pp pendingPoison) error {
	f := pp.f
	f.delivery.msg = msg
	f.fields = maps.Clone(pp.f.log())
	f.log()["poison_retry"] = pp.failures + 1
	return e.poison(f, copyOf(msg), pp.reason)
}

// poisonFailed handles a poison publish that failed with perr: the message is
// remembered (only its poison publish is retried when it comes back), and nacked for
// redelivery after the paced pause of a failed hand-off.
func (e *engine) poisonFailed(f failure, reason amqpretry.Reason, perr error) error {
	gone := backend.RouteGone(perr)
	perr = fmt.Errorf("poison queue %q: %w", e.cfg.PoisonQueue, perr)
	if e.poisonHint != nil {
		perr = e.poisonHint(perr, gone)
	}
	n := e.pending.add(f, reason)
	e.givenBack.add(f.msg.UUID)
	e.stats.failures.Add(1)
	cause := backend.Cause(perr)
	if gone {
		cause = causePoisonQueueMissing
	}
	e.observe(amqpretry.Event{Kind: amqpretry.EventHandoffFailed, Queue: f.queue, Attempt: f.attempt, Err: perr, Cause: cause, Reason: reason})
	f.log()["handoff_failures"] = n
	f.log()["poison_queue"] = e.cfg.PoisonQueue
	wait := backend.HandoffPause(n)
	if e.pending.setAside(f.msg.UUID, time.Now().Add(wait/2)) && e.setAside(f, wait) {
		f.log()["set_aside_for"] = wait.String()
		e.cfg.Logger.Error("Could not poison message: set aside through the delay backend, only its poison publish is retried when it comes back, the handler does not run it again", perr, f.log())
		return nil
	}
	e.cfg.Logger.Error("Could not poison message: nacked for redelivery, only its poison publish is retried, the handler does not run it again", perr, f.log())
	e.pausePaced(f.msg.Context(), wait)
	return errors.Join(f.err, fmt.Errorf("%w: queue %q: %w", amqpretry.ErrHandoff, f.queue, perr))
}

// setAside keeps f's message for about wait where a retry would wait (a copy parked
// in the delay backend, confirmed before the original is acked, or the delivery held
// in its work queue), so that the messages behind it in its work queue keep flowing: a nack
// would put it back at the head of the queue. It tells whether it did; a message that
// cannot be routed back to its queue is not set aside.
func (e *engine) setAside(f failure, wait time.Duration) bool {
	if e.checkWiring(f.delivery) != nil || f.queue == "" {
		return false
	}
	switch {
	case e.backend != nil:
		effective, err := e.backend.Effective(wait)
		if err != nil {
			return false
		}
		cp := copyOf(f.msg)
		env := f.envelope
		env.Reason, env.MaxAttempts, env.Attempt = "", 0, f.attempt
		env.RequestedDelay, env.EffectiveDelay, env.Due = wait, effective, time.Now().Add(effective)
		env.Write(cp.Metadata)
		return e.backend.Park(cp.Context(), f.queue, cp, effective) == nil
	case e.holder != nil:
		var md message.Metadata
		if e.holder.caps.CarriesEnvelope {
			md = message.Metadata{}
			f.envelope.Write(md)
		}
		return e.holdDelivery(f.msg, wait, md) == nil
	}
	return false
}

// causePoisonQueueMissing is the Event.Cause of a poison publish the broker returned
// unroutable: the poison queue does not exist.
const causePoisonQueueMissing = "poison-queue-missing"
