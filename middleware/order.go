package middleware

// Order (amqpretry.Config.OrderKey): while a message of key K waits for its retry, K's
// later messages wait on the broker behind it, in order, and the other keys flow.
//
//   - A message of K that fails has its retry scheduled as K's head: the copy carries
//     keys.OrderHead (a backend that holds the failed delivery without carrying
//     anything has the copy sent to the work queue itself and held there until due:
//     selfPark), and once the retry is confirmed, K's behind queue is declared and the
//     message marked as K's head there: K is blocked (orderBlock).
//   - A message of K that arrives while K is blocked is put behind it, a confirmed
//     publish, and acked: it never reaches the handler (orderRoute).
//   - When the head succeeds (or is poisoned, unless Config.BlockOnPoison), the
//     messages behind K run in order, in the head's handler call, and K is unblocked
//     once none is left: its behind queue is deleted, at once if none ran, else after
//     the messages that ran are acked, and a release of K, sent to the work queue
//     before the head is acked, finishes it if this process dies first (release,
//     lines.guard). One that fails becomes K's head, and the rest wait on.
//   - Only K's head releases K: a copy of a message that is no longer K's head (a
//     duplicate of a head whose release ran: its ack lost with its connection, a
//     dead-letter delivered twice) is handled as any message of K, put behind K if
//     it is blocked, and a release sent for a head that is gone is dropped.
//   - In this process, K's deliveries run one at a time (hold): after a reconnection
//     the handler call of the old delivery may still run when the broker delivers the
//     queue again, and a release settles after its handler call returns.
//
// Whether K is blocked is the broker's fact: its behind queue exists; and which
// message is its head: an exchange named for it is bound to the behind queue
// (names.Names.BehindHead, deleted with it). This process caches what it learns from
// the time a work queue's subscriber (re)subscribes (Retry.Bind forgets it): a key it
// has not seen is tried by putting the message behind it, a mandatory publish the
// broker returns when K has no behind queue.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
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
	// held are the keys a delivery of this process holds (hold), each with its hold.
	held map[orderKey]*keyHold
	// badKey tells that OrderKey panicked once (logged once).
	badKey bool
}

// orderKey is an order key in a work queue.
type orderKey struct{ queue, key string }

// keyState is what this process knows of a key: blocked or not, and its head.
type keyState struct {
	blocked bool
	since   time.Time // blocked since, as this process knows
	behind  int64     // messages this process put behind it
	own     bool      // blocked by this process: nothing is behind it but what it put there
	head    string    // the UUID of its head's message, "" if unknown
}

// keyHold is a delivery's hold on its key (order.hold): the key's other deliveries wait
// until it is freed, at the end of the handler call, or, for a release, once the
// messages that ran are settled.
type keyHold struct {
	o    *order
	k    orderKey
	msg  *message.Message // the delivery holding it
	done chan struct{}    // closed when freed
	// passed tells that a release goroutine frees it (pass), not the handler call.
	passed atomic.Bool
	once   sync.Once
}

// maxKnown bounds the keys known not blocked: past it they are forgotten (and tried
// again on the broker when next seen).
const maxKnown = 100_000

// orderOutcome is what became of a message of an order key: its handler succeeded, its
// retry was scheduled (it is its key's head), or it was poisoned.
type orderOutcome struct{ succeeded, scheduled, poisoned bool }

