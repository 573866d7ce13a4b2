package middleware

// Deduplication (amqpretry.Config.Dedup): a message is remembered once its handler has
// succeeded, or it was poisoned, never when it fails, so that a duplicate of it is
// acked without running the handler again and a retry always runs. The check runs in
// the handler's place (dedupHandler), inside runHandler: a store that fails is a
// failure marked Unavailable, which the work queue's outage waits out.
//
// And the retries this Retry scheduled that never reached their handler (a middleware
// dropped them: Watermill's Deduplicator does, recording a key before the handler runs
// and keeping it when the handler fails), said once at ERROR: the retries scheduled
// are remembered by UUID (sentRetries); the first delivery of each is watched from its
// arrival (arrive), and reported if it was acked without reaching this Retry (sweep)
// or if the handler added through AddHandler did not run under it (dropped).

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/keys"
)

// dedup is Config.Dedup's state: where it remembers, for how long.
type dedup struct {
	store      amqpretry.DedupStore
	keep       time.Duration
	inMemory   bool
	timeout    time.Duration // bounds each call to a store of the user's
	duplicates atomic.Int64
}

// newDedup returns cfg's dedup (with defaults): nil when off.
func newDedup(cfg amqpretry.Config) *dedup {
	if cfg.Dedup <= 0 {
		return nil
	}
	d := &dedup{store: cfg.DedupStore, keep: cfg.Dedup, timeout: backend.DefaultConfirmTimeout}
	if d.store == nil {
		d.store, d.inMemory = newMemoryDedup(maxRemembered), true
	}
	return d
}

// maxRemembered bounds the in-memory store: about 15 MB of keys.
const maxRemembered = 100_000

// dedupKey is the key d's message is remembered by: its work queue, its UUID, and its
// redrives (a message redriven from the poison queue runs again).
func dedupKey(d delivery) string {
	k := d.queue + "/" + d.msg.UUID
	if d.envelope.Redriven > 0 {
		k += "/r" + strconv.Itoa(d.envelope.Redriven)
	}
	return k
}

// bounded returns ctx bounded by the store's timeout, for a store of the user's; the
// in-memory store answers at once.
func (dd *dedup) bounded(ctx context.Context) (context.Context, context.CancelFunc) {
	if dd.inMemory {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, dd.timeout)
}

// handler returns h, run only when key was not recorded; *dup tells that it was not
// run for that reason.
func (dd *dedup) handler(h message.HandlerFunc, key string, dup *bool) message.HandlerFunc {
	return func(m *message.Message) ([]*message.Message, error) {
		ctx, cancel := dd.bounded(m.Context())
		seen, err := dd.store.Seen(ctx, key)
		cancel()
		if err != nil {
			return nil, amqpretry.Unavailable(fmt.Errorf("dedup store: %w (the message is not run until the store answers)", err))
		}
		if seen {
			*dup = true
			return nil, nil
		}
		return h(m)
	}
}

// record remembers key for the message handled (or poisoned) whose delivery is d. A
// store that fails is logged: the message is acked all the same, and a duplicate of it
// would run again.
func (e *engine) record(d delivery, key string) {
	dd := e.dedup
	ctx, cancel := dd.bounded(context.WithoutCancel(d.msg.Context()))
	err := dd.store.Record(ctx, key, time.Now().Add(dd.keep))
	cancel()
	if err != nil {
		e.cfg.Logger.Error("Could not record a handled message in the dedup store: a duplicate of it would run again", err, watermill.LogFields{
			"message_uuid": d.msg.UUID, "queue": d.queue, "handler": d.handler})
	}
}

// memoryDedup is the default DedupStore: this process's memory, up to max keys, the
// oldest recorded forgotten first.
type memoryDedup struct {
	mu    sync.Mutex
	until map[string]time.Time
	order []remembered // in the order recorded, from head
	head  int
	max   int
}

type remembered struct {
	key   string
	until time.Time
}

func newMemoryDedup(n int) *memoryDedup {
	return &memoryDedup{until: map[string]time.Time{}, max: n}
}

func (m *memoryDedup) Seen(_ context.Context, key string) (bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	t, ok := m.until[key]
	return ok && time.Now().Before(t), nil
}

func (m *memoryDedup) Record(_ context.Context, key string, until time.Time) error {
	now := time.Now()
	m.mu.Lock()
	defer m.mu.Unlock()
	m.until[key] = until
	m.order = append(m.order, remembered{key, until})
	for m.head < len(m.order) {
		r := m.order[m.head]
		if len(m.order)-m.head <= m.max && now.Before(r.until) {
			break
		}
		if t, ok := m.until[r.key]; ok && t.Equal(r.until) { // else recorded again since
			delete(m.until, r.key)
		}
		m.order[m.head] = remembered{}
		m.head++
	}
	if m.head > 1024 && m.head*2 > len(m.order) {
		m.order = append(m.order[:0], m.order[m.head:]...)
		m.head = 0
	}
	return nil
}

// sentRetries remembers, by message UUID, the attempt of the retries this engine
// scheduled, until their first delivery (take). It forgets everything when it would
// track more than maxTracked.
type sentRetries struct {
	mu   sync.Mutex
	m    map[string]int
	size atomic.Int64
}

