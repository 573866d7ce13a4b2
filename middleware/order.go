package middleware

// Order (amqpretry.Config.OrderKey): while a message of key K waits for its retry, K's
// later messages wait on the broker behind it, in order, and the other keys flow.
//
//   - A message of K that fails has its retry scheduled as K's head: the copy carries
//     keys.OrderHead (a backend that holds the failed delivery without carrying
//     anything has the copy sent to the work queue itself and held there until due:
//     selfPark), and once the retry is confirmed, K's behind queue is declared: K is
//     blocked (orderBlock).
//   - A message of K that arrives while K is blocked is put behind it, a confirmed
//     publish, and acked: it never reaches the handler (orderRoute).
//   - When the head succeeds (or is poisoned, unless Config.BlockOnPoison), the
//     messages behind K run in order, in the head's handler call, and K is unblocked
//     once none is left: its behind queue is deleted, after the messages that ran are
//     acked (release). One that fails becomes K's head, and the rest wait on.
//
// Whether K is blocked is the broker's fact: its behind queue exists. This process
// caches what it learns from the time a work queue's subscriber (re)subscribes
// (Retry.Bind forgets it): a key it has not seen is tried by putting the message
// behind it, a mandatory publish the broker returns when K has no behind queue.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/keys"
)

// order is the engine's order keeping; nil without Config.OrderKey.
type order struct {
	key          func(*message.Message) string
	poisonBlocks bool // Config.BlockOnPoison
	lines        lines

	mu    sync.Mutex
	known map[orderKey]*keyState
	// badKey tells that OrderKey panicked once (logged once).
	badKey bool
}

// orderKey is an order key in a work queue.
type orderKey struct{ queue, key string }

// keyState is what this process knows of a key: blocked or not, and, while the
// messages that ran behind it are being settled, a channel closed when that is done.
type keyState struct {
	blocked   bool
	since     time.Time // blocked since, as this process knows
	behind    int64     // messages this process put behind it
	own       bool      // blocked by this process: nothing is behind it but what it put there
	releasing chan struct{}
}

// maxKnown bounds the keys known not blocked: past it they are forgotten (and tried
// again on the broker when next seen).
const maxKnown = 100_000

// orderOutcome is what became of a message of an order key: its handler succeeded, its
// retry was scheduled (it is its key's head), or it was poisoned.
type orderOutcome struct{ succeeded, scheduled, poisoned bool }

func newOrder(cfg amqpretry.Config, l lines) *order {
	return &order{key: cfg.OrderKey, poisonBlocks: cfg.BlockOnPoison, lines: l, known: map[orderKey]*keyState{}}
}

// keyOf is msg's order key: "" for none, and for a key function that panics (logged
// once).
func (o *order) keyOf(msg *message.Message, logger watermill.LoggerAdapter) (key string) {
	defer func() {
		if v := recover(); v != nil {
			key = ""
			o.mu.Lock()
			first := !o.badKey
			o.badKey = true
			o.mu.Unlock()
			if first {
				logger.Error("Config.OrderKey panicked: the message is handled without order", fmt.Errorf("panic: %v", v), watermill.LogFields{"message_uuid": msg.UUID})
			}
		}
	}()
	return o.key(msg)
}

// state returns whether k is blocked and known, or a channel to wait on first.
func (o *order) state(k orderKey) (blocked, known bool, wait chan struct{}) {
	o.mu.Lock()
	defer o.mu.Unlock()
	s, ok := o.known[k]
	if !ok {
		return false, false, nil
	}
	return s.blocked, true, s.releasing
}

// setBlocked records k blocked (since now, when news); it tells whether it is news.
func (o *order) setBlocked(k orderKey) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	s, ok := o.known[k]
	if ok && s.blocked {
		return false
	}
	if !ok {
		s = &keyState{}
		o.known[k] = s
	}
	s.blocked, s.since, s.own = true, time.Now(), true
	return true
}

// nothingBehind tells whether this process knows that nothing is behind k: it blocked
// k itself and took all it put behind it.
func (o *order) nothingBehind(k orderKey) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	s, ok := o.known[k]
	return ok && s.blocked && s.own && s.behind == 0
}

// disown records that k may have messages behind it that this process did not put
// there: its next release reads them.
func (o *order) disown(k orderKey) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if s, ok := o.known[k]; ok {
		s.own = false
	}
}

