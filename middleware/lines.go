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
	// block blocks k: the place behind it exists, empty or not, once it returns nil.
	block(k orderKey) error
	// open opens the messages behind k, to take them in order.
	open(k orderKey) (cursor, error)
	// unblock removes the place behind k if nothing is behind it (false if something
	// is); a k not blocked is unblocked already.
	unblock(k orderKey) (bool, error)
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
// has none, and taken with basic.get, on a channel of each release's own.
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

func (b brokerLines) block(k orderKey) error {
	q := b.queue(k)
	t := topology.Topology{Queues: []topology.Queue{declare.BehindQueue(q, k.queue, k.key)}}
	if err := b.handoff.Ensure(topology.ModeDeclare, t); err != nil {
		return fmt.Errorf("declare queue %q: %w", q, err)
	}
	return nil
}

func (b brokerLines) open(k orderKey) (cursor, error) {
	conn, err := b.handoff.Connection()
	if err != nil {
		return nil, err
	}
	ch, err := conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("open a channel to read queue %q: %w", b.queue(k), err)
	}
	return &brokerCursor{ch: ch, queue: b.queue(k), unmarshal: b.unmarshal}, nil
}

func (b brokerLines) unblock(k orderKey) (bool, error) {
	conn, err := b.handoff.Connection()
	if err != nil {
		return false, err
	}
	ch, err := conn.Channel()
	if err != nil {
		return false, err
	}
	defer ch.Close() //nolint:errcheck // a refused delete has closed it already
	// ifEmpty: a message put behind the key since would be lost with the queue. The
	// messages taken are all acked before (basic.get's unacked ones are not counted).
	_, err = ch.QueueDelete(b.queue(k), false, true, false)
	switch {
	case err == nil, amqperr.IsCode(err, amqp.NotFound):
		return true, nil
	case amqperr.IsCode(err, amqp.PreconditionFailed):
		return false, nil
	}
	return false, fmt.Errorf("delete queue %q: %w", b.queue(k), err)
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

func (m *memoryLines) block(k orderKey) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.line == nil {
		m.line = map[orderKey][]behindMsg{}
	}
	if _, ok := m.line[k]; !ok {
		m.line[k] = []behindMsg{}
	}
	return nil
}

func (m *memoryLines) open(k orderKey) (cursor, error) { return memoryCursor{m: m, k: k}, nil }

func (m *memoryLines) unblock(k orderKey) (bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.line[k]) > 0 {
		return false, nil
	}
	delete(m.line, k)
	return true, nil
}

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
