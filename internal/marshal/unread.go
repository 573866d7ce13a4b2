package marshal

import (
	"context"
	"sync"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/amqpretry/amqpretry/internal/ctxkey"
	"github.com/amqpretry/amqpretry/internal/keys"
)

// A subscriber built from a Retry's config whose router handler has no middleware of
// the Retry: a failed message is nacked with requeue and comes back at once, at wire
// speed, for ever. Nothing can see it at subscribe (Watermill builds the handler's
// middlewares after it subscribes); its marshaler sees the message come back. Reads is
// the Retry's record of the subscriber marks (keys.Subscriber) its middleware has read
// a message of; a Guard, one per subscriber config, refuses the redelivery of a
// message it unmarshalled that a router handler then nacked, while no middleware of
// the Retry has read a message of its mark. A subscriber read without a router (its
// messages acked and nacked by hand, as Watermill's pub/sub tests do) is left alone.
// On the way of every message it costs two atomic loads, once the mark is read.

// maxUnread bounds the messages a Guard remembers for a mark no middleware has read:
// it forgets them all past it.
const maxUnread = 10_000

// Reads records, for one Retry, which subscriber marks a middleware of the Retry has
// read a message of.
type Reads struct {
	// Refuse is called on the refused redelivery of msg (refusals: how many times in
	// a row, from 1; first: the first of its mark; outside: a middleware outside the
	// Retry failed it, the mark read) and returns the error Unmarshal returns: it
	// names the fix, logs, paces.
	Refuse func(msg *message.Message, refusals int, first, outside bool) error

	unread atomic.Int64 // marks delivered and not read yet
	marks  sync.Map     // mark → *markReads
}

type markReads struct {
	read   atomic.Bool
	mu     sync.Mutex
	logged bool
	// delivered are the messages unmarshalled while the mark is unread, by UUID:
	// their Nacked channel, and how many of their redeliveries were refused.
	delivered map[string]unread
}

type unread struct {
	nacked   <-chan struct{}
	refusals int
}

// Read records that a middleware of the Retry read a message of mark. Called on
// receipt of every message: it returns at once when every mark delivered is read.
func (r *Reads) Read(mark string) {
	if r == nil || r.unread.Load() == 0 {
		return
	}
	v, ok := r.marks.Load(mark)
	if !ok {
		return
	}
	m := v.(*markReads)
	if m.read.CompareAndSwap(false, true) {
		r.unread.Add(-1)
		m.mu.Lock()
		m.delivered = nil
		m.mu.Unlock()
	}
}

// Guard returns the guard of one subscriber config, attached to r.
func (r *Reads) Guard() *Guard {
	g := NewGuard()
	g.Attach(r)
	return g
}

// NewGuard returns the guard of one subscriber config, not attached yet: the Retry
// attaches its Reads (Attach) when its Delivered gets the first message the guard's
// marshaler unmarshals, which carries the guard in its context (ctxkey.Guard) for
// that call. A transport thus guards with the Retry's Reads without the Retry's public
// API naming them. A message goes through a guard not attached.
func NewGuard() *Guard {
	g := &Guard{}
	g.ask = context.WithValue(context.Background(), ctxkey.Guard{}, g)
	return g
}

// Attach attaches g to r, the Retry's Reads, unless it is attached already.
func (g *Guard) Attach(r *Reads) {
	if r != nil {
		g.reads.CompareAndSwap(nil, r)
	}
}

// Guard is a subscriber config's side of Reads.
type Guard struct {
	reads atomic.Pointer[Reads]     // Attach's
	ask   context.Context           // carries the guard (ctxkey.Guard) until it is attached
	mark  atomic.Pointer[markReads] // its mark's, found once
	// routed: a message of the config's subscribers went through a router's
	// handler, seen on last, the message let through last, once it was settled.
	routed atomic.Bool
	last   atomic.Pointer[message.Message]

	// Once the mark is read: the messages nacked by their router handler without
	// passing through the Retry's middleware (one outside it failed them), the
	// latest maxOutside, and how many of their redeliveries were paced.
	mu       sync.Mutex
	failedBy map[string]int
	failed   atomic.Int64 // len(failedBy), read without the lock
	said     bool
}