func (s *sentRetries) add(uuid string, attempt int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m == nil || len(s.m) >= maxTracked {
		s.m = map[string]int{}
	}
	s.m[uuid] = attempt
	s.size.Store(int64(len(s.m)))
}

// take tells whether msg is the first delivery of a retry scheduled, and forgets it.
// The engine asks only when size is not zero.
func (s *sentRetries) take(msg *message.Message) bool {
	attempt := amqpretry.Attempt(msg)
	s.mu.Lock()
	defer s.mu.Unlock()
	a, ok := s.m[msg.UUID]
	if !ok || a != attempt {
		return false
	}
	delete(s.m, msg.UUID)
	s.size.Store(int64(len(s.m)))
	return true
}

// arrivals are the first deliveries of retries scheduled that have not reached this
// engine yet (the message, which is the one the router hands the middleware; its
// context is not: watermill-amqp sets a new one): one acked before it does was dropped
// by a middleware outside it (sweep).
type arrivals struct {
	mu   sync.Mutex
	list []*message.Message
	size atomic.Int64
}

// maxArrivals bounds the arrivals watched; past it the oldest is no longer watched.
const maxArrivals = 1024

// arrive is called once per delivery, when its subscriber delivers it (Delivered) or,
// in-process, when the engine reads it (then not watched): it writes into msg's
// metadata the times this engine gave msg back to the broker unhandled
// (keys.GivenBack, read by amqpretry.DedupKey), and tells whether msg is the first
// delivery of a retry this engine scheduled, then watched until it reaches the engine.
func (e *engine) arrive(msg *message.Message, watch bool) bool {
	if e.givenBack.size.Load() > 0 {
		if n := e.givenBack.count(msg.UUID); n > 0 {
			msg.Metadata[keys.GivenBack] = strconv.Itoa(n)
		}
	}
	if e.sent.size.Load() == 0 || !e.sent.take(msg) {
		return false
	}
	if watch {
		e.arrivals.mu.Lock()
		if len(e.arrivals.list) >= maxArrivals {
			e.arrivals.list = e.arrivals.list[1:]
		}
		e.arrivals.list = append(e.arrivals.list, msg)
		e.arrivals.size.Store(int64(len(e.arrivals.list)))
		e.arrivals.mu.Unlock()
	}
	return true
}

// reach tells whether msg is a watched arrival, and stops watching it: it reached the
// engine. The engine asks only when size is not zero.
func (a *arrivals) reach(msg *message.Message) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	for i, m := range a.list {
		if m == msg {
			a.list = slices.Delete(a.list, i, i+1)
			a.size.Store(int64(len(a.list)))
			return true
		}
	}
	return false
}

// sweep reports a watched retry that was acked without reaching the engine, and stops
// watching those settled. Where messages are acked before they reach the engine
// (Watermill's InstantAck outside it, around.go), one acked may still be on its way:
// it is reported only by the final sweep, at Close, after the router's.
func (e *engine) sweep(final bool) {
	if e.arrivals.size.Load() == 0 {
		return
	}
	e.arrivals.mu.Lock()
	var dropped *message.Message
	kept := e.arrivals.list[:0]
	for _, m := range e.arrivals.list {
		select {
		case <-m.Acked():
			if !final && e.around.early.Load() {
				break // kept: told at Close if it never reaches the engine
			}
			if dropped == nil {
				dropped = m
			}
			continue
		case <-m.Nacked():
			continue
		default:
		}
		kept = append(kept, m)
	}
	clear(e.arrivals.list[len(kept):])
	e.arrivals.list = kept
	e.arrivals.size.Store(int64(len(kept)))
	e.arrivals.mu.Unlock()
	if dropped != nil {
		e.dropped(dropped, "", amqpretry.Attempt(dropped), "outside the Retry (a router middleware, or a handler middleware added before it)")
	}
}

// dropped says, once, that a retry this engine scheduled was acked without its
// handler running: where names the middleware's place.
func (e *engine) dropped(msg *message.Message, queue string, attempt int, where string) {
	if !e.droppedSaid.CompareAndSwap(false, true) {
		return
	}
	fields := watermill.LogFields{"message_uuid": msg.UUID, "attempt": attempt, "middleware": where, "said": "once"}
	if queue != "" {
		fields["queue"] = queue
	}
	e.cfg.Logger.Error("A retry was acked without its handler running: a middleware dropped it, and its work is never done. Watermill's Deduplicator does that to every retry: it records a message's key before the handler runs and keeps it when the handler fails, so the retry, with the same UUID and payload, is taken for a duplicate",
		fmt.Errorf("message %s, attempt %d: give the Deduplicator KeyFactory: amqpretry.DedupKey (a retry has the next attempt), or remove it and set amqpretry.Config.Dedup, which remembers a message only once it is handled: %w", msg.UUID, attempt, errRetryDropped),
		fields)
}

// errRetryDropped is wrapped by the error logged when a retry was dropped.
var errRetryDropped = errors.New("retry dropped before its handler")