// setBehind records that a message was put behind k, blocked.
func (o *order) setBehind(k orderKey) {
	o.mu.Lock()
	defer o.mu.Unlock()
	s, ok := o.known[k]
	if !ok {
		s = &keyState{since: time.Now()}
		o.known[k] = s
	}
	s.blocked = true
	s.behind++
}

// took records that a message behind k was taken to run.
func (o *order) took(k orderKey) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if s, ok := o.known[k]; ok && s.behind > 0 {
		s.behind--
	}
}

// setClear records k not blocked; it returns how long it was, if this process knew.
func (o *order) setClear(k orderKey) time.Duration {
	o.mu.Lock()
	defer o.mu.Unlock()
	var lasted time.Duration
	if s, ok := o.known[k]; ok && s.blocked {
		lasted = time.Since(s.since)
	}
	if len(o.known) >= maxKnown {
		for k2, s := range o.known {
			if !s.blocked && s.releasing == nil {
				delete(o.known, k2)
			}
		}
	}
	o.known[k] = &keyState{}
	return lasted
}

// setReleasing marks k as being released: its next message waits for the returned
// channel to close.
func (o *order) setReleasing(k orderKey) chan struct{} {
	o.mu.Lock()
	defer o.mu.Unlock()
	s, ok := o.known[k]
	if !ok {
		s = &keyState{blocked: true, since: time.Now()}
		o.known[k] = s
	}
	s.releasing = make(chan struct{})
	return s.releasing
}

// released ends k's release, done tells whether k is no longer blocked.
func (o *order) released(k orderKey, ch chan struct{}) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if s, ok := o.known[k]; ok && s.releasing == ch {
		s.releasing = nil
	}
	close(ch)
}

// forget forgets what this process knows of queue's keys, but for releases under way:
// its subscriber (re)subscribed, and another consumer may have blocked or released
// keys meanwhile.
func (o *order) forget(queue string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for k, s := range o.known {
		if k.queue == queue && s.releasing == nil {
			delete(o.known, k)
		}
	}
}

// stats returns the blocked keys this process knows, the messages it put behind them,
// and how long the longest-blocked has been.
func (o *order) stats() (blocked, behind int64, longest time.Duration) {
	o.mu.Lock()
	defer o.mu.Unlock()
	now := time.Now()
	for _, s := range o.known {
		if s.blocked {
			blocked++
			behind += s.behind
			longest = max(longest, now.Sub(s.since))
		}
	}
	return blocked, behind, longest
}

// orderRoute deals with d, a delivery of this Retry, before its handler runs, when
// Config.OrderKey is set: a release runs the messages behind its key (its produced
// messages returned), and a message of a blocked key is put behind it; a key's head,
// and a message of a key not blocked, go on to the handler (done false), d carrying
// the key.
func (e *engine) orderRoute(h message.HandlerFunc, msg *message.Message, d *delivery) (produced []*message.Message, done bool, err error) {
	o := e.order
	if key, ok := msg.Metadata[keys.OrderRelease]; ok && len(msg.Payload) == 0 {
		d.orderKey, d.orderHead = key, true
		produced, err = e.release(h, msg, *d)
		return produced, true, err
	}
	if key, ok := msg.Metadata[keys.OrderHead]; ok && key != "" {
		// The key's head: it runs; the marker is not the handler's to forward.
		delete(msg.Metadata, keys.OrderHead)
		d.orderKey, d.orderHead, d.out = key, true, &orderOutcome{}
		return nil, false, nil
	}
	key := o.keyOf(msg, e.cfg.Logger)
	if key == "" || d.queue == "" {
		return nil, false, nil
	}
	d.orderKey, d.out = key, &orderOutcome{}
	k := orderKey{d.queue, key}
	for {
		blocked, known, wait := o.state(k)
		if wait != nil {
			select {
			case <-wait:
				continue
			case <-msg.Context().Done():
				return nil, true, fmt.Errorf("%w: queue %q: key %q is being released and the message's context ended", amqpretry.ErrHandoff, d.queue, key)
			}
		}
		if known && !blocked {
			return nil, false, nil
		}
		break
	}
	if !e.life.begin() {
		return nil, true, e.refuseClosed(msg, *d, nil)
	}
	defer e.life.end()
	put, perr := o.lines.put(msg.Context(), k, copyOf(msg))
	switch {
	case perr != nil:
		f := failure{delivery: *d, err: perr, maxAttempts: e.cfg.Policy.MaxAttempts, envelope: e.envelope(*d, perr)}
		return nil, true, e.handoffFailed(f, msg, fmt.Errorf("put the message behind key %q: %w", key, perr), backend.Cause(perr), false)
	case !put:
		o.setClear(k)
		return nil, false, nil
	}
	if e.failures.size.Load() > 0 {
		e.failures.forget(msg.UUID)
	}
	o.setBehind(k)
	return nil, true, nil
}