func newOrder(cfg amqpretry.Config, l lines) *order {
	return &order{key: cfg.OrderKey, poisonBlocks: cfg.BlockOnPoison, lines: l, known: map[orderKey]*keyState{}, held: map[orderKey]*keyHold{}}
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

// hold takes k for msg's delivery, waiting while another delivery holds it: in this
// process a key's deliveries run one at a time. msg running through this Retry again
// (a middleware outside that runs the handler twice) takes nothing: nil, nil. It fails
// when msg's context ends first.
func (o *order) hold(k orderKey, msg *message.Message) (*keyHold, error) {
	for {
		o.mu.Lock()
		h, ok := o.held[k]
		if !ok {
			h = &keyHold{o: o, k: k, msg: msg, done: make(chan struct{})}
			o.held[k] = h
			o.mu.Unlock()
			return h, nil
		}
		o.mu.Unlock()
		if h.msg == msg {
			return nil, nil
		}
		select {
		case <-h.done:
		case <-msg.Context().Done():
			return nil, msg.Context().Err()
		}
	}
}

// end frees h at the end of its handler call, unless a release frees it (pass).
func (h *keyHold) end() {
	if h != nil && !h.passed.Load() {
		h.free()
	}
}

// pass hands h to a release, which frees it once the messages that ran are settled.
func (h *keyHold) pass() {
	if h != nil {
		h.passed.Store(true)
	}
}

// free lets the key's next delivery run.
func (h *keyHold) free() {
	if h == nil {
		return
	}
	h.once.Do(func() {
		h.o.mu.Lock()
		if h.o.held[h.k] == h {
			delete(h.o.held, h.k)
		}
		h.o.mu.Unlock()
		close(h.done)
	})
}

// state returns whether k is blocked, and whether this process knows.
func (o *order) state(k orderKey) (blocked, known bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	s, ok := o.known[k]
	if !ok {
		return false, false
	}
	return s.blocked, true
}

// headOf returns k's head (its message's UUID; "" when k is not blocked), and whether
// this process knows it.
func (o *order) headOf(k orderKey) (head string, known bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	s, ok := o.known[k]
	switch {
	case !ok:
		return "", false
	case !s.blocked:
		return "", true
	}
	return s.head, s.head != ""
}

// setBlocked records k blocked behind head (since now, when news); it tells whether it
// is news.
func (o *order) setBlocked(k orderKey, head string) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	s, ok := o.known[k]
	if ok && s.blocked {
		s.head = head
		return false
	}
	if !ok {
		s = &keyState{}
		o.known[k] = s
	}
	s.blocked, s.since, s.own, s.head = true, time.Now(), true, head
	return true
}

// setHead records head as k's head, k blocked, as the broker said.
func (o *order) setHead(k orderKey, head string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	s, ok := o.known[k]
	if !ok {
		s = &keyState{since: time.Now()}
		o.known[k] = s
	}
	s.blocked, s.head = true, head
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
			if _, held := o.held[k2]; !s.blocked && !held {
				delete(o.known, k2)
			}
		}
	}
	o.known[k] = &keyState{}
	return lasted
}

// forget forgets what this process knows of queue's keys, but for those a delivery
// holds: its subscriber (re)subscribed, and another consumer may have blocked or
// released keys meanwhile.
func (o *order) forget(queue string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for k := range o.known {
		if _, held := o.held[k]; k.queue == queue && !held {
			delete(o.known, k)
		}
	}
}

