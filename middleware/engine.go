package middleware

// The engine: the middleware's handler closure. It reads a delivery once, on receipt
// (read: the envelope it carries included, ReadEnvelope in envelope.go, the Retry
// middlewares it passes through and the attempt, its chain in the message's context),
// runs the handler (run: a panic recovered as a failure), with Policy.Immediate's
// retries in this process, and hands a failure to the failure path (copy.go: decide,
// size, stamp, park; or hold, hold.go), while the engine is open (lifecycle.go). A
// first delivery carries no envelope: reading it costs one pass over its metadata. A
// message seen before (a retry back before it is due, one whose poisoning is pending)
// is dealt with before the handler runs (hold.go, repark.go, poison.go).

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/ctxkey"
	"github.com/amqpretry/amqpretry/internal/keys"
	"github.com/amqpretry/amqpretry/internal/marshal"
)

// engine is the middleware. start builds it.
type engine struct {
	cfg     amqpretry.Config // with defaults
	backend *kept            // parks copies: nil when a holder takes every retry
	holder  *kept            // holds retries (backend.Holder): the first heldRetries, or every one; nil for none
	// heldRetries is how many retries, from the first, the work queue holds in front
	// of backend (delay.HeldRetries); 0 for none.
	heldRetries int
	poisonQ     func(ctx context.Context, msg *message.Message) error
	wiring      wiring

	failures failureCounts
	// handoffLimit is how many hand-offs of a message may fail in a row before it is
	// poisoned (handoffAttempts): 0 for backend.HandoffAttempts.
	handoffLimit int
	// debug tells whether the logger may write DEBUG lines (debugs).
	debug bool
	held  heldRetries
	stats struct{ retries, poisoned, failures atomic.Int64 }

	// reads records the subscriber marks this engine read a message of, for the
	// subscribers' marshalers (marshal.Reads); nil in-process.
	reads *marshal.Reads

	outages *outages // nil when detection is off (Config.Outage.Consecutive < 0)
	order   *order   // nil without Config.OrderKey
	// toQueue publishes a message to a work queue, confirmed: a key's head copy on a
	// holder that carries nothing (selfPark), and a release that could not finish.
	// Nil in-process.
	toQueue func(ctx context.Context, queue string, msg *message.Message) error
	dedup   *dedup // nil when Config.Dedup is 0
	// givenBack counts, by UUID, the deliveries given back to the broker unhandled
	// (nacked after a failed hand-off, at Close, in an outage; set aside): for
	// amqpretry.DedupKey, which tells such a redelivery from a duplicate.
	givenBack failureCounts
	// sent are the retries scheduled, until their first delivery; arrivals, those
	// delivered that have not reached the engine yet; droppedSaid, that one dropped
	// was logged (dedup.go).
	sent        sentRetries
	arrivals    arrivals
	droppedSaid atomic.Bool
	// around: what this Retry saw of the middlewares around it (around.go).
	around  around
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
	name string
	// constant: it holds every retry for one delay, caps.Longest (backend.Constant).
	constant bool
}

// keep reads b's caps and name once; nil for none.
func keep(b backend.Backend) *kept {
	if b == nil {
		return nil
	}
	_, constant := b.(backend.Constant)
	return &kept{Backend: b, caps: b.Caps(), name: b.Name(), constant: constant}
}

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

// delivery is what the engine reads of a message once, when it arrives.
type delivery struct {
	msg      *message.Message
	chain    *chain // msg's context, where this Retry has joined
	owned    bool
	owner    string
	attempt  int
	envelope Envelope
	handler  string
	topic    string
	queue    string
	bound    bool   // queue's way back was bound by this Retry's subscriber (wiring.resolve)
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
	// (keys.ParkUntil), to be re-parked until then; zero for any other.
	parkedUntil time.Time
	// orderKey is the message's order key (Config.OrderKey), "" for none; orderHead
	// tells that the message is its key's head (a retry, or a release); out records
	// what became of a message with a key.
	orderKey  string
	orderHead bool
	out       *orderOutcome
	// behind tells that the message was taken from behind its key (release): it is
	// no delivery of its work queue, which a holder could settle.
	behind bool
	// hold is this delivery's hold on its order key (order.hold), nil for none.
	hold *keyHold
	// headID is the key's head (its message's UUID) that a release runs for: a
	// head's own, the head a release names, "" for an operator's release. A message
	// behind the key that fails replaces it as the head.
	headID string
	// ackedOnEntry: a middleware outside acked the message before this Retry ran
	// (Watermill's InstantAck).
	ackedOnEntry bool
	// ctx is the message's context when this Retry got it.
	ctx context.Context
}