// orderBlock blocks f's key, whose retry was just scheduled (or which is poisoned, with
// Config.BlockOnPoison): its behind queue exists once it returns nil.
func (e *engine) orderBlock(f *failure) error {
	if f.orderKey == "" {
		return nil
	}
	o := e.order
	k := orderKey{f.queue, f.orderKey}
	if blocked, known, _ := o.state(k); known && blocked {
		return nil
	}
	if err := o.lines.block(k); err != nil {
		return fmt.Errorf("block key %q: %w", f.orderKey, err)
	}
	if o.setBlocked(k) {
		e.observe(amqpretry.Event{Kind: amqpretry.EventKeyBlocked, Queue: f.queue, Key: f.orderKey, Attempt: f.attempt, Err: f.err})
		if e.cfg.Observe == nil {
			e.cfg.Logger.Debug("Key blocked: its later messages wait behind it", watermill.LogFields{"queue": f.queue, "order_key": f.orderKey, "message_uuid": f.msg.UUID})
		}
	}
	return nil
}

// release runs the messages behind d's key, in order, through h, for trig: the key's
// head, which succeeded (or was poisoned), or a release (keys.OrderRelease). It
// returns what their handlers produced, for the router to publish with trig's. The
// messages that ran are acked once trig is acked (given back, in order, if it is
// nacked), and then, if none was left behind the key, the key is unblocked. One that
// fails is handed off as the key's new head, or poisoned, and acked at once; the key
// stays blocked behind a new head, or behind a poisoned one with Config.BlockOnPoison.
func (e *engine) release(h message.HandlerFunc, trig *message.Message, d delivery) ([]*message.Message, error) {
	o := e.order
	k := orderKey{d.queue, d.orderKey}
	if !e.life.begin() {
		return nil, e.refuseClosed(trig, d, nil)
	}
	// Nothing behind the key that this process does not know of: no need to read its
	// queue (unblock deletes it only if it is empty).
	var c cursor = noneBehind{}
	if !o.nothingBehind(k) {
		var err error
		if c, err = o.lines.open(k); err != nil {
			e.life.end()
			return nil, e.releaseFailed(trig, d, err)
		}
	}
	var produced []*message.Message
	var ran []func(ack bool) error // settled with trig
	emptied := false
	for {
		m, settle, err := c.next()
		if err != nil {
			giveBack(ran)
			c.close()
			e.life.end()
			return nil, e.releaseFailed(trig, d, err)
		}
		if m == nil {
			emptied = true
			break
		}
		o.took(k)
		fd := e.follower(m, d)
		p, herr := e.handle(h, m, fd)
		if herr != nil {
			// Its hand-off failed: it goes back in front, with those that ran, and trig
			// is nacked, to run again and release the key again.
			_ = settle(false)
			giveBack(ran)
			c.close()
			e.life.end()
			return nil, herr
		}
		if fd.out.succeeded {
			produced = append(produced, p...)
			ran = append(ran, settle)
			continue
		}
		// Handed off as the new head, or poisoned: it is no longer behind the key.
		if err := settle(true); err != nil {
			e.cfg.Logger.Error("Could not ack a message behind a key; it will run again", err, watermill.LogFields{"queue": d.queue, "order_key": d.orderKey, "message_uuid": m.UUID})
		}
		if fd.out.scheduled || o.poisonBlocks {
			break // the key stays blocked behind it
		}
	}
	done := o.setReleasing(k)
	go func() {
		defer e.life.end()
		defer o.released(k, done)
		defer c.close()
		select {
		case <-trig.Acked():
		case <-trig.Nacked():
			giveBack(ran)
			return
		case <-e.life.closing():
			giveBack(ran)
			return
		}
		var errs []error
		for _, settle := range ran {
			if err := settle(true); err != nil {
				errs = append(errs, err)
			}
		}
		if !emptied {
			return
		}
		if err := errors.Join(errs...); err != nil {
			e.cfg.Logger.Error("Could not ack the messages that ran behind a key: they will run again, and the key stays blocked until then", err, watermill.LogFields{"queue": d.queue, "order_key": d.orderKey})
			e.releaseAgain(d)
			return
		}
		ok, err := o.lines.unblock(k)
		switch {
		case err != nil || !ok:
			if err == nil {
				err = errors.New("messages are behind it again")
				o.disown(k)
			}
			e.cfg.Logger.Error("Could not unblock a key; a release is sent to run what is behind it", err, watermill.LogFields{"queue": d.queue, "order_key": d.orderKey})
			e.releaseAgain(d)
		default:
			lasted := o.setClear(k)
			e.observe(amqpretry.Event{Kind: amqpretry.EventKeyReleased, Queue: d.queue, Key: d.orderKey, Duration: lasted})
		}
	}()
	return produced, nil
}

