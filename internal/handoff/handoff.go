// Package handoff is the hand-off, the delay publisher: the confirmed publish, on a
// connection of its own, through which every copy reaches the broker before its
// original is acked (backend.Handoff). The middleware and ops dial it (Dial); the
// delay backends park through it.
package handoff

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/backend"
	"github.com/amqpretry/amqpretry/internal/declare"
	"github.com/amqpretry/amqpretry/internal/marshal"
	"github.com/amqpretry/amqpretry/internal/redact"
	"github.com/amqpretry/amqpretry/internal/wire"
	"github.com/amqpretry/amqpretry/topology"
)

// The hand-off: the design's delay publisher, through which every copy reaches the
// broker confirmed before its original is acked.

// publisher is the hand-off (backend.Handoff): it publishes with confirms. Every publish is persistent, carries a fresh
// MessageId and no expiration, and goes out on a confirm-mode channel of the hand-off's
// own connection. It is safe for concurrent use: concurrent publishes share one channel
// with deferred confirmations. After a channel or connection failure the next publish
// opens a new one.
type publisher struct {
	cfg backend.HandoffConfig

	mu     sync.Mutex // guards conn, pc and closed
	conn   *amqp.Connection
	pc     *pubChannel
	closed bool // by Close: nothing is opened again
}

// pubChannel is one confirm-mode channel and the returns it has seen.
type pubChannel struct {
	ch       *amqp.Channel
	returns  chan amqp.Return
	frameMax int // negotiated; 0 means no limit
	closes   chan *amqp.Error

	mu       sync.Mutex
	returned map[string]amqp.Return // by MessageId
	closeErr *amqp.Error            // why the broker closed ch, once known
}

// returnsBuffer must exceed the publishes that can be in flight between two drains;
// amqp091-go blocks its reader on a full return listener.
const returnsBuffer = 4096

// dial connects to the broker and opens the confirm channel.
// Dial connects a hand-off to the broker and opens its confirm channel.
func Dial(cfg backend.HandoffConfig) (backend.Handoff, error) {
	p, err := dial(cfg)
	if err != nil {
		return nil, err // a nil interface, not a nil *publisher
	}
	return p, nil
}

func dial(cfg backend.HandoffConfig) (*publisher, error) {
	if cfg.ConfirmTimeout <= 0 {
		cfg.ConfirmTimeout = backend.DefaultConfirmTimeout
	}
	if cfg.Logger == nil {
		cfg.Logger = watermill.NopLogger{}
	}
	if cfg.AMQP.Locale == "" {
		cfg.AMQP.Locale = backend.Locale
	}
	h := &publisher{cfg: cfg}
	if _, err := h.channel(); err != nil {
		return nil, err
	}
	return h, nil
}

// channel returns the open confirm channel, reconnecting when it or its connection
// has closed.
func (h *publisher) channel() (*pubChannel, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil, backend.ErrClosed
	}
	if h.pc != nil && !h.pc.ch.IsClosed() {
		return h.pc, nil
	}
	if h.conn == nil || h.conn.IsClosed() {
		conn, err := backend.DialConn(h.cfg.URI, h.cfg.AMQP)
		if err != nil {
			return nil, err
		}
		h.conn = conn
		h.cfg.Logger.Debug("Hand-off connection opened", watermill.LogFields{"amqp_uri": redact.URI(h.cfg.URI)})
	}
	ch, err := h.conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("open hand-off channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		_ = ch.Close()
		return nil, fmt.Errorf("put hand-off channel in confirm mode: %w", err)
	}
	h.pc = &pubChannel{
		ch:       ch,
		returns:  ch.NotifyReturn(make(chan amqp.Return, returnsBuffer)),
		frameMax: h.conn.Config.FrameSize,
		closes:   ch.NotifyClose(make(chan *amqp.Error, 1)),
		returned: map[string]amqp.Return{},
	}
	return h.pc, nil
}

// Connection returns the hand-off connection (for example to read the broker's server
// properties), reconnecting if needed.
func (h *publisher) Connection() (*amqp.Connection, error) {
	if _, err := h.channel(); err != nil {
		return nil, err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.conn, nil
}

// Version is the broker's version from the server properties ("4.3.6"), or "".
func (h *publisher) Version() string {
	conn, err := h.Connection()
	if err != nil {
		return ""
	}
	v, _ := conn.Properties["version"].(string)
	return v
}

// Ensure applies t on a short-lived channel of the hand-off connection as mode says.
func (h *publisher) Ensure(mode topology.Mode, t topology.Topology) error {
	if mode == topology.ModeNone {
		return nil
	}
	conn, err := h.Connection()
	if err != nil {
		return err
	}
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open topology channel: %w", err)
	}
	defer ch.Close() //nolint:errcheck // a failed declare has closed it already
	return t.Apply(ch, mode)
}

