package middleware

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/amqperr"
	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/names"
	"github.com/amqpretry/amqpretry/topology"
)

// Lines: where the messages of a blocked key wait behind its head (order.go): a queue
// of the broker's per key (brokerLines), or, in-process, this process's memory
// (memoryLines).

// lines keeps the messages behind blocked keys.
type lines interface {
	// put puts msg behind k, confirmed, if k is blocked; false, nothing done, if not.
	put(ctx context.Context, k orderKey, msg *message.Message) (bool, error)
	// block blocks k behind head (a message's UUID): the place behind it exists,
	// empty or not, and head is marked as k's head, once it returns nil. prev, if
	// not "" nor head, is k's head it replaces: no longer marked.
	block(k orderKey, head, prev string) error
	// isHead tells whether head is marked as k's head (false when k is not blocked).
	isHead(k orderKey, head string) (bool, error)
	// open opens the messages behind k, to take them in order.
	open(k orderKey) (cursor, error)
	// unblock removes the place behind k, and its head's mark (head), if nothing is
	// behind it (false if something is); a k not blocked is unblocked already.
	unblock(k orderKey, head string) (bool, error)
	// guard makes sure that k is released behind head if this process dies before
	// it unblocks k: a release of k (releaseOf), sent to k's work queue, confirmed.
	// Nothing for lines that die with the process.
	guard(ctx context.Context, k orderKey, head string) error
}

// cursor takes the messages behind a key, in order.
type cursor interface {
	// next takes the first message behind the key, nil when none is left, and how to
	// settle it: ack removes it, a nack puts it back in front, in order.
	next() (*message.Message, func(ack bool) error, error)
	close()
}

// brokerLines keeps the messages behind each blocked key in a durable queue of its own
// on the broker (names.Names.Behind, declare.BehindQueue): a message is put behind a
// key with a mandatory publish to its queue, which the broker returns when the key
// has none, and taken with basic.get, on a channel of each release's own. The key's
// head is marked by a durable auto-delete exchange named for it
// (names.Names.BehindHead), bound to the queue: deleted with the queue, or when
// another head replaces it.
type brokerLines struct {
	handoff   backend.Handoff
	names     names.Names
	unmarshal func(amqp.Delivery) (*message.Message, error)
}

func (b brokerLines) queue(k orderKey) string { return b.names.Behind(k.queue, k.key) }

func (b brokerLines) put(ctx context.Context, k orderKey, msg *message.Message) (bool, error) {
	err := b.handoff.Publish(ctx, "", b.queue(k), msg, nil, true, nil)
	if errors.Is(err, backend.ErrReturned) {
		return false, nil
	}
	return err == nil, err
}

func (b brokerLines) mark(k orderKey, head string) string {
	return b.names.BehindHead(k.queue, k.key, head)
}

func (b brokerLines) block(k orderKey, head, prev string) error {
	ch, err := b.channel()
	if err != nil {
		return err
	}
	defer ch.Close() //nolint:errcheck // a refused declare has closed it already
	// The head is marked before its key's queue is declared: a process that dies in
	// between leaves a mark and no queue, a key not blocked, whose head releases
	// nothing and removes the mark when it runs again. A queue without a mark would
	// have no head to release it: the key's messages would wait behind it for good.
	mark := b.mark(k, head)
	if err := ch.ExchangeDeclare(mark, amqp.ExchangeDirect, true, true, false, false, nil); err != nil {
		return fmt.Errorf("declare exchange %q: %w", mark, err)
	}
	q := b.queue(k)
	t := topology.Topology{Queues: []topology.Queue{declare.BehindQueue(q, k.queue, k.key)}}
	if err := b.handoff.Ensure(topology.ModeDeclare, t); err != nil {
		return fmt.Errorf("declare queue %q: %w", q, err)
	}
	// Marked before the old mark goes: a process that dies in between leaves both,
	// and the messages it gives back (the head that ran, the one that became the
	// head) make the old one run again and replace itself.
	if err := ch.QueueBind(q, headBinding, mark, false, nil); err != nil {
		return fmt.Errorf("bind queue %q to exchange %q: %w", q, mark, err)
	}
	if prev != "" && prev != head {
		old := b.mark(k, prev)
		if err := ch.ExchangeDelete(old, false, false); err != nil && !amqperr.IsCode(err, amqp.NotFound) {
			return fmt.Errorf("delete exchange %q: %w", old, err)
		}
	}
	return nil
}

// headBinding is the routing key of a head's mark's binding: nothing is published to
// the mark.
const headBinding = "head"

func (b brokerLines) isHead(k orderKey, head string) (bool, error) {
	ch, err := b.channel()
	if err != nil {
		return false, err
	}
	defer ch.Close() //nolint:errcheck // closed by the broker on 404
	mark := b.mark(k, head)
	err = ch.ExchangeDeclarePassive(mark, amqp.ExchangeDirect, true, true, false, false, nil)
	switch {
	case err == nil:
		return true, nil
	case amqperr.IsCode(err, amqp.NotFound):
		return false, nil
	}
	return false, fmt.Errorf("check exchange %q: %w", mark, err)
}