// noneBehind is the cursor of a key known to have nothing behind it.
type noneBehind struct{}

func (noneBehind) next() (*message.Message, func(ack bool) error, error) { return nil, nil, nil }
func (noneBehind) close()                                                {}

// giveBack puts the messages that ran back in front of their key's queue, in order.
func giveBack(ran []func(ack bool) error) {
	for _, settle := range ran {
		_ = settle(false)
	}
}

// releaseFailed answers trig when the messages behind its key could not be read: it is
// nacked for redelivery, paced, to run and release the key again.
func (e *engine) releaseFailed(trig *message.Message, d delivery, err error) error {
	n := e.failures.add(trig.UUID)
	e.stats.failures.Add(1)
	e.observe(amqpretry.Event{Kind: amqpretry.EventHandoffFailed, Queue: d.queue, Attempt: d.attempt, Err: err, Cause: backend.Cause(err)})
	e.cfg.Logger.Error("Could not release a key: the message that releases it is nacked for redelivery", err, watermill.LogFields{
		"queue": d.queue, "order_key": d.orderKey, "message_uuid": trig.UUID, "handoff_failures": n})
	e.pausePaced(trig.Context(), backend.HandoffPause(n))
	return fmt.Errorf("%w: queue %q: release key %q: %w", amqpretry.ErrHandoff, d.queue, d.orderKey, err)
}

// releaseAgain sends a release of d's key to its work queue, for a release that could
// not finish: the messages left behind the key run when it comes.
func (e *engine) releaseAgain(d delivery) {
	if e.toQueue == nil {
		return
	}
	rel := message.NewMessage(watermill.NewUUID(), nil)
	rel.Metadata[keys.OrderRelease] = d.orderKey
	ctx, cancel := context.WithTimeout(context.Background(), e.cfg.ConfirmTimeout)
	defer cancel()
	if err := e.toQueue(ctx, d.queue, rel); err != nil {
		e.cfg.Logger.Error("Could not send a release of a key: it stays blocked until `amqpretry blocked release` releases it", err, watermill.LogFields{"queue": d.queue, "order_key": d.orderKey})
	}
}

// follower is the delivery of m, a message behind trig's key, read as it runs in
// trig's handler call: this Retry's, from trig's queue.
func (e *engine) follower(m *message.Message, trig delivery) delivery {
	c := &chain{Context: trig.chain.Context}
	if e.wiring.ID != "" {
		c.ids = []string{e.wiring.ID}
		m.Metadata[keys.Subscriber] = trig.msg.Metadata[keys.Subscriber]
	}
	m.SetContext(c)
	d := delivery{
		chain: c, msg: m, owned: true, owner: trig.owner, envelope: ReadEnvelope(m.Metadata),
		handler: trig.handler, topic: trig.topic, queue: trig.queue, bound: trig.bound,
		key: trig.queue, at: time.Now(), orderKey: trig.orderKey, out: &orderOutcome{}, behind: true,
	}
	d.attempt = max(d.envelope.Attempt, 1)
	c.attempt.Store(int64(d.attempt))
	return d
}