// Publish marshals msg (without mutating it), adds headers, and publishes it to
// exchange with routing key key. When the broker answers that the route is gone (the
// publish is returned unroutable, or the exchange does not exist) and owned is not
// nil, it declares owned again and publishes once more (in topology.ModeDeclare
// only): a poison queue, tier queue or exchange of the library's deleted while the
// application runs comes back at the first message that needs it. Non-mandatory, a
// publish that no queue takes is confirmed as well: the caller must know it is
// routable.
func (h *publisher) Publish(ctx context.Context, exchange, key string, msg *message.Message, headers amqp.Table, mandatory bool, owned func() topology.Topology) error {
	p, err := marshal.Marshaler{Options: h.cfg.Marshal}.Marshal(msg)
	if err != nil {
		return fmt.Errorf("marshal message %s: %w", msg.UUID, err)
	}
	// p.Headers is the marshaler's own: no clone.
	maps.Copy(p.Headers, headers)
	err = h.publish(ctx, exchange, key, p, mandatory)
	if err == nil || owned == nil || !backend.RouteGone(err) || (h.cfg.Topology != topology.ModeDeclare && h.cfg.Topology != "") {
		return err
	}
	if derr := h.Ensure(topology.ModeDeclare, owned()); derr != nil {
		return errors.Join(err, fmt.Errorf("declare the route again: %w", derr))
	}
	h.cfg.Logger.Error("Route of a hand-off was gone; declared it again", err, watermill.LogFields{
		"message_uuid": msg.UUID, "exchange": exchange, "routing_key": key,
	})
	return h.publish(ctx, exchange, key, p, mandatory)
}

// ToQueue publishes msg to queue, a poison queue, through the default exchange,
// mandatory. A queue that is gone is declared again (declare.ReviewQueue).
func (h *publisher) ToQueue(ctx context.Context, queue string, msg *message.Message) error {
	owned := func() topology.Topology {
		return topology.Topology{Queues: []topology.Queue{declare.ReviewQueue(queue, "poison")}}
	}
	return h.Publish(ctx, "", queue, msg, nil, true, owned)
}

// publish publishes p and waits for the broker's confirm. It returns nil only if the
// broker confirmed the message and, when mandatory, did not return it.
func (h *publisher) publish(ctx context.Context, exchange, key string, p amqp.Publishing, mandatory bool) error {
	p.DeliveryMode = amqp.Persistent
	p.Expiration = ""
	p.MessageId = watermill.NewULID()

	pc, err := h.channel()
	if err != nil {
		return err
	}
	if err := fitsFrame(p, pc.frameMax); err != nil {
		return fmt.Errorf("publish to exchange %q with key %q: %w", exchange, key, err)
	}
	ctx, cancel := context.WithTimeout(ctx, h.cfg.ConfirmTimeout)
	defer cancel()

	dc, err := pc.ch.PublishWithDeferredConfirmWithContext(ctx, exchange, key, mandatory, false, p)
	if err != nil {
		return fmt.Errorf("publish to exchange %q with key %q: %w", exchange, key, err)
	}
	ok, err := dc.WaitContext(ctx)
	// The broker sends basic.return before the ack, and amqp091-go hands the return to
	// our buffered listener before it processes the ack, so it is in the buffer now.
	ret, returned := pc.takeReturn(p.MessageId)
	switch {
	case err != nil:
		return fmt.Errorf("publish to exchange %q with key %q: %w: %w", exchange, key, backend.ErrNotConfirmed, err)
	case !ok && pc.closeReason() != nil:
		return fmt.Errorf("publish to exchange %q with key %q: %w: %w", exchange, key, backend.ErrNotConfirmed, pc.closeReason())
	case !ok:
		return fmt.Errorf("publish to exchange %q with key %q: %w", exchange, key, backend.ErrNotConfirmed)
	case returned:
		return fmt.Errorf("publish to exchange %q with key %q: %w: %d %s", exchange, key, backend.ErrReturned, ret.ReplyCode, ret.ReplyText)
	}
	return nil
}

// fitsFrame checks that p's content header frame fits in frameMax bytes (0: no
// limit): frame header and end (8 bytes), class, weight and body size (12), property
// flags (2), every short-string property at its full length plus its length byte, the
// delivery mode and priority (2), the timestamp (8), and the headers table, sized
// without encoding it.
func fitsFrame(p amqp.Publishing, frameMax int) error {
	if frameMax <= 0 {
		return nil
	}
	headers, err := wire.Size(p.Headers)
	if err != nil {
		return fmt.Errorf("headers: %w", err)
	}
	size := 8 + 12 + 2 + 2 + 8 + headers
	for _, s := range []string{p.ContentType, p.ContentEncoding, p.CorrelationId, p.ReplyTo, p.Expiration, p.MessageId, p.Type, p.UserId, p.AppId} {
		size += 1 + len(s)
	}
	if size > frameMax {
		return fmt.Errorf("%w: header frame of %d bytes (headers table %d) over frame_max %d", backend.ErrTooLarge, size, headers, frameMax)
	}
	return nil
}

// closeReason returns the error the broker closed the channel with, if it has. The
// channel sends it to its close listener before it nacks the pending confirms, so it
// is there when a confirm comes back negative.
func (pc *pubChannel) closeReason() *amqp.Error {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	if pc.closeErr == nil {
		select {
		case e := <-pc.closes:
			pc.closeErr = e
		default:
		}
	}
	return pc.closeErr
}

// takeReturn moves every buffered return into the map and takes the one for id.
func (pc *pubChannel) takeReturn(id string) (amqp.Return, bool) {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	for drained := false; !drained; {
		select {
		case r, open := <-pc.returns:
			if open {
				pc.returned[r.MessageId] = r
			}
			drained = !open
		default:
			drained = true
		}
	}
	r, ok := pc.returned[id]
	delete(pc.returned, id)
	return r, ok
}

// Close closes the hand-off connection, for good (a publish after it fails with
// backend.ErrClosed, opening nothing), waiting at most ConfirmTimeout for the broker
// (a node that lost its majority may never answer).
func (h *publisher) Close() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.closed = true
	if h.conn == nil || h.conn.IsClosed() {
		return nil
	}
	return h.conn.CloseDeadline(time.Now().Add(h.cfg.ConfirmTimeout))
}