// channel opens a channel of its own on the hand-off connection.
func (b brokerLines) channel() (*amqp.Channel, error) {
	conn, err := b.handoff.Connection()
	if err != nil {
		return nil, err
	}
	ch, err := conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("open a channel: %w", err)
	}
	return ch, nil
}

func (b brokerLines) open(k orderKey) (cursor, error) {
	ch, err := b.channel()
	if err != nil {
		return nil, fmt.Errorf("read queue %q: %w", b.queue(k), err)
	}
	return &brokerCursor{ch: ch, queue: b.queue(k), unmarshal: b.unmarshal}, nil
}

func (b brokerLines) unblock(k orderKey, head string) (bool, error) {
	ch, err := b.channel()
	if err != nil {
		return false, err
	}
	defer ch.Close() //nolint:errcheck // a refused delete has closed it already
	// ifEmpty: a message put behind the key since would be lost with the queue. The
	// messages taken are all acked before (basic.get's unacked ones are not counted).
	_, err = ch.QueueDelete(b.queue(k), false, true, false)
	switch {
	case amqperr.IsCode(err, amqp.PreconditionFailed):
		return false, nil
	case err != nil && !amqperr.IsCode(err, amqp.NotFound):
		return false, fmt.Errorf("delete queue %q: %w", b.queue(k), err)
	}
	if head != "" {
		// Deleted with its queue, unless it was never bound: a process died
		// between declaring and binding it.
		if ch, err = b.channel(); err == nil {
			_ = ch.ExchangeDelete(b.mark(k, head), false, false)
			_ = ch.Close()
		}
	}
	return true, nil
}

func (b brokerLines) guard(ctx context.Context, k orderKey, head string) error {
	return b.handoff.Publish(ctx, "", k.queue, releaseOf(k, head), nil, true, nil)
}

// brokerCursor reads one key's behind queue with basic.get.
type brokerCursor struct {
	ch        *amqp.Channel
	queue     string
	unmarshal func(amqp.Delivery) (*message.Message, error)
	gone      bool // the queue does not exist: nothing behind the key
}

func (c *brokerCursor) next() (*message.Message, func(ack bool) error, error) {
	if c.gone {
		return nil, nil, nil
	}
	d, ok, err := c.ch.Get(c.queue, false)
	switch {
	case amqperr.IsCode(err, amqp.NotFound):
		c.gone = true
		return nil, nil, nil
	case err != nil:
		return nil, nil, fmt.Errorf("read queue %q: %w", c.queue, err)
	case !ok:
		return nil, nil, nil
	}
	msg, err := c.unmarshal(d)
	if err != nil {
		_ = d.Nack(false, true)
		return nil, nil, fmt.Errorf("read queue %q: %w", c.queue, err)
	}
	return msg, func(ack bool) error {
		if ack {
			return d.Ack(false)
		}
		return d.Nack(false, true)
	}, nil
}

func (c *brokerCursor) close() { _ = c.ch.Close() }

// memoryLines keeps the messages behind each blocked key in this process (the memory
// backend, in-process): lost with the process, like the memory backend's retries.
type memoryLines struct {
	mu   sync.Mutex
	seq  uint64
	line map[orderKey][]behindMsg
	head map[orderKey]string
}

// behindMsg is a message behind a key, numbered in the order it was put there.
type behindMsg struct {
	seq uint64
	msg *message.Message
}

func (m *memoryLines) put(_ context.Context, k orderKey, msg *message.Message) (bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	l, ok := m.line[k]
	if !ok {
		return false, nil
	}
	m.seq++
	m.line[k] = append(l, behindMsg{seq: m.seq, msg: msg})
	return true, nil
}

func (m *memoryLines) block(k orderKey, head, _ string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.line == nil {
		m.line, m.head = map[orderKey][]behindMsg{}, map[orderKey]string{}
	}
	if _, ok := m.line[k]; !ok {
		m.line[k] = []behindMsg{}
	}
	m.head[k] = head
	return nil
}

func (m *memoryLines) isHead(k orderKey, head string) (bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	_, blocked := m.line[k]
	return blocked && m.head[k] == head, nil
}

func (m *memoryLines) open(k orderKey) (cursor, error) { return memoryCursor{m: m, k: k}, nil }

func (m *memoryLines) unblock(k orderKey, _ string) (bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.line[k]) > 0 {
		return false, nil
	}
	delete(m.line, k)
	delete(m.head, k)
	return true, nil
}

func (m *memoryLines) guard(context.Context, orderKey, string) error { return nil }

type memoryCursor struct {
	m *memoryLines
	k orderKey
}

func (c memoryCursor) next() (*message.Message, func(ack bool) error, error) {
	c.m.mu.Lock()
	defer c.m.mu.Unlock()
	l := c.m.line[c.k]
	if len(l) == 0 {
		return nil, nil, nil
	}
	first := l[0]
	c.m.line[c.k] = l[1:]
	msg := first.msg.Copy()
	return msg, func(ack bool) error {
		if ack {
			return nil
		}
		c.m.mu.Lock()
		defer c.m.mu.Unlock()
		l := c.m.line[c.k]
		i, _ := slices.BinarySearchFunc(l, first.seq, func(b behindMsg, seq uint64) int { return int(b.seq) - int(seq) })
		c.m.line[c.k] = slices.Insert(l, i, first)
		return nil
	}, nil
}

func (memoryCursor) close() {}