// drop forgets what this process knows of k: the broker is asked next time.
func (o *order) drop(k orderKey) {
	o.mu.Lock()
	defer o.mu.Unlock()
	delete(o.known, k)
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

// isHead tells whether head (a message's UUID) is k's head: as this process knows, or
// as the broker says (then remembered).
func (e *engine) isHead(k orderKey, head string) (bool, error) {
	if cur, known := e.order.headOf(k); known {
		return cur == head, nil
	}
	is, err := e.order.lines.isHead(k, head)
	if err != nil {
		return false, err
	}
	if is {
		e.order.setHead(k, head)
	}
	return is, nil
}

// orderRoute deals with d, a delivery of this Retry, before its handler runs, when
// Config.OrderKey is set. It holds d's key (hold; d.hold, freed by the caller unless a
// release frees it). A release runs the messages behind its key (its produced messages
// returned), unless it names a head that is no longer the key's (dropped); a message
// of a blocked key is put behind it, and so is a copy of a message that is no longer
// its key's head; the key's head, and a message of a key not blocked, go on to the
// handler (done false), d carrying the key.
func (e *engine) orderRoute(h message.HandlerFunc, msg *message.Message, d *delivery) (produced []*message.Message, done bool, err error) {
	o := e.order
	release, isRelease := msg.Metadata[keys.OrderRelease]
	isRelease = isRelease && len(msg.Payload) == 0
	headKey, isHead := msg.Metadata[keys.OrderHead]
	isHead = isHead && headKey != "" && !isRelease
	var key string
	switch {
	case isRelease:
		key = release
	case isHead:
		// The marker is not the handler's to forward.
		key = headKey
		delete(msg.Metadata, keys.OrderHead)
	default:
		key = o.keyOf(msg, e.cfg.Logger)
	}
	if key == "" || d.queue == "" {
		return nil, false, nil
	}
	k := orderKey{d.queue, key}
	if d.hold, err = o.hold(k, msg); err != nil {
		return nil, true, fmt.Errorf("%w: queue %q: another delivery of key %q runs, and the message's context ended: %w", amqpretry.ErrHandoff, d.queue, key, err)
	}
	d.orderKey, d.out = key, &orderOutcome{}
	switch {
	case isRelease:
		d.orderHead, d.headID = true, msg.Metadata[keys.OrderReleaseHead]
		if d.headID != "" {
			is, err := e.isHead(k, d.headID)
			if err != nil {
				return nil, true, e.releaseFailed(msg, *d, fmt.Errorf("tell whether %s is the head of key %q: %w", d.headID, key, err))
			}
			if !is {
				// Sent for a head that is gone (its key released, or another head):
				// the messages behind the key are its current head's to release.
				e.cfg.Logger.Debug("Release of a key for a head that is no longer its head: dropped", watermill.LogFields{"queue": d.queue, "order_key": key, "head": d.headID, "message_uuid": msg.UUID})
				return nil, true, nil
			}
		}
		produced, err = e.release(h, msg, *d)
		return produced, true, err
	case isHead:
		is, err := e.isHead(k, msg.UUID)
		if err != nil {
			f := failure{delivery: *d, err: err, maxAttempts: e.cfg.Policy.MaxAttempts, envelope: e.envelope(*d, err)}
			return nil, true, e.handoffFailed(f, msg, fmt.Errorf("tell whether message %s is the head of key %q: %w", msg.UUID, key, err), backend.Cause(err), false)
		}
		if is {
			d.orderHead, d.headID = true, msg.UUID
			return nil, false, nil
		}
		// A copy of a message that is no longer its key's head: it ran, and its key
		// was released since (or waits behind another head). It runs as any message
		// of its key: behind it, if it is blocked.
		e.cfg.Logger.Debug("Copy of a message that is no longer its key's head: it waits behind its key like any message", watermill.LogFields{"queue": d.queue, "order_key": key, "message_uuid": msg.UUID})
	}
	if blocked, known := o.state(k); known && !blocked {
		return nil, false, nil
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

// orderBlock blocks f's key behind f's message, its new head, whose retry was just
// scheduled (or which is poisoned, with Config.BlockOnPoison): its behind queue exists
// and the message is marked as its head once it returns nil. A message that ran behind
// the key replaces the head it ran behind (f.headID).
func (e *engine) orderBlock(f *failure) error {
	if f.orderKey == "" {
		return nil
	}
	o := e.order
	k := orderKey{f.queue, f.orderKey}
	head := f.msg.UUID
	if cur, known := o.headOf(k); known && cur == head {
		return nil
	}
	prev := ""
	if f.behind {
		prev = f.headID
	}
	if err := o.lines.block(k, head, prev); err != nil {
		return fmt.Errorf("block key %q: %w", f.orderKey, err)
	}
	if o.setBlocked(k, head) {
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
// fails is handed off as the key's new head (or poisoned), and settled with them: if
// trig is nacked, it goes back behind the key in its place, and trig's head is the
// key's head again. The key stays blocked behind a new head, or behind a poisoned one
// with Config.BlockOnPoison. d's hold on the key is freed once all that is done.
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
	emptied, newHead := false, ""
	for {
		m, settle, err := c.next()
		if err != nil {
			o.giveBack(k, ran)
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
			ran = append(ran, settle)
			o.giveBack(k, ran)
			c.close()
			e.life.end()
			return nil, herr
		}
		// Settled with trig, whatever became of it: if trig runs again, it runs again
		// in its place (a message behind the key acked before trig, handed off as the
		// new head, would be overtaken by the next when trig runs again).
		ran = append(ran, settle)
		if fd.out.succeeded {
			produced = append(produced, p...)
			continue
		}
		// Handed off as the new head, or poisoned: it is no longer behind the key.
		if fd.out.scheduled || o.poisonBlocks {
			newHead = m.UUID
			break // the key stays blocked behind it
		}
	}
	if newHead == "" && emptied && len(ran) == 0 {
		// Nothing ran behind the key: it is unblocked now, before trig is settled. If
		// trig is nacked, it runs again as a message of a key not blocked.
		if ok, err := o.lines.unblock(k, d.headID); err == nil && ok {
			c.close()
			e.life.end()
			e.unblocked(k, d)
			return nil, nil
		}
	}
	if newHead == "" && d.headID != "" {
		// The key is unblocked once trig is acked. A process that dies in between
		// (trig acked, not yet what ran, nor the key's queue deleted) leaves the key
		// blocked behind a head that is gone: a release of the key, sent now, runs
		// what is left behind it then (dropped when it comes once the key is
		// released).
		if err := o.lines.guard(trig.Context(), k, d.headID); err != nil {
			o.giveBack(k, ran)
			c.close()
			e.life.end()
			return nil, e.releaseFailed(trig, d, fmt.Errorf("send a release of key %q: %w", d.orderKey, err))
		}
	}
	hold := d.hold
	hold.pass()
	go func() {
		defer e.life.end()
		again := e.settleRelease(k, trig, d, c, ran, emptied, newHead)
		// Freed before a release is sent: in process (a GoChannel that waits for
		// the subscriber's ack) the release runs before the publish returns.
		hold.free()
		if again {
			e.releaseAgain(k, d)
		}
	}()
	return produced, nil
}

// settleRelease settles a release once trig is settled: the messages that ran are
// acked with trig and the key unblocked if none was left behind it, or given back
// (unrelease) if trig is nacked. It tells whether a release must be sent again: the
// messages that ran could not be acked, or messages are behind the key again.
func (e *engine) settleRelease(k orderKey, trig *message.Message, d delivery, c cursor, ran []func(ack bool) error, emptied bool, newHead string) (again bool) {
	o := e.order
	defer c.close()
	select {
	case <-trig.Acked():
	case <-trig.Nacked():
		e.unrelease(k, d, newHead, ran)
		return false
	case <-e.life.closing():
		e.unrelease(k, d, newHead, ran)
		return false
	}
	var errs []error
	for _, settle := range ran {
		if err := settle(true); err != nil {
			errs = append(errs, err)
		}
	}
	if !emptied {
		if err := errors.Join(errs...); err != nil {
			e.cfg.Logger.Error("Could not ack the messages that ran behind a key; they will run again behind its head", err, watermill.LogFields{"queue": d.queue, "order_key": d.orderKey})
		}
		return false
	}
	if err := errors.Join(errs...); err != nil {
		e.cfg.Logger.Error("Could not ack the messages that ran behind a key: they will run again, and the key stays blocked until then", err, watermill.LogFields{"queue": d.queue, "order_key": d.orderKey})
		return true
	}
	ok, err := o.lines.unblock(k, d.headID)
	if err != nil || !ok {
		if err == nil {
			err = errors.New("messages are behind it again")
			o.disown(k)
		}
		e.cfg.Logger.Error("Could not unblock a key; a release is sent to run what is behind it", err, watermill.LogFields{"queue": d.queue, "order_key": d.orderKey})
		return true
	}
	e.unblocked(k, d)
	return false
}

// unblocked records d's key unblocked.
func (e *engine) unblocked(k orderKey, d delivery) {
	lasted := e.order.setClear(k)
	e.observe(amqpretry.Event{Kind: amqpretry.EventKeyReleased, Queue: d.queue, Key: d.orderKey, Duration: lasted})
}

// unrelease undoes a release whose trig was nacked (or which the Retry's Close
// interrupted): the messages that ran go back behind the key, in order, and, if one
// of them had become the key's head (newHead), trig's head is the key's head again,
// so that trig releases the key when it runs again.
func (e *engine) unrelease(k orderKey, d delivery, newHead string, ran []func(ack bool) error) {
	e.order.giveBack(k, ran)
	if newHead == "" || d.headID == "" || newHead == d.headID {
		return
	}
	if err := e.order.lines.block(k, d.headID, newHead); err != nil {
		e.cfg.Logger.Error("Could not mark a key's head again after its release was undone: when it runs again it waits behind the key", err, watermill.LogFields{"queue": d.queue, "order_key": d.orderKey, "head": d.headID})
		e.order.drop(k)
		return
	}
	e.order.setBlocked(k, d.headID)
}

// noneBehind is the cursor of a key known to have nothing behind it.
type noneBehind struct{}

func (noneBehind) next() (*message.Message, func(ack bool) error, error) { return nil, nil, nil }
func (noneBehind) close()                                                {}

// giveBack puts the messages that ran back in front of k's queue, in order. What
// this process counted behind k no longer holds: its next release reads the queue.
func (o *order) giveBack(k orderKey, ran []func(ack bool) error) {
	for _, settle := range ran {
		_ = settle(false)
	}
	if len(ran) > 0 {
		o.disown(k)
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

// releaseOf is a release of k behind head, for k's work queue: an empty message that
// runs what is behind k when it comes, if head is still k's head.
func releaseOf(k orderKey, head string) *message.Message {
	rel := message.NewMessage(watermill.NewUUID(), nil)
	rel.Metadata[keys.OrderRelease] = k.key
	rel.Metadata[keys.OrderReleaseHead] = head
	return rel
}

// releaseAgain sends a release of k to its work queue, for a release that could not
// finish: the messages left behind k run when it comes.
func (e *engine) releaseAgain(k orderKey, d delivery) {
	if e.toQueue == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), backend.DefaultConfirmTimeout)
	defer cancel()
	if err := e.toQueue(ctx, k.queue, releaseOf(k, d.headID)); err != nil {
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
		key: trig.queue, at: time.Now(), orderKey: trig.orderKey, out: &orderOutcome{}, behind: true, headID: trig.headID,
	}
	d.attempt = max(d.envelope.Attempt, 1)
	c.attempt.Store(int64(d.attempt))
	return d
}
