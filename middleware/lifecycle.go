package middleware

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/keys"
)

// lifecycle is the engine's open or closed state. Once closed, the engine hands
// nothing off: a failed message is nacked for redelivery, paced. Close waits for
// the hand-offs that began before it.
type lifecycle struct {
	mu       sync.Mutex
	closed   bool
	done     chan struct{} // closed by close: ends the pauses of hand-offs in flight
	inflight sync.WaitGroup
	running  atomic.Int64 // hand-offs in flight
	warned   atomic.Bool  // the first message after Close was logged
	refused  atomic.Int64 // failed messages nacked because the engine was closed
}

// begin starts a hand-off; false once closed. A true begin must be followed by end.
func (l *lifecycle) begin() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return false
	}
	l.inflight.Add(1)
	l.running.Add(1)
	return true
}

func (l *lifecycle) end() {
	l.running.Add(-1)
	l.inflight.Done()
}

// closing returns a channel closed once the engine is closed.
func (l *lifecycle) closing() <-chan struct{} {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.done == nil {
		l.done = make(chan struct{})
	}
	return l.done
}

// close closes the engine and waits for the hand-offs in flight. It returns how many
// it waited for, and false when the engine was closed already.
func (l *lifecycle) close() (waited int64, first bool) {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return 0, false
	}
	l.closed = true
	if l.done == nil {
		l.done = make(chan struct{})
	}
	close(l.done)
	waited = l.running.Load()
	l.mu.Unlock()
	l.inflight.Wait()
	return waited, true
}

func (l *lifecycle) isClosed() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.closed
}

// refuseClosed answers a message that failed after Close: nothing is handed off (the
// hand-off connection is closed and is not opened again); the message is nacked for
// redelivery, after the pause a failed hand-off would take, so that nothing is lost
// and nothing loops. The first one is logged at WARN, naming the order to close in.
func (e *engine) refuseClosed(msg *message.Message, d delivery, err error) error {
	n := e.failures.add(msg.UUID)
	e.life.refused.Add(1)
	cerr := fmt.Errorf("%w: queue %q: the Retry was closed before the router stopped, so nothing is handed off; the message is nacked for redelivery: close the router first, then the Retry (defer retry.Close() before creating the router, so that it runs after the router's Close)", amqpretry.ErrHandoff, d.queue)
	if e.life.warned.CompareAndSwap(false, true) {
		warn(e.cfg.Logger, "Message failed after Close: nacked for redelivery, nothing handed off", cerr, watermill.LogFields{
			"message_uuid": msg.UUID, "handler": d.handler, "queue": d.queue, "attempt": d.attempt,
		})
	}
	pause(msg.Context(), backend.HandoffPause(n))
	if err == nil {
		return cerr
	}
	return errors.Join(err, cerr)
}

// pausePaced waits d, or until ctx is done or the engine is closed.
func (e *engine) pausePaced(ctx context.Context, d time.Duration) {
	if d <= 0 {
		return
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	case <-e.life.closing():
	}
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
// once more. It forgets everything when it would hold more than maxTracked messages.
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
		kept.fields = maps.Clone(f.fields)
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

// get returns the pending poisoning of msg: one recorded for its UUID, with its payload.
func (p *pendingPoisons) get(msg *message.Message) (pendingPoison, bool) {
	if p.size.Load() == 0 {
		return pendingPoison{}, false
	}
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
	f.fields = maps.Clone(pp.f.fields)
	f.fields["poison_retry"] = pp.failures + 1
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
	e.stats.failures.add()
	cause := backend.Cause(perr)
	if gone {
		cause = causePoisonQueueMissing
	}
	e.observe(amqpretry.Event{Kind: amqpretry.EventHandoffFailed, Queue: f.queue, Attempt: f.attempt, Err: perr, Cause: cause, Reason: reason})
	f.fields["handoff_failures"] = n
	f.fields["poison_queue"] = e.cfg.PoisonQueue
	wait := backend.HandoffPause(n)
	if e.pending.setAside(f.msg.UUID, time.Now().Add(wait/2)) && e.setAside(f, wait) {
		f.fields["set_aside_for"] = wait.String()
		e.cfg.Logger.Error("Could not poison message: set aside through the delay backend, only its poison publish is retried when it comes back, the handler does not run it again", perr, f.fields)
		return nil
	}
	e.cfg.Logger.Error("Could not poison message: nacked for redelivery, only its poison publish is retried, the handler does not run it again", perr, f.fields)
	e.pausePaced(f.msg.Context(), wait)
	return errors.Join(f.err, fmt.Errorf("%w: queue %q: %w", amqpretry.ErrHandoff, f.queue, perr))
}

// setAside holds f's message for about wait where a retry would wait (a copy parked
// in the delay backend, confirmed before the original is acked, or the delivery held
// in place), so that the messages behind it in its work queue keep flowing: a nack
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
		return e.backend.Park(handoffContext(cp), f.queue, cp, effective) == nil
	case e.inPlace != nil:
		var md message.Metadata
		if e.inPlaceCaps.CarriesEnvelope {
			md = message.Metadata{}
			f.envelope.Write(md)
		}
		return e.holdInPlace(f.msg, wait, md) == nil
	}
	return false
}

// causePoisonQueueMissing is the Event.Cause of a poison publish the broker returned
// unroutable: the poison queue does not exist.
const causePoisonQueueMissing = "poison-queue-missing"

// holdUntilOf reads keys.HoldUntil: when a retry parked for longer than the backend
// holds is due.
func holdUntilOf(msg *message.Message) (time.Time, bool) {
	v, ok := msg.Metadata[keys.HoldUntil]
	if !ok {
		return time.Time{}, false
	}
	t, err := time.Parse(time.RFC3339Nano, v)
	return t, err == nil
}

// parkAgain parks msg, a retry back before until, again for what remains: it never
// reaches the handler early. A failed park is nacked for redelivery, paced.
func (e *engine) parkAgain(msg *message.Message, d delivery, until time.Time) error {
	now := time.Now()
	effective, err := e.backend.Effective(until.Sub(now))
	if err == nil {
		cp := copyOf(msg)
		env := d.envelope
		env.EffectiveDelay, env.Due = effective, now.Add(effective)
		env.Write(cp.Metadata)
		if err = e.backend.Park(handoffContext(cp), d.queue, cp, effective); err == nil {
			return nil
		}
	}
	n := e.failures.add(msg.UUID)
	e.stats.failures.add()
	e.observe(amqpretry.Event{Kind: amqpretry.EventHandoffFailed, Queue: d.queue, Attempt: d.attempt, Err: err, Cause: backend.Cause(err)})
	e.cfg.Logger.Error("Could not park a retry again until it is due, nacking it for redelivery", err, watermill.LogFields{
		"message_uuid": msg.UUID, "queue": d.queue, "attempt": d.attempt, "handoff_failures": n, "due": until.Format(time.RFC3339Nano)})
	e.pausePaced(msg.Context(), backend.HandoffPause(n))
	return fmt.Errorf("%w: queue %q: park again until %s: %w", amqpretry.ErrHandoff, d.queue, until.Format(time.RFC3339Nano), err)
}