// read reads msg on receipt, and records this Retry among the middlewares msg passes
// through (its chain). A retry this process held comes back without its envelope: the
// one remembered when it was held is written back into its metadata, so that the
// handler reads it as on a copy.
func (e *engine) read(msg *message.Message) delivery {
	// The chain: msg's, or a new one wrapping its context, read before; this Retry
	// joins it.
	ctx := msg.Context()
	c, _ := ctx.Value(ctxkey.Chain{}).(*chain)
	if c == nil {
		c = &chain{Context: ctx}
		msg.SetContext(c)
	} else if c.flags.Load()&chainPass != 0 {
		// Another pass (a middleware outside runs the delivery again): what the
		// handler did is told anew.
		c.flags.And(^chainPass)
	}
	// The first delivery of a retry this engine scheduled: known when its subscriber
	// delivered it (Delivered), or here in-process, where no subscriber calls Delivered.
	if e.wiring.ID == "" {
		if e.arrive(msg, false) {
			c.set(chainRetry)
		}
	} else if e.arrivals.size.Load() > 0 && e.arrivals.reach(msg) {
		c.set(chainRetry)
	}
	if e.wiring.ID != "" {
		c.mu.Lock()
		c.ids = append(c.ids, e.wiring.ID)
		c.mu.Unlock()
	}
	d := delivery{
		chain:    c,
		ctx:      msg.Context(),
		msg:      msg,
		envelope: ReadEnvelope(msg.Metadata),
		handler:  message.HandlerNameFromCtx(ctx),
		topic:    message.SubscribeTopicFromCtx(ctx),
		exchange: msg.Metadata[keys.DeliveryExchange],
		key:      msg.Metadata[keys.DeliveryRoutingKey],
		at:       time.Now(),
	}
	mark := msg.Metadata[keys.Subscriber]
	e.reads.Read(mark)
	d.owner, d.queue, d.bound = e.wiring.resolve(mark, d.topic)
	d.owned = e.wiring.ID == "" || d.owner == e.wiring.ID
	if v, ok := msg.Metadata[keys.ParkUntil]; ok {
		d.parkedUntil, _ = time.Parse(timeLayout, v) // zero when unreadable
	}
	remembered := false // the envelope is the one kept when it was held
	var h heldRetry
	ok := false
	if e.holder != nil && e.held.size.Load() > 0 { // only a backend that holds retries leaves any
		h, ok = e.held.take(d.queue, msg.UUID)
	}
	if ok && d.owned {
		d.held, d.heldDue, d.heldUntil, d.rehelds, d.early = true, h.due, h.until, h.rehelds, h.early
		d.backEarly = e.holder.constant && d.at.Sub(h.due) < -e.holder.caps.Longest/2
		if !h.env.FirstFailure.IsZero() {
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
	c.attempt.Store(int64(d.attempt))
	return d
}

// mark is the keys.Subscriber value of Retry id's subscriber whose queue-name
// function is number fn.
func mark(id string, fn int) string {
	if fn == 0 {
		return id
	}
	return id + "/" + strconv.Itoa(fn)
}

// resolve reads a delivery's subscriber mark v (keys.Subscriber: mark's "<ID>" or
// "<ID>/<n>") as it arrives on topic: the Retry whose subscriber delivered it, the
// queue it came from ("" for a number never registered; a message of another Retry is
// resolved with Queue), and whether that queue's way back was bound by this Retry's
// subscriber (true when Bound is nil: not checked). One call, on receipt: the failure
// path reads the answers from the delivery.
func (w *wiring) resolve(v, topic string) (owner, queue string, bound bool) {
	owner, fn := v, 0
	if id, n, ok := strings.Cut(v, "/"); ok {
		if i, err := strconv.Atoi(n); err == nil && i >= 1 {
			owner, fn = id, i
		}
	}
	if w.ID != "" && owner != w.ID {
		fn = 0 // another Retry's function
	}
	switch fs := w.more.fs.Load(); {
	case fn == 0:
		queue = w.Queue(topic)
	case fs != nil && fn <= len(*fs):
		queue = (*fs)[fn-1](topic)
	}
	bound = true
	if s := w.Bound; s != nil {
		s.mu.Lock()
		bound = s.m[queue]
		s.mu.Unlock()
	}
	return owner, queue, bound
}

// chain is the record of a delivery in its message's context, shared by every
// middleware of the handler: the Retry middlewares (by wiring.ID) it passes through,
// so that an outer one sees the inner ones after the handler returns, and the attempt
// the handler runs (amqpretry.AttemptFromContext), written by the Retry nearest the
// handler last. It is the context itself, under ctxkey.Chain: one allocation per
// delivery.
type chain struct {
	context.Context
	mu      sync.Mutex
	ids     []string
	attempt atomic.Int64
	// flags: chainRetry, chainExpect, chainRan, ... (one word: the chain stays in its
	// allocation size class).
	flags atomic.Uint32
}

const (
	// chainRetry: the delivery is the first of a retry the engine scheduled (arrive,
	// dedup.go).
	chainRetry uint32 = 1 << iota
	// chainExpect: the handler added through AddHandler is under this Retry;
	// chainRan: it ran (ExpectHandler, HandlerRan).
	chainExpect
	chainRan
	// chainFailed: the handler added through AddHandler returned an error;
	// chainNoRerun: the last one was marked Permanent or RetryAfter; chainRerun: it
	// ran again after such an error, in this delivery (HandlerFailed, around.go).
	chainFailed
	chainNoRerun
	chainRerun
	// chainSettled: a Retry handed the delivery off or poisoned it: a second pass
	// through a Retry (a middleware outside it running the delivery again) does
	// nothing (around.go).
	chainSettled
)

// chainPass is what a pass through the Retry records of the handler's runs.
const chainPass = chainRan | chainFailed | chainNoRerun | chainRerun

func (c *chain) set(f uint32)     { c.flags.Or(f) }
func (c *chain) is(f uint32) bool { return c.flags.Load()&f != 0 }

func (c *chain) Value(key any) any {
	if key == (ctxkey.Chain{}) {
		return c
	}
	return c.Context.Value(key)
}

// Attempt is the attempt the handler runs (amqpretry.AttemptFromContext).
func (c *chain) Attempt() int { return int(c.attempt.Load()) }

// ExpectHandler, HandlerRan and HandlerFailed are called by the handler a transport's
// AddHandler adds: the first by a middleware just inside the Retry's, the others by
// the handler itself, before it runs and when it fails, so that the Retry tells a
// retry acked without its handler running, and sees what the middlewares between did
// (around.go).
func (c *chain) ExpectHandler() { c.set(chainExpect) }
func (c *chain) HandlerRan() {
	if c.is(chainNoRerun) {
		c.set(chainRerun)
	}
	c.set(chainRan)
}

// inChain tells whether the Retry id is among the middlewares msg passes through.
func inChain(msg *message.Message, id string) bool {
	c, _ := msg.Context().Value(ctxkey.Chain{}).(*chain)
	if c == nil {
		return false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Contains(c.ids, id)
}

// Middleware implements message.HandlerMiddleware.
func (e *engine) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		d := e.read(msg)
		if d.chain.is(chainSettled) {
			// Run through again by a middleware outside (Watermill's Duplicator, or
			// Retry) after it was handed off or poisoned: once is enough.
			return nil, nil
		}
		if d.ackedOnEntry = acked(msg); d.ackedOnEntry {
			e.ackedBefore(d)
		}
		if d.owned {
			if d.held && e.holdAgain(msg, d) {
				return nil, nil
			}
			if d.at.Before(d.parkedUntil) {
				// Parked for a delay longer than the backend keeps: not due yet.
				if !e.life.begin() {
					return nil, e.refuseClosed(msg, d, nil)
				}
				defer e.life.end()
				if e.backend == nil {
					return nil, e.holdUntil(msg, d)
				}
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
			if e.order != nil {
				produced, done, err := e.orderRoute(h, msg, &d)
				defer d.hold.end() // unless a release frees it
				if done {
					return produced, err
				}
			}
			if e.cfg.Observe != nil || d.backEarly {
				e.observeDelivery(d)
			}
		}
		produced, err := e.handle(h, msg, d)
		if d.orderHead && err == nil && (d.out.succeeded || (d.out.poisoned && !e.order.poisonBlocks)) {
			// The key's head is done with: the messages behind it run.
			behind, rerr := e.release(h, msg, d)
			if rerr != nil {
				return nil, rerr
			}
			produced = append(produced, behind...)
		}
		return produced, err
	}
}

// handle runs h on msg, delivered as d, with Policy.Immediate's retries in this
// process, and deals with its failure (fail). What became of a message with an order
// key is recorded in d.out.
func (e *engine) handle(h message.HandlerFunc, msg *message.Message, d delivery) ([]*message.Message, error) {
	handler, key := h, ""
	var dup *bool // the handler was not run: a duplicate (with Config.Dedup only)
	if e.dedup != nil && d.owned && d.queue != "" {
		key, dup = dedupKey(d), new(bool)
		handler = e.dedup.handler(h, key, dup)
	}
	// decided is err's decision, once classified (Classify runs once per failure).
	produced, decided, err := e.runHandler(handler, msg, d)
	// A middleware inside (Watermill's Timeout) may have set a context of its own,
	// done by now: the pauses from here on are the delivery's.
	msg.SetContext(d.ctx)
	if !d.ackedOnEntry && acked(msg) {
		e.ackedInside(d)
	}
	run, attempt := msg, d.attempt
	// Immediate retries follow a failure of the message's first delivery only.
	first := d.attempt <= 1
	for err != nil && first && attempt <= e.cfg.Policy.Immediate {
		var again bool
		if again, decided = e.retryNow(d, run, attempt, err, decided); !again {
			break
		}
		d.chain.flags.And(^chainNoRerun) // this rerun is the Retry's own
		next := run.Copy()
		next.SetContext(marshal.CopyContext(run)) // typed headers as read
		attempt++
		next.Metadata[keys.Attempt] = strconv.Itoa(attempt)
		d.chain.attempt.Store(int64(attempt)) // next's context is msg's: the same chain
		run = next
		d.attempt = attempt
		produced, decided, err = e.runHandler(handler, run, d)
	}
	if err == nil {
		if e.failures.size.Load() > 0 {
			e.failures.forget(msg.UUID)
		}
		if e.givenBack.size.Load() > 0 {
			e.givenBack.forget(msg.UUID)
		}
		if d.out != nil {
			d.out.succeeded = true
		}
		if dup != nil && *dup {
			e.dedup.duplicates.Add(1)
			e.cfg.Logger.Debug("Duplicate of a message handled before: acked, the handler not run", watermill.LogFields{
				"message_uuid": msg.UUID, "queue": d.queue, "handler": d.handler, "attempt": attempt})
			return nil, nil
		}
		if key != "" {
			e.record(d, key)
		}
		if d.chain.is(chainRetry) && d.chain.is(chainExpect) && !d.chain.is(chainRan) {
			e.dropped(msg, d.queue, attempt, "inside the Retry (a handler middleware added after it)")
		}
		if d.chain.is(chainFailed) {
			e.swallowed(d)
		}
		if d.owned {
			e.observe(amqpretry.Event{Kind: amqpretry.EventSucceeded, Queue: d.queue, Attempt: attempt})
		}
		return produced, nil
	}
	d.attempt = attempt
	if errors.Is(err, amqpretry.ErrHandoff) {
		return nil, err // a Retry nearer the handler has dealt with it
	}
	if d.chain.is(chainRerun) {
		e.rerun(d, err)
	}
	if !e.life.begin() {
		return nil, e.refuseClosed(msg, d, err)
	}
	defer e.life.end()
	if ferr := e.fail(msg, run, d, err, decided); ferr != nil {
		return nil, ferr
	}
	d.chain.set(chainSettled)
	return nil, nil
}

// retryNow tells whether run, which failed with err on attempt (within
// Policy.Immediate), gets an immediate in-process retry: on its first delivery, within
// MaxAttempts, if it is this Retry's and its error asks for no delay, is not permanent
// and, with outage detection on, says no dependency is down (Unavailable: the queue's
// outage deals with it, not a rerun). decided is err's decision if classified already;
// it returns the decision when it classified err, so that Classify runs once per
// failure.
func (e *engine) retryNow(d delivery, run *message.Message, attempt int, err error, decided *amqpretry.Decision) (bool, *amqpretry.Decision) {
	if attempt >= e.cfg.Policy.MaxAttempts || !d.owned || errors.Is(err, amqpretry.ErrHandoff) {
		return false, decided
	}
	if decided == nil {
		dec := e.decide(run, err, attempt)
		decided = &dec
	}
	return !decided.Permanent && decided.Delay <= 0 && (!decided.Unavailable || e.outages == nil), decided
}