// maxOutside bounds the messages failed outside the Retry that a Guard remembers.
const maxOutside = 1_000

// outside paces the redelivery of a message that a router handler nacked before the
// Retry's middleware read it (a middleware outside the Retry failed it: an open
// CircuitBreaker, say), which the broker would otherwise redeliver at once, again and
// again: Reads.Refuse pauses it, longer each time, then it goes through, and runs once
// the middleware outside lets it. It looks at the message let through before msg,
// settled by then with sequential delivery: on the way of every message, one atomic
// swap and two channel polls.
func (g *Guard) outside(msg *message.Message, redelivered bool) error {
	last := g.last.Swap(msg)
	if last != nil && last.UUID != "" && closed(last.Nacked()) && message.HandlerNameFromCtx(last.Context()) != "" {
		passed := last.Context().Value(ctxkey.Chain{}) != nil
		if !passed || g.failed.Load() > 0 {
			g.mu.Lock()
			switch {
			case passed:
				delete(g.failedBy, last.UUID)
			case g.failedBy == nil || len(g.failedBy) >= maxOutside:
				g.failedBy = map[string]int{last.UUID: 0}
			default:
				if _, ok := g.failedBy[last.UUID]; !ok {
					g.failedBy[last.UUID] = 0
				}
			}
			g.failed.Store(int64(len(g.failedBy)))
			g.mu.Unlock()
		}
	}
	if !redelivered || msg.UUID == "" || g.failed.Load() == 0 {
		return nil
	}
	g.mu.Lock()
	n, failed := g.failedBy[msg.UUID]
	if !failed {
		g.mu.Unlock()
		return nil
	}
	n++
	g.failedBy[msg.UUID] = n
	first := !g.said
	g.said = true
	g.mu.Unlock()
	return g.reads.Load().Refuse(msg, n, first, true)
}

// admit lets msg, just unmarshalled and marked (keys.Subscriber), through, or refuses
// it (Reads.Refuse): a redelivery of a message this guard let through and that was
// nacked, where the config's messages go through a router's handler and no middleware
// of the Retry has read a message of its mark. A message without a UUID cannot be told
// from another and goes through.
func (g *Guard) admit(msg *message.Message, redelivered bool) error {
	reads := g.reads.Load()
	if reads == nil {
		return nil
	}
	m := g.mark.Load()
	if m == nil {
		v, loaded := reads.marks.LoadOrStore(msg.Metadata[keys.Subscriber], &markReads{})
		if !loaded {
			reads.unread.Add(1)
		}
		m = v.(*markReads)
		g.mark.Store(m)
	}
	if m.read.Load() {
		return g.outside(msg, redelivered)
	}
	if !g.routed.Load() {
		// Settled, its handler's context was written before (the router writes it,
		// then runs the handler, which settles it).
		if last := g.last.Load(); last != nil && (closed(last.Acked()) || closed(last.Nacked())) && message.HandlerNameFromCtx(last.Context()) != "" {
			g.routed.Store(true)
		}
	}
	g.last.Store(msg)
	if msg.UUID == "" {
		return nil
	}
	m.mu.Lock()
	if m.read.Load() {
		m.mu.Unlock()
		return nil
	}
	u, seen := m.delivered[msg.UUID]
	if redelivered && seen && closed(u.nacked) && g.routed.Load() {
		u.refusals++
		m.delivered[msg.UUID] = u
		first := !m.logged
		m.logged = true
		m.mu.Unlock()
		return reads.Refuse(msg, u.refusals, first, false)
	}
	if m.delivered == nil || len(m.delivered) >= maxUnread {
		m.delivered = map[string]unread{}
	}
	m.delivered[msg.UUID] = unread{nacked: msg.Nacked()}
	m.mu.Unlock()
	return nil
}

func closed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}
